"""Privacy accounting: thin wrappers around Opacus' accountants (invariant P5).

Every epsilon this project reports is computed here from the full history of
what actually ran: a sequence of (sigma, q, steps) records of the
Poisson-subsampled Gaussian mechanism, composed over ALL rounds (never reset
per round). The same function serves sites and server, so both compute the
same number from the same history.

Opacus does the mathematics (``opacus.accountants``):
- "rdp" (default): RDPAccountant, Renyi DP of the sampled Gaussian mechanism
  (Mironov et al. 2019) with the RDP -> (eps, delta) conversion of Balle et
  al. 2020. We evaluate it on Opacus' default orders extended with larger
  ones (up to 1024): every order gives a valid bound and we take the
  minimum, but Opacus' default list stops at 63, which makes small targets
  such as eps = 0.2 needlessly loose (the optimum lies beyond 63).
- "prv": PRVAccountant (Gopi et al. 2021), numerical composition of privacy
  loss random variables; tighter, returns its upper bound (eps_error 0.01).

Opacus' accountants keep ``history`` as a list of (noise_multiplier,
sample_rate, num_steps) tuples; we set it directly from our records.
"""

from __future__ import annotations

import functools
import logging
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

ACCOUNTANTS = ("rdp", "prv")

# Extra Renyi orders beyond Opacus' DEFAULT_ALPHAS (which end at 63).
_EXTRA_ORDERS = (64, 72, 80, 96, 112, 128, 160, 192, 256, 320, 384, 512, 768, 1024)

# Calibration: relative precision of sigma, and the search range.
_SIGMA_RTOL = 1e-3
_SIGMA_MIN = 1e-2
_SIGMA_MAX = 1e4


@dataclass(frozen=True)
class StepRecord:
    """``steps`` steps of the Poisson-subsampled Gaussian mechanism with (sigma, q).

    sigma is the noise multiplier: noise std / clipping norm C.
    """

    sigma: float
    sample_rate: float
    steps: int

    def __post_init__(self) -> None:
        if isinstance(self.sigma, bool) or not isinstance(self.sigma, (int, float)):
            raise ValueError(f"sigma={self.sigma!r} must be a number")
        if not (self.sigma > 0 and math.isfinite(self.sigma)):
            raise ValueError(
                f"sigma={self.sigma!r} must be positive and finite (sigma = 0 means no noise: "
                "such steps have no finite epsilon and cannot be accounted)"
            )
        if isinstance(self.sample_rate, bool) or not isinstance(self.sample_rate, (int, float)):
            raise ValueError(f"sample_rate={self.sample_rate!r} must be a number")
        if not 0 < self.sample_rate <= 1:
            raise ValueError(f"sample_rate={self.sample_rate!r} must be in (0, 1]")
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"steps={self.steps!r} must be an int >= 1")


def _check_delta(delta: float) -> float:
    if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not 0 < delta < 1:
        raise ValueError(
            f"delta={delta!r} must be in (0, 1); use delta < 1/n for a site of n records "
            "(e.g. 1e-5)"
        )
    return float(delta)


def _check_accountant(accountant: str) -> str:
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant={accountant!r} is not supported; choose one of {ACCOUNTANTS}")
    return accountant


def check_delta(delta: float, n: int) -> None:
    """Refuse delta >= 1/n for a dataset of n records.

    With delta >= 1/n the mechanism "release one random record in the clear"
    satisfies (0, delta)-DP, so such a delta promises nothing.
    """
    value = _check_delta(delta)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r} must be a positive int (number of records at the site)")
    if value >= 1.0 / n:
        raise ValueError(
            f"delta={delta!r} >= 1/n = {1.0 / n:.3g} for n={n} records: such a delta allows "
            f"leaking a whole record; lower delta below {1.0 / n:.3g} (e.g. 1/(10 n))"
        )


def _merged(history: Sequence[StepRecord]) -> list[tuple[float, float, int]]:
    """Opacus history tuples, records with equal (sigma, q) merged.

    Composition is commutative (sum of RDP curves / convolution of PRVs), so
    merging only reduces work; it does not change the result.
    """
    totals: dict[tuple[float, float], int] = {}
    for record in history:
        if not isinstance(record, StepRecord):
            raise ValueError(
                f"history entries must be StepRecord(sigma, sample_rate, steps), got {record!r}"
            )
        key = (float(record.sigma), float(record.sample_rate))
        totals[key] = totals.get(key, 0) + record.steps
    return [(sigma, rate, steps) for (sigma, rate), steps in totals.items()]


@functools.lru_cache(maxsize=1)
def _orders() -> tuple[float, ...]:
    from opacus.accountants import RDPAccountant

    return tuple(RDPAccountant.DEFAULT_ALPHAS) + tuple(_EXTRA_ORDERS)


@functools.lru_cache(maxsize=4096)
def _rdp_one_step(sample_rate: float, sigma: float) -> Any:
    """Opacus' RDP curve of one sampled Gaussian step over ``_orders()`` (a numpy array; never mutated)."""
    from opacus.accountants.analysis.rdp import compute_rdp

    curve = compute_rdp(q=sample_rate, noise_multiplier=sigma, steps=1, orders=list(_orders()))
    curve.setflags(write=False)
    return curve


