"""What record-level DP can be expected to keep at a site's size and budget: its run's noise-to-signal figure and
where that falls on the measured data-scale curve (``fedpose site check``).

Over a run of T steps at noise multiplier sigma and expected batch B, the Gaussian noise the weights average has
norm about sigma C sqrt(p) / (B sqrt(T)) over p trained weights, whatever the batch (B and T trade one for the
other at a fixed epsilon and sampling rate). The signal it is measured against is the norm of the mean clipped
gradient, about 0.47 C at the reference ward's public start. Their ratio, the run's noise-to-signal figure,
falls as 1 / n at a fixed sampling rate and budget, so the curve measured on the reference ward (the share of
what non-private training gains that the best record-level recipe kept, at each measured size) tells a site
about where it stands and about how many records would keep half of the gain. The curve is measured, not a
model: it only says what the reference ward's runs did (docs/results/index.md, "How many records a site needs").

A site trains in a federation, accounting for its own records against a server it does not trust; the same study
measured the site kits' recipe so, across the reference ward's three sites, at each size. That second curve is
read in records per site (``federated_share``): it is what a site of that size in such a federation kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# The norm of the mean clipped gradient (in units of C) at the reference ward's public start: the signal of the
# noise-to-signal figure (docs/results/index.md, the fpdp terms: 0.465).
SIGNAL = 0.465
# Weights the default model trains under record-level DP (tinyvit-small, every weight but the three
# task-uncertainty weights, which stay at their public values under dpsgd and proj).
REFERENCE_WEIGHTS = 935_473
PAGE = "docs/results/index.md, \"How many records a site needs\""


@dataclass(frozen=True)
class CurvePoint:
    """One measured size: its records (pooled), its run's noise-to-signal figure and the share of the gain kept."""

    records: int
    noise_to_signal: float
    share: float
    recipe: str


# The best record-level recipe at each measured size, epsilon 0.8, on the reference ward (pooled runs of three
# sites; share = (score - start) / (non-private - start)). Filled from the results page's rows.
CURVE: tuple[CurvePoint, ...] = (
    CurvePoint(1_200, 8.78, 0.31, "the site kits' recipe (three seeds)"),
    CurvePoint(4_800, 2.23, 0.19, "the site kits' recipe (three seeds)"),
    CurvePoint(19_200, 0.60, 0.16, "the site kits' recipe (one seed)"),
)


@dataclass(frozen=True)
class FederatedPoint:
    """One measured size of the federated curve: records per site, the share of the gain kept and its seeds."""

    per_site: int
    share: float
    seeds: int


# The site kits' recipe federated across the reference ward's three sites (each accounting for its own records
# against an untrusted server, 30 epochs of its records) at epsilon 0.8, from the results page's rows.
FEDERATED_CURVE: tuple[FederatedPoint, ...] = (
    FederatedPoint(400, 0.29, 1),
    FederatedPoint(1_600, 0.18, 1),
    FederatedPoint(6_400, 0.13, 1),
)


def noise_to_signal(*, sigma: float, expected_batch: float, steps: int, weights: int = REFERENCE_WEIGHTS,
                    signal: float = SIGNAL) -> float:
    """sigma sqrt(p) / (B sqrt(T)) / signal: the norm of the noise a run averages over the mean clipped gradient's."""
    if not (sigma > 0 and expected_batch > 0 and steps >= 1 and weights >= 1 and signal > 0):
        raise ValueError(f"need sigma > 0, B > 0, steps >= 1, weights >= 1 and signal > 0; got sigma={sigma}, "
                         f"B={expected_batch}, steps={steps}, weights={weights}, signal={signal}")
    return sigma * math.sqrt(weights) / (expected_batch * math.sqrt(steps)) / signal


def share_kept(figure: float, curve: tuple[CurvePoint, ...] = CURVE) -> float:
    """The share of the gain the curve kept at this noise-to-signal figure: linear in log(figure) between measured
    points, the nearest measured point's share beyond them (the curve says nothing outside what was measured)."""
    return _read_in_log(figure, [(p.noise_to_signal, p.share) for p in curve])


