"""The feature-projective DP-SGD gradient (docs/explanation/design.md: the step; FP-DP Algorithm 1).

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

from collections.abc import Mapping

import torch
from torch import Tensor

from fedpose.shared.privacy.audit.canaries import DiracGrads, SpanGrads
from fedpose.shared.privacy.step.noise import add_noise_and_scale_
from fedpose.shared.privacy.step.clipping import clipped_grad_sum, clipped_group_sum
from fedpose.shared.privacy.step.batch_checks import batch_size_of
from fedpose.shared.privacy.step.persample import LossFn, mean_grad
from fedpose.shared.privacy.step.psi import PsiBatch
from fedpose.shared.privacy.step.spec import DPSpec, StepAudit
from fedpose.shared.privacy.step.step_checks import all_finite, check_basis, check_step_inputs, check_unit_groups
from fedpose.shared.privacy.step.subspace import flatten, project, unflatten
from fedpose.shared.privacy.step.tensor_scales import scale

def _noisy_private_sum(
    loss_fn: LossFn,
    params: Mapping[str, Tensor],
    private_batch: Mapping[str, Tensor],
    *,
    spec: DPSpec,
    generator: torch.Generator,
    basis: Tensor | None,
    groups: Tensor | None = None,
    canaries: DiracGrads | SpanGrads | None = None,
    scales: Mapping[str, float] | None = None,
) -> tuple[dict[str, Tensor], Tensor, int]:
    """FP-DP Algorithm 1, private branch; returns (g, pre-clipping norms per record or per patient,
    the number of non-finite contributions left out: P14).

    ``canaries`` (audit only, ``fedpose.shared.privacy.audit.canaries``): extra per-sample
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
    if spec.unit == "patient" or spec.multiplicity > 1:
        # sum_p clip(mean_{i in p} g_i, C): sensitivity C under add/remove of one patient, or of one record whose
        # K augmented copies form its group.
        assert groups is not None  # check_unit_groups refused None here (this narrows the type)
        summed, norms, zeroed = clipped_group_sum(
            loss_fn, params, private_batch, groups=groups, clip_norm=spec.clip_norm,
            chunk_size=spec.chunk_size,
        )
    else:
        # sum_i clip(g_i, C): sensitivity C under add/remove of one record.
        summed, norms, zeroed = clipped_grad_sum(
            loss_fn, params, private_batch, clip_norm=spec.clip_norm, chunk_size=spec.chunk_size, scales=scales
        )
    if canaries is not None:
        flat = flatten(summed)  # (p,)
        flat = flat + canaries.clipped_sum(flat.numel(), clip_norm=spec.clip_norm, like=flat, basis=basis)
        summed = {name: value.clone() for name, value in unflatten(flat, like=summed).items()}
    # P1: N(0, sigma^2 C^2 I) drawn once and added to the sum, before any projection.
    # P4, P15: scaled by 1 / B, a public constant; never 1 / |B_priv| nor 1 / (q n)
    add_noise_and_scale_(summed, std=spec.sigma * spec.clip_norm, scale=1.0 / spec.expected_batch,
                         generator=generator)
    grads = summed
    if spec.projects:
        # g = V (V^T g): post-processing of the noisy gradient, no privacy cost.
        assert basis is not None  # refused above when the method projects (this narrows the type)
        flat = project(basis, flatten(grads))  # (p,)
        grads = {name: value.clone() for name, value in unflatten(flat, like=grads).items()}
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
    scales: Mapping[str, float] | None = None,
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
    step (``StepAudit``; None outside the audit); refused for method='nonprivate'. ``scales``: per-tensor scales
    from public data (``tensor_scales``); every gradient of the step, per sample before clipping, is scaled by them.
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
