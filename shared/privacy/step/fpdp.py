"""The feature-projective DP-SGD gradient (docs/explanation/design.md: the step; FP-DP Algorithm 1): what one
private step does (``DPSpec``), the checks of its inputs, its clipped sums and ``dp_gradient``, which puts them
together.

    private batch B_priv ~ Poisson(q) from the site's raw images x
      g_i   = grad l(w, x_i)                              per sample
      g     = (sum_i clip(g_i, C) + N(0, sigma^2 C^2 I)) / B
      g     = V (V^T g)                                   post-processing
    public batch B_psi: psi(x)
      g_pub = mean_x grad l(w, psi(x))                    no clip, no noise
    update  w <- optimizer(w, g_pub + g)

Methods: nonprivate (plain mean gradient), dpsgd (no V, no g_pub), proj (V,
no g_pub), fdp (g_pub, no V), fpdp (both).

Privacy unit (issue #11): ``record`` as above; ``patient`` samples patients
with rate q_p (Poisson over patients), replaces clip(g_i, C) by
clip(mean of the patient's per-record gradients, C) for each sampled patient
(at most ``privacy.max_records_per_patient`` records each) and divides by the
declared expected number of sampled patients. Noise, projection and the
public gradient are unchanged; for fdp/fpdp psi(x) of every image of a patient
stays public by assumption.

Augmentation multiplicity (De et al. 2022, section 3.1; ``multiplicity`` K > 1,
record level): every sampled record enters the batch as K augmented copies and
its term of the sum is clip(mean of its K copies' gradients, C): one clipped
term per record, as without it, so the sensitivity, the noise and the
accountant's epsilon are those of K = 1; the mean over augmentations has less
variance than one augmentation, so less of C is spent on it.

Clipping (``clipped_grad_sum``, ``clipped_group_sum``): DP-SGD (Abadi et al. 2016;
"sum_i clip(g_i, C)") bounds one record's influence on the step by clipping each
per-sample gradient to L2 norm C before the sum, the sensitivity the accountant assumes;
patient-level DP clips each patient's mean gradient instead (McMahan et al. 2018). The
per-sample gradients come from the book-keeping tape where it covers the weights
(``bookkeeping``), from ``vmap`` otherwise (``persample``), and every contribution is
bounded by ``persample.bound_contributions`` (P14).

The privacy audit plugs into a step through ``StepAudit`` and the hook the step defines,
``StepCanaries`` (the audit's gradient canaries are such hooks); the step imports nothing
of the audit.

Invariants enforced here:
- P1: noise is drawn once per step and added to the SUM of clipped
  per-sample gradients; the projection is applied after the noise.
- P3: the public gradient only accepts a ``PsiBatch`` (built by
  ``psi.apply_psi``), never raw images.
- P4 / P15: normalisation by B, a public constant (the expected batch the
  config or the site's policy declares), never by anything computed from the
  private data: not the realised Poisson batch size, and not q n with the
  site's real n (one reply's noise spread would then reveal n).
- P14: every private contribution to the noisy sum is finite with norm <= C
  whatever the weights (``persample``: a non-finite per-sample gradient
  contributes zero, silently; a non-finite public gradient on psi(x) is left
  out of its step the same way).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from fedpose.shared.configuration.methods import (METHODS, PROJECTED, UNITS, WITH_PUBLIC, Method, Unit,
                                                 clips_groups)
from fedpose.shared.privacy.step import bookkeeping
from fedpose.shared.privacy.step.bookkeeping import per_sample_chunks
from fedpose.shared.privacy.step.noise import add_noise_and_scale_
from fedpose.shared.privacy.step.persample import (SMALLEST_FLOAT32_FACTOR, LossFn, batch_size_of, bound_contributions,
                                                   check_clip_norm, check_params, iter_per_sample_grads, mean_grad,
                                                   robust_norms, zero_rows)
from fedpose.shared.privacy.step.psi import PsiBatch
from fedpose.shared.privacy.step.subspace import Scales, flat_factor, flat_vector, from_flat_vector, project, scale


class StepCanaries(Protocol):
    """The hook a privacy audit plugs into one step (``StepAudit.canaries``; never set in production).

    ``clipped_sum`` gives extra per-sample gradients, each clipped to C, summed as one flat (total,) vector in
    ``flat_vector`` order with the dtype and device of ``like``; the step adds it to the records' clipped sum
    before the noise. ``basis``: the V this step projects with (None when it does not), so that canaries can be
    built inside span(V). The audit's ``DiracGrads`` and ``SpanGrads`` are such hooks.
    """

    def clipped_sum(self, total: int, *, clip_norm: float, like: Tensor, basis: Tensor | None) -> Tensor: ...


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True, kw_only=True)
class DPSpec:
    """What one private step does. Keyword-only so C, sigma and q cannot be swapped.

    clip_norm: per-sample L2 bound C. sigma: noise multiplier (noise std / C),
    calibrated by ``accountant.calibrate_sigma``. sample_rate: Poisson q.
    expected_batch: B, the public constant the noisy sum is divided by (P15):
    the batch size a centralized config states (q = B / n there, so B = q n) or
    the expected batch a site's policy declares; never computed from private
    data. chunk_size: per-sample gradients computed at a time (memory; a site
    pins it). unit: ``record`` (clip each record's gradient) or ``patient``
    (clip each patient's mean gradient; B then counts patients).
    """

    method: Method
    clip_norm: float
    sigma: float
    sample_rate: float
    expected_batch: float
    chunk_size: int = 16
    unit: Unit = "record"
    multiplicity: int = 1  # augmented copies per record (record level): clip(mean of the K copies' gradients, C)
    # a site's step (its policy pins chunk_size): every chunk padded to chunk_size rows, so that its memory never
    # follows the realised batch (P13); a centralized run has no server to hide it from
    pad_chunks: bool = False
    # The clipped step without noise (privacy.noise_multiplier: 0, a centralized diagnostic with no guarantee):
    # the only way a private method runs at sigma 0.
    without_noise: bool = False

    def __post_init__(self) -> None:
        k = self.multiplicity
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"multiplicity={self.multiplicity!r} must be a positive int (augmented copies per record)")
        if k > 1 and self.unit != "record":
            raise ValueError(f"multiplicity={k} is for unit='record'; at patient level a patient's records are "
                             "averaged before clipping already")
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r} is unknown; choose one of {METHODS}")
        if self.unit not in UNITS:
            raise ValueError(f"unit={self.unit!r} is unknown; choose one of {UNITS}")
        clip = self.clip_norm
        if not _is_number(clip) or not (clip > 0 and math.isfinite(clip)):
            raise ValueError(
                f"clip_norm={self.clip_norm!r} must be a positive finite number (per-sample L2 "
                "bound C)"
            )
        if not _is_number(self.sigma) or not (self.sigma >= 0 and math.isfinite(self.sigma)):
            raise ValueError(f"sigma={self.sigma!r} must be a non-negative finite number")
        if self.method != "nonprivate" and self.sigma == 0 and not self.without_noise:
            raise ValueError(
                f"sigma=0 with method={self.method!r} adds no noise and gives no privacy; "
                "calibrate sigma with accountant.calibrate_sigma or use method='nonprivate'"
            )
        if self.without_noise and self.sigma != 0:
            raise ValueError(f"without_noise is the clipped step at sigma 0, got sigma={self.sigma!r}")
        if not _is_number(self.sample_rate) or not 0 < self.sample_rate <= 1:
            raise ValueError(
                f"sample_rate={self.sample_rate!r} must be in (0, 1] (expected batch size / n)"
            )
        batch = self.expected_batch
        if not _is_number(batch) or not (batch > 0 and math.isfinite(batch)):
            raise ValueError(
                f"expected_batch={self.expected_batch!r} must be a positive finite number (the public "
                "normaliser B of the noisy sum)"
            )
        chunk = self.chunk_size
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk_size={self.chunk_size!r} must be a positive int")

    @property
    def projects(self) -> bool:
        """True when the private gradient is projected onto span(V)."""
        return self.method in PROJECTED

    @property
    def uses_public(self) -> bool:
        """True when the public gradient on psi(x) is added (Feature-DP)."""
        return self.method in WITH_PUBLIC

    @property
    def grouped(self) -> bool:
        """True when the step clips groups of rows as one (a patient, or a record's augmented copies or raw+psi
        pair): sum_g clip(mean_{i in g} g_i, C) (``clipped_group_sum``)."""
        return clips_groups(self.unit, self.multiplicity)


@dataclass(frozen=True)
class StepAudit:
    """What ``fedpose audit`` attaches to one private step (never set in production).

    canaries: this step's gradient canaries (a ``StepCanaries``, e.g. the audit's ``DiracGrads``): extra per-sample
    gradients clipped to C and added to the same sum as the records' before the noise. on_private: called
    with the noisy, projected-if-any private gradient, the step's DP release, before g_pub is added; seeing it
    apart from g_pub reveals nothing more (g_pub is a function of public data).
    """

    canaries: StepCanaries | None = None
    on_private: Callable[[dict[str, Tensor]], None] | None = None


def all_finite(tensors: Mapping[str, Tensor]) -> bool:
    """True when no entry of any tensor is NaN or +-inf. The smallest and the largest entry carry any NaN or inf,
    so one pass and one sync cover every tensor (a check per tensor cost tinyvit-small's step 0.7 ms)."""
    flat = flat_vector(tensors)
    if flat.numel() == 0:
        return True
    low, high = torch.aminmax(flat)
    return bool(torch.isfinite(low) & torch.isfinite(high))


def check_basis(basis: Tensor, params: Mapping[str, Tensor]) -> None:
    total = sum(value.numel() for value in params.values())
    if not isinstance(basis, Tensor) or basis.dim() != 2 or basis.shape[0] != total:
        shape = tuple(basis.shape) if isinstance(basis, Tensor) else type(basis).__name__
        raise ValueError(
            f"basis has shape {shape} but must be (p, k) with p={total} trainable parameters; "
            "it was computed for other trainable parameters (check the training strategy)"
        )


def check_unit_groups(spec: DPSpec, groups: Tensor | None) -> None:
    if spec.unit == "patient" and groups is None:
        raise ValueError("unit='patient' needs groups: the patient of every record of the batch "
                         "(PatientGroups.expand)")
    if spec.multiplicity > 1:
        if groups is None:
            raise ValueError(f"multiplicity={spec.multiplicity} needs groups: the record of every augmented copy "
                             "(sampling.augmented_copies)")
        return
    if spec.unit == "record" and groups is not None:
        raise ValueError("unit='record' clips every record on its own, but groups were given; pass "
                         "groups=None or use unit='patient'")


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


def check_step_inputs(spec: DPSpec, params: Mapping[str, Tensor], private_batch: Mapping[str, Tensor],
                       psi_batch: PsiBatch | None, groups: Tensor | None) -> int:
    """The realised private batch size (records, or patients); refuses inputs the method does not use."""
    check_params(params)
    size = batch_size_of(private_batch)
    if spec.method != "nonprivate":
        check_unit_groups(spec, groups)
        if groups is not None:
            size = check_groups(groups, size)  # realised batch size in patients
    if spec.uses_public and psi_batch is None:
        raise ValueError(
            f"method={spec.method!r} adds the public gradient on psi(x) but psi_batch is "
            "None; build one with psi.apply_psi"
        )
    if not spec.uses_public and psi_batch is not None:
        raise ValueError(
            f"method={spec.method!r} does not use psi(x), but a psi_batch was given; pass None "
            "or use method='fdp'/'fpdp'"
        )
    return size


def _add_clipped(summed: Tensor, flat: Tensor, factors: Tensor, finite: Tensor) -> None:
    """summed += sum_i factors_i flat_i with non-finite rows left out (0 x NaN is NaN, so they are zeroed first)."""
    if not bool(finite.all()):
        flat = zero_rows(flat, finite)
    tiny = factors < SMALLEST_FLOAT32_FACTOR
    regular = torch.where(tiny, torch.zeros_like(factors), factors).to(flat.dtype)
    total = regular @ flat  # (b,) @ (b, numel) -> (numel,): scale-and-sum as one matmul
    if bool((tiny & finite & (factors > 0)).any()):
        rows = (tiny & finite).nonzero().flatten()
        total = total + (factors[rows, None] * flat[rows].to(torch.float64)).sum(0).to(flat.dtype)
    summed.add_(total.view_as(summed))


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
    scales: Scales | None = None,
    pad: bool = False,
) -> ClippedSum:
    """Sum of per-sample gradients each clipped to L2 norm ``clip_norm``.

    ``scales`` (``subspace.public_scales``): each tensor of every per-sample gradient is multiplied by its
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

    ``pad`` (a site's step, ``DPSpec.pad_chunks``): every chunk runs on ``chunk_size`` rows, zero rows after
    the real ones, and an empty batch runs one chunk: the chunk's memory does not depend on the realised
    batch (P13). Padding rows add exactly nothing and have no norm.
    """
    clip = check_clip_norm(clip_norm)
    check_params(params)
    summed = {name: torch.zeros_like(value.detach()) for name, value in params.items()}
    norms_parts: list[Tensor] = []
    zeroed = 0
    if scales is None and bookkeeping.supports(loss_fn, params):  # one forward and backward per chunk
        for tape in bookkeeping.iter_tapes(loss_fn, params, batch, chunk_size=chunk_size, pad=pad):
            norms = tape.norms()  # (b,) float64; padding rows 0
            bound = bound_contributions(norms, clip)
            tape.add_clipped(summed, bound.factors, bound.finite)  # never a padding row
            zeroed += bound.zeroed
            norms_parts.append(norms[:tape.real])
            del tape  # let the next chunk reuse this one's memory
    else:
        # here either the tape does not cover the weights, or the scales need the per-sample gradients in full
        for grads in per_sample_chunks(loss_fn, params, batch, chunk_size=chunk_size, randomness=randomness,
                                       pad=pad):
            flats = {name: grad.reshape(grad.shape[0], -1) * (1.0 if scales is None else flat_factor(scales[name]))
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
    pad: bool = False,
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
    patients left out. ``pad``: as ``clipped_grad_sum``'s (the per-sample gradients of every chunk are
    computed on ``chunk_size`` rows; the group means of its real rows are formed from them).
    """
    clip = check_clip_norm(clip_norm)
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
    for grads in iter_per_sample_grads(loss_fn, params, batch, chunk_size=chunk_size, randomness=randomness,
                                       pad=pad):
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


def _noisy_private_sum(
    loss_fn: LossFn,
    params: Mapping[str, Tensor],
    private_batch: Mapping[str, Tensor],
    *,
    spec: DPSpec,
    generator: torch.Generator,
    basis: Tensor | None,
    groups: Tensor | None = None,
    canaries: StepCanaries | None = None,
    scales: Scales | None = None,
) -> tuple[dict[str, Tensor], Tensor, int]:
    """FP-DP Algorithm 1, private branch; returns (g, pre-clipping norms per record or per patient,
    the number of non-finite contributions left out: P14).

    ``canaries`` (audit only, a ``StepCanaries``): extra per-sample
    gradients of this step's Poisson-drawn canaries, clipped to C and added to
    the same sum as the records' before the noise (at patient level a canary is
    a canary patient: one clipped C-vector in the per-patient sum). In-span
    canaries are built here on ``basis``, the very V this step projects with.
    """
    if spec.method == "nonprivate":
        raise ValueError("private_gradient is the DP path; method='nonprivate' uses mean_grad")
    if spec.projects:
        if basis is None:
            raise ValueError(
                f"method={spec.method!r} projects the gradient but no basis V was given; "
                "pass the server's V (compute_basis on public data)"
            )
        check_basis(basis, params)
    elif basis is not None:
        raise ValueError(
            f"method={spec.method!r} does not project, but a basis was given; pass basis=None "
            "or use method='proj'/'fpdp'"
        )
    check_unit_groups(spec, groups)
    if scales is not None and groups is not None:
        raise ValueError("per-tensor scales clip one record's gradient; not with patient-level DP or augmentation "
                         "multiplicity (train.tensor_scales: none)")
    if spec.grouped:
        # sum_p clip(mean_{i in p} g_i, C): sensitivity C under add/remove of one patient, or of one record whose
        # K augmented copies form its group.
        assert groups is not None  # check_unit_groups refused None here (this narrows the type)
        summed, norms, zeroed = clipped_group_sum(
            loss_fn, params, private_batch, groups=groups, clip_norm=spec.clip_norm,
            chunk_size=spec.chunk_size, pad=spec.pad_chunks,
        )
    else:
        # sum_i clip(g_i, C): sensitivity C under add/remove of one record.
        summed, norms, zeroed = clipped_grad_sum(
            loss_fn, params, private_batch, clip_norm=spec.clip_norm, chunk_size=spec.chunk_size, scales=scales,
            pad=spec.pad_chunks,
        )
    if canaries is not None:
        flat = flat_vector(summed)  # (p,)
        flat = flat + canaries.clipped_sum(flat.numel(), clip_norm=spec.clip_norm, like=flat, basis=basis)
        summed = {name: value.clone() for name, value in from_flat_vector(flat, like=summed).items()}
    # P1: N(0, sigma^2 C^2 I) drawn once and added to the sum, before any projection.
    # P4, P15: scaled by 1 / B, a public constant; never 1 / |B_priv| nor 1 / (q n)
    add_noise_and_scale_(summed, std=spec.sigma * spec.clip_norm, scale=1.0 / spec.expected_batch,
                         generator=generator)
    grads = summed
    if spec.projects:
        # g = V (V^T g): post-processing of the noisy gradient, no privacy cost.
        assert basis is not None  # refused above when the method projects (this narrows the type)
        flat = project(basis, flat_vector(grads))  # (p,)
        grads = {name: value.clone() for name, value in from_flat_vector(flat, like=grads).items()}
    return grads, norms, zeroed


def private_gradient(
    loss_fn: LossFn,
    params: Mapping[str, Tensor],
    private_batch: Mapping[str, Tensor],
    *,
    spec: DPSpec,
    generator: torch.Generator,
    basis: Tensor | None,
    groups: Tensor | None = None,
) -> dict[str, Tensor]:
    """g = (sum_i clip(g_i, C) + N(0, sigma^2 C^2 I)) / B, then V (V^T g) if projecting.

    ``private_batch`` must be a Poisson sample with rate spec.sample_rate
    (``sampling.poisson_sample``); it may be empty. ``basis`` is required for
    proj/fpdp and refused otherwise. Shapes of the result match ``params``.
    """
    grads, _, _ = _noisy_private_sum(
        loss_fn, params, private_batch, spec=spec, generator=generator, basis=basis, groups=groups
    )
    return grads


def public_gradient(
    loss_fn: LossFn, params: Mapping[str, Tensor], psi_batch: PsiBatch
) -> dict[str, Tensor]:
    """g_pub = mean gradient of the loss on psi(x) and the labels: no clip, no noise.

    Takes only a ``PsiBatch`` (from ``psi.apply_psi``), so raw images cannot
    reach this gradient (P3).
    """
    if not isinstance(psi_batch, PsiBatch):
        raise TypeError(
            f"public_gradient takes a PsiBatch, got {type(psi_batch).__name__}: build it with "
            "psi.apply_psi(psi, batch) so that only psi(x) and the labels are used (P3)"
        )
    if batch_size_of(psi_batch.tensors) == 0:
        raise ValueError("the psi batch is empty; the public gradient needs at least one sample")
    return mean_grad(loss_fn, params, psi_batch.tensors)


def _step_info(spec: DPSpec, size: int, psi_batch: PsiBatch | None, norms: Tensor | None,
               zeroed: int) -> dict[str, float | int | str]:
    """``dp_gradient``'s diagnostics (the same keys always; see its docstring)."""
    nan = float("nan")
    info: dict[str, float | int | str] = {
        "method": spec.method,
        "unit": spec.unit,
        "batch_size": size,
        "expected_batch": spec.expected_batch,
        "public_batch_size": psi_batch.batch_size if psi_batch is not None else 0,
        "mean_norm": nan,
        "max_norm": nan,
        "clipped_fraction": nan,
        "noise_std": 0.0,
        "zeroed": zeroed,
        "public_zeroed": 0,
    }
    if norms is None:  # nonprivate: no per-sample norms
        return info
    finite = norms[torch.isfinite(norms)]
    if finite.numel() > 0:
        info["mean_norm"] = float(finite.mean())
        info["max_norm"] = float(finite.max())
        info["clipped_fraction"] = float((finite > spec.clip_norm).double().mean())
    else:
        info["mean_norm"] = info["max_norm"] = info["clipped_fraction"] = 0.0
    info["noise_std"] = spec.sigma * spec.clip_norm / spec.expected_batch
    return info