def federated_share(per_site: int, curve: tuple[FederatedPoint, ...] = FEDERATED_CURVE) -> float:
    """The share of the gain the federated curve kept at ``per_site`` records per site: linear in log(records)
    between measured sizes, the nearest measured size's share beyond them (nothing outside what was measured)."""
    if per_site < 1:
        raise ValueError(f"need at least one record per site, got {per_site}")
    return _read_in_log(per_site, [(p.per_site, p.share) for p in curve])


def _read_in_log(x: float, measured: list[tuple[float, float]]) -> float:
    """y at x from measured (x, y) points: linear in log(x) between them, the nearest point's y beyond them."""
    points = sorted(measured)
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + math.log(x / x0) / math.log(x1 / x0) * (y1 - y0)
    return points[-1][1]


def records_for(share: float, *, records: int, figure: float,
                curve: tuple[CurvePoint, ...] = CURVE) -> int | None:
    """About how many records (at this site's sampling rate, budget and steps) would keep ``share`` of the gain on
    the measured curve: the figure falls as 1 / n, so n' = n figure / figure'. None: no measured size kept it."""
    points = sorted(curve, key=lambda p: p.noise_to_signal)
    reached = [p for p in points if p.share >= share]
    if not reached:
        return None
    # the largest figure (fewest records) on the curve at which the share is reached, between measured points
    best = max(reached, key=lambda p: p.noise_to_signal)
    index = points.index(best)
    target = best.noise_to_signal
    if index + 1 < len(points) and points[index + 1].share < share:
        low, high = best, points[index + 1]
        t = (share - low.share) / (high.share - low.share)
        target = low.noise_to_signal * (high.noise_to_signal / low.noise_to_signal) ** t
    return math.ceil(records * figure / target)


def outlook(*, records: int, sigma: float, expected_batch: float, steps: int, epsilon: float,
            unit: str = "records") -> str:
    """The lines ``fedpose site check`` prints: the figure, the share the curve kept there, half the gain."""
    figure = noise_to_signal(sigma=sigma, expected_batch=expected_batch, steps=steps)
    share = share_kept(figure)
    half = records_for(0.5, records=records, figure=figure)
    best = max(CURVE, key=lambda p: p.share)
    text = (f"record-level outlook: at {records} {unit} and eps {epsilon:g} (sigma {sigma:.3g}, B {expected_batch:g}, "
            f"{steps} steps) the noise a run averages is {figure:.2f} times the mean clipped gradient over the "
            f"default model's {REFERENCE_WEIGHTS:,} weights; on the reference ward's measured curve record-level DP "
            f"kept about {share:.2f} of what non-private training gains at that figure; ")
    if half is None:
        text += (f"no measured size kept half (the most: {best.share:.2f} at {best.records:,} records pooled, "
                 f"{best.recipe})")
    else:
        text += f"about {half:,} {unit} would keep half"
    return text + f" ({PAGE})\n" + _federated_line(records)


def _federated_line(per_site: int) -> str:
    """The federated curve at this site's records: the setting a site trains in."""
    sizes = [f"{p.per_site:,}" for p in FEDERATED_CURVE]
    seeds = sorted({p.seeds for p in FEDERATED_CURVE})
    runs = (f"{seeds[0]} seed{'s' * (seeds[0] > 1)} each" if len(seeds) == 1 else
            "seeds: " + ", ".join(str(p.seeds) for p in FEDERATED_CURVE))
    return (f"federated outlook: across three sites of {per_site:,} records, each accounting for its own records "
            f"against an untrusted server, the site kits' recipe kept about {federated_share(per_site):.2f} of the "
            f"gain at {per_site:,} records per site on the reference ward (measured at {', '.join(sizes[:-1])} and "
            f"{sizes[-1]} per site, {runs}; {PAGE})")
