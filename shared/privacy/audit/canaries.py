"""Gradient canaries for the one-run privacy audit (Steinke, Nasr, Jagielski 2023, section 6).

Two placements, both fake records whose per-sample gradient has exactly the
clipping norm C (the worst case a record can be):

- Dirac (dpsgd / fdp): ``DiracCanaries``, C e_j on a coordinate j of its own.
- In-span (proj / fpdp): ``SpanCanaries``, +-C V_t u_j inside span(V_t), the
  basis the step projects with. A Dirac canary keeps only ||V^T e_j||^2 (about
  k / p) of itself after the projection, so it audits nothing there.

A Dirac canary is a fake record whose per-sample gradient is C e_j at every
step: zero everywhere except its own coordinate j (a flat index in
``subspace.flat_vector`` order). It is the strongest single record a DP-SGD
step can be asked to hide: its gradient has exactly the clipping norm and
lies where no other canary's does. The audit includes each of m canaries
independently with probability 1/2 and then, at every step, treats each
included canary like a private record: it enters the step's batch with the
Poisson rate q of the records (P4), its gradient is clipped to C like theirs
and added to the same sum before the noise (P1), and the projection of
proj / fpdp applies to it after the noise like to everything else.

A step's drawn canaries (``DiracGrads``, ``SpanGrads``) plug into it through the hook the step
defines, ``fpdp.StepCanaries``.

Nothing here is used in production: ``local_train`` and ``dp_gradient``
take canaries only from the audit (``fedpose.shared.experiments.audit``); their default is None.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor

from fedpose.shared.privacy.step.persample import clip_factors

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DiracGrads:
    """One step's per-sample canary gradients g_c = values[c] * e_{coords[c]}: coords (b,) int64, values (b,)."""

    coords: Tensor
    values: Tensor

    def __post_init__(self) -> None:
        if self.coords.dim() != 1 or self.values.shape != self.coords.shape:
            raise ValueError(f"coords {tuple(self.coords.shape)} and values {tuple(self.values.shape)} must be (b,)")
        if self.coords.dtype != torch.int64:
            raise ValueError(f"coords must be int64 flat indices, got {self.coords.dtype}")

    def clipped_sum(self, total: int, *, clip_norm: float, like: Tensor, basis: Tensor | None) -> Tensor:
        """sum_c clip(g_c, C) as a flat (total,) vector; the norm of a Dirac gradient is |value|.

        ``basis`` (the step's V, or None) is not used: a Dirac canary sits on its coordinate whatever V is.
        """
        if self.coords.numel() and (int(self.coords.min()) < 0 or int(self.coords.max()) >= total):
            raise ValueError(f"canary coordinates must lie in [0, {total}): the model has {total} trainable entries")
        norms = self.values.abs().to(torch.float64)  # (b,)
        clipped = self.values.to(torch.float64) * clip_factors(norms, clip_norm)  # (b,)
        out = torch.zeros(total, dtype=like.dtype, device=like.device)
        return out.index_add_(0, self.coords.to(like.device), clipped.to(like.dtype))


@dataclass(frozen=True)
class DiracCanaries:
    """m canaries on distinct coordinates ``coords`` (m,), ``included`` (m,) bool, gradient value ``value``.

    ``value`` is the canary gradient's magnitude; C (the clip norm) makes it
    the worst case a record can be. Only included canaries are ever drawn.
    """

    coords: Tensor
    included: Tensor
    value: float

    def __post_init__(self) -> None:
        if self.coords.dim() != 1 or self.included.shape != self.coords.shape:
            raise ValueError("coords and included must both be (m,)")
        if self.included.dtype != torch.bool:
            raise ValueError(f"included must be a bool tensor, got {self.included.dtype}")
        if torch.unique(self.coords).numel() != self.coords.numel():
            raise ValueError("every Dirac canary needs a coordinate of its own: coords must be distinct")
        if not self.value > 0:
            raise ValueError(f"value={self.value!r} must be positive (use the clip norm C)")

    def draw(self, step: int, *, sample_rate: float, generator: torch.Generator) -> DiracGrads:
        """Step ``step``'s batch of canaries: each included one independently with probability q (P4)."""
        members = self.coords[self.included]  # (m_in,)
        draws = torch.rand(members.numel(), generator=generator, device=generator.device).cpu()  # (m_in,)
        picked = members[draws < sample_rate]
        return DiracGrads(coords=picked.to(torch.int64), values=torch.full((picked.numel(),), float(self.value)))


def _check_basis_for(k: int, total: int, basis: Tensor | None) -> Tensor:
    if basis is None:
        raise ValueError("in-span canaries need the basis V of a projecting method (proj / fpdp); this step has "
                         "none: use Dirac canaries for dpsgd / fdp")
    if basis.dim() != 2 or basis.shape != (total, k):
        raise ValueError(f"basis has shape {tuple(basis.shape)}; the canaries need ({total}, {k})")
    return basis


