"""Training augmentation of the top-down crop: its parameters (``Augment``, HRNet's MPII defaults) and the
draws from a dataset's generator: the box's scale, rotation and flip, which ``fedpose.shared.data.transforms``
applies, and a photometric jitter of the crop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


@dataclass(frozen=True)
class Augment:
    """Training augmentation of the top-down crop (HRNet MPII defaults).

    scale_factor: the box is scaled by clip(1 + N(0, 1) * f, 1 - f, 1 + f).
    rotation: degrees; the angle is clip(N(0, 1) * r, -2r, 2r) ...
    rotation_prob: ... applied with this probability, else 0.
    flip_prob: probability of a horizontal flip.
    """

    scale_factor: float = 0.25
    rotation: float = 30.0
    rotation_prob: float = 0.6
    flip_prob: float = 0.5
    # Photometric jitter of strength p in [0, 1): per-channel gain U(1-p, 1+p), contrast U(1-p, 1+p) about the
    # crop's mean, brightness U(-48p, 48p) (of 255) and sensor noise of std U(0, 12p). Each camera, ward and
    # light differs in exactly these; pretraining on one public style needs them to reach the sites' styles.
    photometric: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.photometric < 1.0:
            raise ValueError(f"Augment.photometric must be in [0, 1), got {self.photometric}")
        if not 0.0 <= self.scale_factor < 1.0:
            raise ValueError(f"Augment.scale_factor must be in [0, 1), got {self.scale_factor}")
        if not 0.0 <= self.rotation <= 90.0:
            raise ValueError(f"Augment.rotation must be in [0, 90] degrees, got {self.rotation}")
        for name in ("rotation_prob", "flip_prob"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"Augment.{name} must be a probability in [0, 1], got {value}")


def sample_augment(rng: np.random.Generator, augment: Augment) -> tuple[float, float, bool]:
    """Draw (scale multiplier, rotation in degrees, flip) from the generator."""
    sf, rf = augment.scale_factor, augment.rotation
    scale_mult = float(np.clip(rng.standard_normal() * sf + 1.0, 1.0 - sf, 1.0 + sf))
    rotate = rng.random() < augment.rotation_prob
    rotation = float(np.clip(rng.standard_normal() * rf, -2.0 * rf, 2.0 * rf)) if rotate else 0.0
    flip = bool(rng.random() < augment.flip_prob)
    return scale_mult, rotation, flip


class Jitter(NamedTuple):
    """One photometric jitter's draws (``draw_jitter``), applied by ``apply_jitter``."""

    gain: np.ndarray  # (3,) float32, per channel
    contrast: np.float32
    brightness: np.float32
    noise: np.ndarray | None  # (H, W, 3) float32 sensor noise (already scaled), None when its std drew 0 or not drawn
    std: np.float32  # the noise's standard deviation (of 255)


def draw_jitter(rng: np.random.Generator, strength: float, shape: tuple[int, ...], *, noise: bool = True) -> Jitter:
    """The draws of ``Augment.photometric`` at ``strength`` for a crop of ``shape`` (H, W, 3), from ``rng``.

    Drawn apart from the crop so that a batch can take every draw from one generator in order and render its
    crops in parallel (``PoseDataset.batch``). ``noise=False`` leaves the noise image undrawn (its ``std`` is
    drawn): a batch assembled on the device draws every crop's noise at once, as one tensor."""
    p = float(strength)
    gain = rng.uniform(1.0 - p, 1.0 + p, size=3).astype(np.float32)
    contrast = np.float32(rng.uniform(1.0 - p, 1.0 + p))
    brightness = np.float32(rng.uniform(-48.0 * p, 48.0 * p))
    std = float(rng.uniform(0.0, 12.0 * p))
    image = rng.standard_normal(shape).astype(np.float32) * np.float32(std) if noise and std > 0 else None
    return Jitter(gain, contrast, brightness, image, np.float32(std))


def apply_jitter(crop: np.ndarray, jitter: Jitter) -> np.ndarray:
    """(H, W, 3) uint8 -> (H, W, 3) uint8: gain, contrast about the crop's mean, brightness, then the noise."""
    out = crop.astype(np.float32) * jitter.gain
    mean = out.mean(dtype=np.float32)
    out = (out - mean) * jitter.contrast + mean + jitter.brightness
    if jitter.noise is not None:
        out += jitter.noise
    return np.clip(out, 0.0, 255.0).round().astype(np.uint8)
