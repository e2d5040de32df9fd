"""Dirac gradient canaries for the one-run privacy audit (Steinke, Nasr, Jagielski 2023, section 6).

A Dirac canary is a fake record whose per-sample gradient is C e_j at every
step: zero everywhere except its own coordinate j (a flat index in
``subspace.flatten`` order). It is the strongest single record a DP-SGD
step can be asked to hide: its gradient has exactly the clipping norm and
lies where no other canary's does. The audit includes each of m canaries
independently with probability 1/2 and then, at every step, treats each
included canary like a private record: it enters the step's batch with the
Poisson rate q of the records (P4), its gradient is clipped to C like theirs
and added to the same sum before the noise (P1), and the projection of
proj / fpdp applies to it after the noise like to everything else.

Nothing here is used in production: ``local_train`` and ``dp_gradient``
take canaries only from the audit (``shared.audit``); their default is None.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor

from shared.privacy.persample import clip_factors

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

    def clipped_sum(self, total: int, *, clip_norm: float, like: Tensor) -> Tensor:
        """sum_c clip(g_c, C) as a flat (total,) vector; the norm of a Dirac gradient is |value|."""
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

    def draw(self, *, sample_rate: float, generator: torch.Generator) -> DiracGrads:
        """This step's batch of canaries: each included one independently with probability q (P4)."""
        members = self.coords[self.included]  # (m_in,)
        draws = torch.rand(members.numel(), generator=generator, device=generator.device).cpu()  # (m_in,)
        picked = members[draws < sample_rate]
        return DiracGrads(coords=picked.to(torch.int64), values=torch.full((picked.numel(),), float(self.value)))