def dp_gradient(
    loss_fn: LossFn,
    params: Mapping[str, Tensor],
    *,
    spec: DPSpec,
    private_batch: Mapping[str, Tensor],
    psi_batch: PsiBatch | None,
    generator: torch.Generator | None,
    basis: Tensor | None,
    groups: Tensor | None = None,
    audit: StepAudit | None = None,
    scales: Scales | None = None,
) -> tuple[dict[str, Tensor], dict[str, float | int | str]]:
    """The update direction of one step for ``spec.method``, plus diagnostics.

    nonprivate: mean gradient of the private batch. dpsgd: private only. proj: projected private. fdp: private
    + public. fpdp: projected private + public. Inputs a method does not use (basis, psi batch) are refused
    rather than silently ignored. ``groups`` (unit patient, or augmentation multiplicity): the patient (or
    record) of each row, 0..G-1, each group's rows contiguous.

    ``info`` keys (always the same): method, unit, batch_size (realised private: records, or patients at
    patient level), expected_batch (B, the public normaliser), public_batch_size, mean_norm / max_norm /
    clipped_fraction of the finite pre-clipping per-sample norms (NaN for nonprivate, which does not compute
    them; 0 for an empty batch), zeroed (non-finite private contributions left out, P14), public_zeroed (1
    when this step's public gradient was not finite and was left out), and noise_std, the per-coordinate
    noise std of the private gradient before projection (sigma C / B). These are private statistics of the
    site: log them locally, do not send them. ``audit``: the privacy audit's canaries and observer of this
    step (``StepAudit``; None outside the audit); refused for method='nonprivate'.
    ``scales``: per-tensor scales from public data (``subspace.public_scales``); every gradient of the step, per
    sample before clipping, is scaled by them.
    """
    size = check_step_inputs(spec, params, private_batch, psi_batch, groups)
    if spec.method == "nonprivate":
        if basis is not None:
            raise ValueError("method='nonprivate' does not project; pass basis=None")
        if audit is not None:
            raise ValueError("gradient canaries audit a DP step; method='nonprivate' has none")
        return scale(mean_grad(loss_fn, params, private_batch), scales), _step_info(spec, size, psi_batch, None, 0)
    if generator is None:
        raise ValueError(f"method={spec.method!r} needs a generator (noise.make_generator)")
    grads, norms, zeroed = _noisy_private_sum(
        loss_fn, params, private_batch, spec=spec, generator=generator, basis=basis, groups=groups,
        canaries=audit.canaries if audit is not None else None, scales=scales,
    )
    info = _step_info(spec, size, psi_batch, norms, zeroed)
    if audit is not None and audit.on_private is not None:
        audit.on_private(grads)
    if spec.uses_public:
        assert psi_batch is not None  # refused above when the method uses psi(x) (this narrows the type)
        public = scale(public_gradient(loss_fn, params, psi_batch), scales)
        if all_finite(public):
            grads = {name: grads[name] + public[name] for name in grads}
        else:  # g_pub is a function of psi(x), labels and weights only; a non-finite one is left out, as P14
            info["public_zeroed"] = 1
    return grads, info