@dataclass(frozen=True)
class SpanGrads:
    """One step's in-span canary gradients g_c = V coeffs[c] for the V of that step: coeffs (b, k) float64."""

    coeffs: Tensor

    def __post_init__(self) -> None:
        if self.coeffs.dim() != 2:
            raise ValueError(f"coeffs {tuple(self.coeffs.shape)} must be (b, k)")

    def clipped_sum(self, total: int, *, clip_norm: float, like: Tensor, basis: Tensor | None) -> Tensor:
        """sum_c clip(V a_c, C) as a flat (total,) vector, V (total, k) the basis the step projects with.

        ||V a|| is computed with the Gram matrix V^T V (k x k), so a basis that
        is orthonormal only to float32 precision still gives norms exactly C.
        """
        basis = _check_basis_for(self.coeffs.shape[1], total, basis)
        v64 = basis.to(torch.float64)
        coeffs = self.coeffs.to(device=basis.device, dtype=torch.float64)  # (b, k)
        norms = ((coeffs @ (v64.T @ v64)) * coeffs).sum(1).clamp(min=0).sqrt()  # (b,) = ||V a_c||
        summed = (coeffs * clip_factors(norms, clip_norm)[:, None]).sum(0)  # (k,)
        return (v64 @ summed).to(device=like.device, dtype=like.dtype)  # (total,)


@dataclass(frozen=True)
class SpanCanaries:
    """m in-span canaries: canary j's gradient at step t is signs[t, j] * value * V_t directions[j].

    directions (m, k): fixed unit vectors u_j in R^k; V_t (p x k) is the basis
    step t projects with (``dp_gradient`` hands it to ``SpanGrads``), so the
    canary follows V through every refresh and the projection keeps all of it.
    signs (steps, m): +-1, fresh per step and canary, drawn once from a seeded
    generator: with m > k the u_j cannot be orthogonal, and with a fixed sign
    the other included canaries (and the records' gradient inside span(V)) would
    add a bias to canary j that grows with the number of steps; with random
    signs it only adds variance growing like its square root.

    Why this is a legitimate record (the audit stays sound): a record's gradient
    at step t may be any function of the current weights and public data. V_t
    is computed from public data at the current weights (P2), and u_j and the
    signs are fixed before training, so the canary is such a record: choosing
    its gradient from V_t is an adaptive choice, which the adaptive composition
    the accountant uses covers. It enters the step like a record: drawn with
    the records' rate q (P4), clipped to C, added to their sum before the noise
    (P1), then projected with everything else.
    """

    directions: Tensor
    signs: Tensor
    included: Tensor
    value: float

    def __post_init__(self) -> None:
        if self.directions.dim() != 2 or self.included.shape != (self.directions.shape[0],):
            raise ValueError("directions must be (m, k) and included (m,)")
        if self.signs.dim() != 2 or self.signs.shape[1] != self.directions.shape[0]:
            raise ValueError(f"signs {tuple(self.signs.shape)} must be (steps, m)")
        if self.included.dtype != torch.bool:
            raise ValueError(f"included must be a bool tensor, got {self.included.dtype}")
        norms = self.directions.to(torch.float64).norm(dim=1)
        if not torch.allclose(norms, torch.ones_like(norms), atol=1e-9):
            raise ValueError("every direction u_j must be a unit vector")
        if not bool((self.signs.abs() == 1).all()):
            raise ValueError("signs must be +1 or -1")
        if not self.value > 0:
            raise ValueError(f"value={self.value!r} must be positive (use the clip norm C)")

    @classmethod
    def random(cls, *, m: int, k: int, steps: int, included: Tensor, value: float, seed: int,
               skip: int = 0) -> SpanCanaries:
        """u_j uniform on the unit sphere of the last k - skip coordinates of R^k, signs uniform.

        ``skip`` leading columns of V are left out: V is sorted by public singular
        value, and its first column is close to the mean gradient, where the
        records' own clipped sum lies (measured: 60-85% of a record's energy in V
        is there), so a canary there is drowned by the records. Public choice.
        ``seed`` fixes directions and signs; they are public (the auditor scores with them).
        """
        if not 0 <= skip < k:
            raise ValueError(f"skip={skip} must leave at least one of the k={k} columns of V")
        gen = torch.Generator().manual_seed(seed)
        directions = torch.zeros(m, k, dtype=torch.float64)
        directions[:, skip:] = torch.randn(m, k - skip, generator=gen, dtype=torch.float64)
        directions /= directions.norm(dim=1, keepdim=True)
        signs = torch.randint(0, 2, (steps, m), generator=gen).to(torch.int8) * 2 - 1
        return cls(directions=directions, signs=signs, included=included, value=value)

    def draw(self, step: int, *, sample_rate: float, generator: torch.Generator) -> SpanGrads:
        """Step ``step``'s batch: each included canary independently with probability q (P4)."""
        if not 0 <= step < self.signs.shape[0]:
            raise ValueError(f"step {step} is outside the {self.signs.shape[0]} steps the canaries were made for")
        members = torch.nonzero(self.included).flatten()  # (m_in,)
        draws = torch.rand(members.numel(), generator=generator, device=generator.device).cpu()  # (m_in,)
        picked = members[draws < sample_rate]
        signed = self.signs[step, picked].to(torch.float64)[:, None] * self.directions[picked]  # (b, k)
        return SpanGrads(coeffs=float(self.value) * signed)
