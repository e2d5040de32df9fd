"""Clipping per-sample (per-patient) gradients and summing them: the sensitivity the accountant assumes.

DP-SGD (Abadi et al. 2016; FP-DP Algorithm 1, "sum_i clip(g_i, C)") bounds one
record's influence on the step by clipping each per-sample gradient to L2 norm C
before the sum; patient-level DP clips each patient's mean gradient instead
(McMahan et al. 2018). P14: every contribution is finite with norm <= C whatever
the weights: a non-finite gradient contributes zero (never an error, which would
tell whoever chose the weights that the record was sampled), a huge finite one is
clipped like any other.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch
from torch import Tensor

from fedpose.shared.privacy.step import bookkeeping, bookkeeping_plan
from fedpose.shared.privacy.step.batch_checks import batch_size_of, check_params
from fedpose.shared.privacy.step.persample import LossFn, iter_per_sample_grads, robust_norms, zero_rows
from fedpose.shared.privacy.step.tensor_scales import per_sample_chunks

# Added to the norm before dividing, as in Opacus, so that a zero gradient
# gets the factor min(1, C / 1e-6) = 1 instead of a division by zero.
NORM_EPS = 1e-6


class Contributions(NamedTuple):
    """What each per-sample (per-patient) gradient of a chunk may add to the clipped sum (P14): (b,) each."""

    factors: Tensor  # float64 min(1, C / (||g_i|| + 1e-6)); 0 where the norm is not finite
    finite: Tensor  # bool: the rows that contribute; the others are zeroed before scaling (0 x NaN is NaN)

    @property
    def zeroed(self) -> int:
        """How many rows contribute nothing (private: the site's own log only)."""
        return int((~self.finite).sum())


def bound_contributions(norms: Tensor, clip_norm: float) -> Contributions:
    """P14's enforcing function: every contribution to the noisy sum is finite with norm <= C, whatever the weights.

    ``norms`` (b,) float64 are the rows' L2 norms as ``persample.robust_norms`` (or the book-keeping tape) gives
    them: recomputed in float64 where float32 overflowed, so a norm is not finite exactly when its gradient holds
    an inf or a NaN. Such a row contributes zero (never an error: an error would tell whoever chose the weights
    that the record was sampled); a huge finite one is scaled to norm C like any other. The sums add
    ``factors_i g_i`` over the ``finite`` rows only (``persample.zero_rows`` first).
    """
    finite = torch.isfinite(norms)
    factors = (clip_norm / (norms + NORM_EPS)).clamp(max=1.0)
    return Contributions(torch.where(finite, factors, torch.zeros_like(factors)), finite)


def clip_factors(norms: Tensor, clip_norm: float) -> Tensor:
    """min(1, C / (||g_i|| + 1e-6)) per sample: (B,); 0 for a non-finite norm (P14: it contributes nothing)."""
    return bound_contributions(norms, clip_norm).factors


def _add_clipped(summed: Tensor, flat: Tensor, factors: Tensor, finite: Tensor) -> None:
    """summed += sum_i factors_i flat_i with non-finite rows left out (0 x NaN is NaN, so they are zeroed first)."""
    if not bool(finite.all()):
        flat = zero_rows(flat, finite)
    tiny = factors < bookkeeping.SMALLEST_FLOAT32_FACTOR
    regular = torch.where(tiny, torch.zeros_like(factors), factors).to(flat.dtype)
    total = regular @ flat  # (b,) @ (b, numel) -> (numel,): scale-and-sum as one matmul
    if bool((tiny & finite & (factors > 0)).any()):
        rows = (tiny & finite).nonzero().flatten()
        total = total + (factors[rows, None] * flat[rows].to(torch.float64)).sum(0).to(flat.dtype)
    summed.add_(total.view_as(summed))


def _check_clip_norm(clip_norm: float) -> float:
    try:
        value = float(clip_norm)
    except (TypeError, ValueError) as err:
        raise ValueError(f"clip_norm={clip_norm!r} must be a positive number") from err
    if not value > 0 or value == float("inf"):
        raise ValueError(
            f"clip_norm={clip_norm!r} must be a positive finite number (the per-sample "
            "L2 bound C; the paper uses C in {0.01, 0.1, 1.0})"
        )
    return value


class ClippedSum(NamedTuple):
    """The clipped sum, the pre-clipping norms (private diagnostics) and how many contributions were zeroed.

    ``zeroed``: per-sample (per-patient) gradients that were not finite and so contributed
    nothing (P14). It depends on private data: log it at the site only, never send it.
    """

    summed: dict[str, Tensor]
    norms: Tensor
    zeroed: int


def clipped_grad_sum(
    loss_fn: LossFn,
    params: Mapping[str, Tensor],
    batch: Mapping[str, Tensor],
    *,
    clip_norm: float,
    chunk_size: int,
    randomness: str = "different",
    scales: Mapping[str, float] | None = None,
) -> ClippedSum:
    """Sum of per-sample gradients each clipped to L2 norm ``clip_norm``.

    ``scales`` (``tensor_scales.public_scales``): each tensor of every per-sample gradient is multiplied by its
    scale before the norm, so the sum is sum_i clip(a * g_i, C) (its per-sample gradients are then formed in full,
    chunk by chunk, as for the public basis).

    FP-DP Algorithm 1: sum_i clip(g_i, C) with clip(g, C) = g min(1, C/||g||).
    Works chunk by chunk (only ``chunk_size`` per-sample gradients are alive
    at any time). Returns ``ClippedSum(summed, norms, zeroed)``: ``summed`` has
    the shapes of ``params``; ``norms`` (B,) are the pre-clipping per-sample
    norms (float64; diagnostics only - they are private data, never send them
    anywhere). An empty batch (B = 0) gives zero sums and an empty ``norms``.

    P14, whatever the weights: a per-sample gradient holding an inf or a NaN
    contributes zero (it is not an error: an error would tell whoever chose the
    weights that the record was sampled), and a huge finite one is clipped to
    norm C like any other; the sum is always finite.
    """
    clip = _check_clip_norm(clip_norm)
    check_params(params)
    summed = {name: torch.zeros_like(value.detach()) for name, value in params.items()}
    norms_parts: list[Tensor] = []
    zeroed = 0
    if scales is None and bookkeeping_plan.supports(loss_fn, params):  # one forward and backward per chunk
        for tape in bookkeeping.iter_tapes(loss_fn, params, batch, chunk_size=chunk_size):
            norms = tape.norms()  # (b,) float64
            bound = bound_contributions(norms, clip)
            tape.add_clipped(summed, bound.factors, bound.finite)
            zeroed += bound.zeroed
            norms_parts.append(norms)
            del tape  # let the next chunk reuse this one's memory
    else:
        # here either the tape does not cover the weights, or the scales need the per-sample gradients in full
        for grads in per_sample_chunks(loss_fn, params, batch, chunk_size=chunk_size, randomness=randomness):
            flats = {name: grad.reshape(grad.shape[0], -1) * (1.0 if scales is None else scales[name])
                     for name, grad in grads.items()}
            norms = robust_norms(list(flats.values()))  # (b,) float64
            bound = bound_contributions(norms, clip)  # (b,) float64 factors, 0 where not finite
            for name, flat in flats.items():
                _add_clipped(summed[name], flat, bound.factors, bound.finite)
            zeroed += bound.zeroed
            norms_parts.append(norms)
            del grads, flats
    if not norms_parts:  # empty batch: zero sum, no norms
        return ClippedSum(summed, next(iter(summed.values())).new_zeros((0,), dtype=torch.float64), 0)
    return ClippedSum(summed, torch.cat(norms_parts), zeroed)


def check_groups(groups: Tensor, size: int) -> int:
    """Validate per-record group ids (B,): 0, 1, ..., G-1, each group's records contiguous; returns G."""
    if not isinstance(groups, Tensor) or groups.dim() != 1 or groups.shape[0] != size:
        shape = tuple(groups.shape) if isinstance(groups, Tensor) else type(groups).__name__
        raise ValueError(f"groups must be a 1-d tensor with one group id per record ({size}), got {shape}")
    if groups.dtype.is_floating_point or groups.dtype == torch.bool:
        raise ValueError(f"groups must hold integer group ids, got {groups.dtype}")
    if size == 0:
        return 0
    steps = groups[1:] - groups[:-1]
    if int(groups[0]) != 0 or bool(((steps != 0) & (steps != 1)).any()):
        raise ValueError("groups must number the groups 0, 1, ..., G-1 with each group's records contiguous "
                         f"(e.g. [0, 0, 1, 2, 2]), got {groups.tolist()[:20]}")
    return int(groups[-1]) + 1


def _rows_finite(flats: list[Tensor]) -> Tensor:
    """(b,) True where every entry of the row is finite (max and min propagate inf and NaN; no b x numel temp)."""
    ok = torch.ones(flats[0].shape[0], dtype=torch.bool, device=flats[0].device)
    for flat in flats:
        ok &= torch.isfinite(flat.amax(dim=1)) & torch.isfinite(flat.amin(dim=1))
    return ok


def _group_means(grads: dict[str, Tensor], ids: Tensor, sizes: Tensor) -> tuple[dict[str, Tensor], Tensor]:
    """Per group of one chunk (``ids`` (b,): each row's group, contiguous), the mean of its rows' gradients
    divided by the group's whole size (``sizes``), so that a group split over chunks sums to its mean; and
    (g,) True for a group with a non-finite row (its rows count as zero here; the caller zeroes the group)."""
    b = ids.shape[0]
    local = ids - ids[0]  # 0..g-1 within the chunk
    g = int(local[-1]) + 1
    flats = {name: grad.reshape(b, -1) for name, grad in grads.items()}
    ok = _rows_finite(list(flats.values()))  # (b,)
    bad = torch.zeros(g, dtype=torch.long).index_add_(0, local, (~ok).long().cpu()) > 0  # (g,) poisoned groups
    weights = torch.zeros(g, b, dtype=torch.float64)
    weights[local, torch.arange(b)] = 1.0 / sizes[ids]  # row j averages group j's records
    means = {}
    for name, flat in flats.items():
        if not bool(ok.all()):
            flat = zero_rows(flat, ok)
        means[name] = weights.to(device=flat.device, dtype=flat.dtype) @ flat  # (g, numel)
    return means, bad


def clipped_group_sum(
    loss_fn: LossFn,
    params: Mapping[str, Tensor],
    batch: Mapping[str, Tensor],
    *,
    groups: Tensor,
    clip_norm: float,
    chunk_size: int,
    randomness: str = "different",
) -> ClippedSum:
    """Sum over groups (patients) of clip(mean of the group's per-record gradients, C).

    Patient-level DP-SGD (user-level DP, McMahan et al. 2018, "DP-FedAvg";
    issue #11): a patient's contribution to the step is the gradient of the
    mean loss over their records, clipped as a whole, so adding or removing a
    patient with all of their records moves the sum by at most C, whatever the
    number of records. ``groups`` (B,) numbers the patients of the batch 0..G-1
    with each patient's records contiguous (``fedpose.shared.data.patients.PatientGroups.expand``).

    Same per-record machinery and chunking as ``clipped_grad_sum``: per chunk
    each record's gradient, divided by its patient's record count, is summed
    into its patient's row (one small matmul; dividing first means the mean of
    huge finite gradients cannot overflow); a group that continues into the
    next chunk carries its partial mean over, so memory stays chunk_size x p
    plus one carried group. P14: a patient with any non-finite record gradient
    contributes zero. Returns ``ClippedSum``: ``norms`` (G,) are the per-patient
    mean gradients' norms before clipping (private diagnostics), ``zeroed`` the
    patients left out.
    """
    clip = _check_clip_norm(clip_norm)
    check_params(params)
    size = batch_size_of(batch)
    count = check_groups(groups, size)
    groups = groups.to(device="cpu", dtype=torch.long)
    sizes = torch.bincount(groups, minlength=count).to(torch.float64) if size else torch.zeros(0)  # (G,)
    summed = {name: torch.zeros_like(value.detach()) for name, value in params.items()}
    norms_parts: list[Tensor] = []
    zeroed = 0
    carry: dict[str, Tensor] | None = None  # partial mean of the group continuing from the last chunk
    carry_bad = False
    start = 0
    for grads in iter_per_sample_grads(loss_fn, params, batch, chunk_size=chunk_size, randomness=randomness):
        b = next(iter(grads.values())).shape[0]
        ids = groups[start:start + b]
        means, bad = _group_means(grads, ids, sizes)
        g = bad.shape[0]
        if carry is not None:  # the first group of this chunk began in the previous one
            for name in means:
                means[name][0] += carry[name]
            bad[0] |= carry_bad
        stop = start + b
        complete = g - 1 if stop < size and int(groups[stop]) == int(ids[-1]) else g
        if complete < g:
            carry = {name: value[g - 1].clone() for name, value in means.items()}
            carry_bad = bool(bad[g - 1])
        else:
            carry, carry_bad = None, False
        if complete:
            done = {name: value[:complete] for name, value in means.items()}
            norms = robust_norms(list(done.values()))  # (complete,) float64: one per group
            norms[bad[:complete].to(norms.device)] = float("nan")  # a poisoned patient: zeroed below
            bound = bound_contributions(norms, clip)
            for name, mean in done.items():
                _add_clipped(summed[name], mean, bound.factors, bound.finite)
            zeroed += bound.zeroed
            norms_parts.append(norms)
        start = stop
        del grads, means
    if not norms_parts:
        return ClippedSum(summed, next(iter(summed.values())).new_zeros((0,), dtype=torch.float64), 0)
    norms = torch.cat(norms_parts)
    if norms.shape[0] != count:  # pragma: no cover - bookkeeping guard
        raise RuntimeError(f"clipped_group_sum finished {norms.shape[0]} of {count} groups")
    return ClippedSum(summed, norms, zeroed)