def _epsilon(entries: list[tuple[float, float, int]], delta: float, accountant: str) -> float:
    if not entries:
        # Opacus' RDP returns the int 0 and its PRV fails on an empty history.
        return 0.0
    if accountant == "rdp":
        from opacus.accountants.analysis.rdp import get_privacy_spent

        # Opacus' RDPAccountant.get_privacy_spent, with each (q, sigma)'s one-step curve computed once:
        # the curve of n steps is n times it (compute_rdp multiplies), and a site asks for the same few
        # (q, sigma) several times per message, at about 0.17 s each.
        total = sum(steps * _rdp_one_step(rate, sigma) for sigma, rate, steps in entries)
        eps, _ = get_privacy_spent(orders=list(_orders()), rdp=total, delta=delta)
        return float(eps)
    from opacus.accountants import PRVAccountant

    acc = PRVAccountant()
    acc.history = list(entries)
    with warnings.catch_warnings():
        # PRVAccountant sizes its discretisation domain with an internal RDP
        # bound on Opacus' default orders, which warns about the edge order;
        # that concerns the domain heuristic, not the PRV epsilon returned.
        warnings.filterwarnings("ignore", message="Optimal order is the")
        return float(acc.get_epsilon(delta=delta))


def epsilon_spent(
    history: Sequence[StepRecord], *, delta: float, accountant: str = "rdp"
) -> float:
    """Epsilon of the composition of the whole history at ``delta`` (P5).

    An empty history has spent nothing (0.0).
    """
    value = _check_delta(delta)
    _check_accountant(accountant)
    return _epsilon(_merged(history), value, accountant)


def _positive_int(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be an int >= 1")
    return value


def calibrate_sigma(
    *,
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: str = "rdp",
    history: Sequence[StepRecord] = (),
) -> float:
    """Smallest sigma (to 0.1 %) such that history + ``steps`` new steps stay <= target_epsilon.

    Bisection on sigma with Opacus' accountant; the returned sigma is always
    one whose epsilon was verified to be <= target (never overshoots).
    Raises if the history alone already reaches the target, or if even
    sigma = 1e4 cannot meet it.
    """
    if isinstance(target_epsilon, bool) or not isinstance(target_epsilon, (int, float)):
        raise ValueError(f"target_epsilon={target_epsilon!r} must be a number")
    if not (target_epsilon > 0 and math.isfinite(target_epsilon)):
        raise ValueError(
            f"target_epsilon={target_epsilon!r} must be positive and finite; raise the budget"
        )
    value_delta = _check_delta(delta)
    _check_accountant(accountant)
    if (
        isinstance(sample_rate, bool)
        or not isinstance(sample_rate, (int, float))
        or not 0 < sample_rate <= 1
    ):
        raise ValueError(
            f"sample_rate={sample_rate!r} must be in (0, 1]: q = expected batch size / site size"
        )
    _positive_int("steps", steps)
    past = _merged(history)
    spent = _epsilon(past, value_delta, accountant)
    if spent >= target_epsilon:
        raise ValueError(
            f"the history already spent eps={spent:.4g} >= target_epsilon={target_epsilon:g}; "
            "no further steps fit in this budget"
        )

    def eps_at(sigma: float) -> float:
        planned = _merged([*history, StepRecord(sigma, float(sample_rate), steps)])
        with warnings.catch_warnings():
            # Opacus warns when the optimal Renyi order is at the edge of the
            # list; that happens for the far-off candidates of the search.
            warnings.filterwarnings("ignore", message="Optimal order is the")
            return _epsilon(planned, value_delta, accountant)

    high = 1.0
    while eps_at(high) > target_epsilon:
        high *= 2.0
        if high > _SIGMA_MAX:
            raise ValueError(
                f"no sigma <= {_SIGMA_MAX:g} meets target_epsilon={target_epsilon:g} with "
                f"q={sample_rate:g}, steps={steps}; raise the budget, lower q or the steps"
            )
    low = high / 2.0
    while low > _SIGMA_MIN and eps_at(low) <= target_epsilon:
        high, low = low, low / 2.0
    while (high - low) > _SIGMA_RTOL * high:
        mid = 0.5 * (low + high)
        if eps_at(mid) <= target_epsilon:
            high = mid
        else:
            low = mid
    # `high` was verified at its last assignment; re-check once so the
    # contract does not rest on that bookkeeping.
    final = eps_at(high)
    while final > target_epsilon:
        high *= 1.0 + _SIGMA_RTOL
        final = eps_at(high)
    log.info(
        "calibrated sigma=%.4f for eps=%.4g (target %.4g), delta=%.3g, q=%.4g, steps=%d, "
        "%d past records, accountant=%s",
        high, final, target_epsilon, value_delta, sample_rate, steps, len(history), accountant,
    )
    return high
