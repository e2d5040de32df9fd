"""What one private step does (``DPSpec``) and what the privacy audit attaches to it (``StepAudit``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from fedpose.shared.configuration.methods import METHODS, PROJECTED, UNITS, WITH_PUBLIC, Method, Unit
from fedpose.shared.privacy.audit.canaries import DiracGrads, SpanGrads


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
        if self.method != "nonprivate" and self.sigma == 0:
            raise ValueError(
                f"sigma=0 with method={self.method!r} adds no noise and gives no privacy; "
                "calibrate sigma with accountant.calibrate_sigma or use method='nonprivate'"
            )
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


@dataclass(frozen=True)
class StepAudit:
    """What ``fedpose audit`` attaches to one private step (never set in production).

    canaries: this step's gradient canaries (``fedpose.shared.privacy.audit.canaries``): extra per-sample
    gradients clipped to C and added to the same sum as the records' before the noise. on_private: called
    with the noisy, projected-if-any private gradient, the step's DP release, before g_pub is added; seeing it
    apart from g_pub reveals nothing more (g_pub is a function of public data).
    """

    canaries: DiracGrads | SpanGrads | None = None
    on_private: Callable[[dict[str, Tensor]], None] | None = None
