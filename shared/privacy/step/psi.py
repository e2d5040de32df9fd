"""Feature maps psi for Feature-DP: the part of an image treated as public.

Feature-DP (FP-DP Algorithm 1, public branch "g_pub = mean grad l(w, psi(x))")
splits each private image x into a public feature psi(x) and the rest. The
public gradient is computed on psi(x) without clipping or noise, so the model
may learn, and reveal, anything that psi(x) and the pose labels contain. The
guarantee is about the remainder of x only; it is NOT record-level DP
(invariant P8). Neither blur nor pixelation is a privacy mechanism by itself.

The maps: blur, pixelation and DP pixelization. What each map reveals:
- GaussianBlur: the low-frequency content of the image - silhouettes and
  body pose, coarse layout, clothing and skin colours, background palette
  and lighting. Faces and fine texture are attenuated, not removed: a blur
  is a linear filter that is largely invertible where it does not bottom out
  in quantisation, so deblurring can restore detail. Treat psi(x) as if it
  were published.
- Pixelate: the mean colour of every b x b block, i.e. a (H/b) x (W/b)
  thumbnail of the image, upsampled back to H x W. Everything visible at that
  resolution is revealed; for small b faces can remain recognisable.
- DPPixelize: the pixelation above with noise on every cell mean (Fan's DP
  pixelization, ``shared/pixelization``), drawn once per record and kept.
  The one map here that is a mechanism: psi(x) is eps_pix-DP for changes of
  up to m pixels of a record's crop (a small m covers a face's few pixels at
  most; a whole changed image is not covered), and the claim adds eps_pix to
  the Feature-DP eps for that neighbourhood.

Invariant P3: the public gradient depends on x only through psi(x) and the
labels. ``apply_psi`` is the only intended way to build the ``PsiBatch`` that
``fpdp.public_gradient`` accepts, so raw images cannot be passed by accident.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from fedpose.shared.pixelization.mechanism import pixelize
from fedpose.shared.pixelization.spec import PixelizeSpec


class FeatureMap(Protocol):
    """A deterministic map (B, C, H, W) -> (B, C, H, W) with a name for claims (a per-record map, DPPixelize,
    also takes the records' indices)."""

    @property
    def name(self) -> str: ...

    def __call__(self, images: Tensor, *args: Any, **kwargs: Any) -> Tensor: ...

    def describe(self) -> str: ...


def _check_images(images: Tensor) -> tuple[int, int]:
    if not isinstance(images, Tensor) or images.dim() != 4:
        shape = tuple(images.shape) if isinstance(images, Tensor) else type(images).__name__
        raise ValueError(f"psi expects images of shape (B, C, H, W), got {shape}")
    if not images.is_floating_point():
        raise ValueError(
            f"psi expects float images in [0, 1], got dtype {images.dtype}; convert with "
            "images.float() / 255"
        )
    return int(images.shape[2]), int(images.shape[3])


def _gaussian_kernel(sigma: float, radius: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Normalised 1-d Gaussian of length 2 radius + 1, computed in float64."""
    offsets = torch.arange(-radius, radius + 1, dtype=torch.float64)
    weights = torch.exp(-0.5 * (offsets / sigma) ** 2)
    return (weights / weights.sum()).to(dtype=dtype, device=device)  # (2r+1,)


@dataclass(frozen=True)
class GaussianBlur:
    """Separable Gaussian blur scaled to the input: sigma = blur_sigma_frac * min(H, W).

    The kernel is odd, about 6 sigma wide (radius ceil(3 sigma), truncated to
    min(H, W) - 1 so that reflect padding is defined), normalised to sum 1.
    Reflect padding avoids dark borders that would leak the padding choice
    into the features. Deterministic on CPU (plain depthwise conv2d).
    The default 0.025 gives sigma = 4.8 px at 256 x 192 and 1.6 px at 64 x 64.
    """

    blur_sigma_frac: float = 0.025
    name: str = field(default="gaussian_blur", init=False)

    def __post_init__(self) -> None:
        frac = self.blur_sigma_frac
        if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0 < frac <= 0.5:
            raise ValueError(
                f"blur_sigma_frac={frac!r} must be in (0, 0.5] (blur sigma as a fraction of "
                "min(H, W); the default is 0.025)"
            )

    def kernel_size(self, height: int, width: int) -> tuple[float, int]:
        """(sigma in pixels, radius in pixels) used for an H x W input."""
        sigma = self.blur_sigma_frac * min(height, width)
        radius = min(math.ceil(3 * sigma), min(height, width) - 1)
        return sigma, max(radius, 0)

    def __call__(self, images: Tensor) -> Tensor:
        """(B, C, H, W) float -> (B, C, H, W) blurred, same dtype/device."""
        height, width = _check_images(images)
        sigma, radius = self.kernel_size(height, width)
        if radius == 0:
            return images.clone()
        channels = images.shape[1]
        kernel = _gaussian_kernel(sigma, radius, images.dtype, images.device)
        horizontal = kernel.view(1, 1, 1, -1).expand(channels, 1, 1, -1)  # (C, 1, 1, K)
        vertical = kernel.view(1, 1, -1, 1).expand(channels, 1, -1, 1)  # (C, 1, K, 1)
        out = F.pad(images, (radius, radius, 0, 0), mode="reflect")  # (B, C, H, W + 2r)
        out = F.conv2d(out, horizontal, groups=channels)  # (B, C, H, W)
        out = F.pad(out, (0, 0, radius, radius), mode="reflect")  # (B, C, H + 2r, W)
        return F.conv2d(out, vertical, groups=channels)  # (B, C, H, W)

    def describe(self) -> str:
        return (
            f"Gaussian blur, sigma = {self.blur_sigma_frac:g} x min(H, W) "
            "(kernel ~6 sigma, reflect padding)"
        )


@dataclass(frozen=True)
class Pixelate:
    """Block means over b x b cells, upsampled back by nearest neighbour.

    Partial blocks at the right/bottom edge average only their valid pixels
    (avg_pool2d with ceil_mode). Output has the input's shape.
    """

    block_size: int = 8
    name: str = field(default="pixelate", init=False)

    def __post_init__(self) -> None:
        size = self.block_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 2:
            raise ValueError(
                f"block_size={size!r} must be an int >= 2 (block_size 1 is the raw image, "
                "which would make every pixel public)"
            )

    def __call__(self, images: Tensor) -> Tensor:
        """(B, C, H, W) float -> (B, C, H, W) pixelated, same dtype/device."""
        height, width = _check_images(images)
        size = self.block_size
        # (B, C, ceil(H/b), ceil(W/b))
        means = F.avg_pool2d(images, size, stride=size, ceil_mode=True)
        up = means.repeat_interleave(size, dim=2).repeat_interleave(size, dim=3)
        return up[:, :, :height, :width].contiguous()  # (B, C, H, W)

    def describe(self) -> str:
        return f"pixelation, {self.block_size} x {self.block_size} block means"


@dataclass
class DPPixelize:
    """DP pixelization of each record, released once: psi(x_i) is the same noisy release at every step.

    ``shared/pixelization``'s mechanism (Fan's Algorithm 2, uniform b x b grid, 3 channels) on the
    record's canonical crop as uint8: every cell mean gets noise of scale 255 m 3 K / (b^2 eps), so the
    release is eps-DP for changes of up to m pixels of that crop. The first draw for a record is kept
    (``released``) and returned at every later step: a record's pixelization is released once, never
    averaged over fresh draws, so eps_pix is spent once per record, not once per step. The noise comes
    from ``rng`` (seeded from the run's noise generator: OS entropy unless the run is seeded), never
    from the image, so knowing a candidate image does not give the noise. Call it with the records'
    indices in the canonical dataset (``apply_psi`` passes ``batch["index"]``).
    """

    spec: PixelizeSpec
    rng: np.random.Generator
    released: dict[int, Tensor] = field(default_factory=dict, repr=False)
    name: str = field(default="dp-pixelize", init=False)
    per_record: bool = field(default=True, init=False)

    def __call__(self, images: Tensor, index: Tensor) -> Tensor:
        """(B, C, H, W) float in [0, 1] and (B,) record indices -> the records' releases, float in [0, 1]."""
        _check_images(images)
        if not isinstance(index, Tensor) or tuple(index.shape) != (images.shape[0],):
            raise ValueError(f"dp-pixelize needs one record index per image, got {getattr(index, 'shape', index)}")
        out = []
        for image, key in zip(images, index.tolist()):
            if key not in self.released:
                crop = image.permute(1, 2, 0).mul(255.0).round().clamp(0, 255).to(torch.uint8).cpu().numpy()
                frame = pixelize(crop, self.spec, rng=self.rng).render()  # (H, W, C) uint8
                self.released[key] = torch.from_numpy(frame).permute(2, 0, 1).contiguous()  # (C, H, W) uint8
            out.append(self.released[key])
        return torch.stack(out).to(device=images.device, dtype=images.dtype).div_(255.0)

    def describe(self) -> str:
        return (f"DP pixelization, {self.spec.b} x {self.spec.b} cells, eps_pix={self.spec.eps:g} for changes of up "
                f"to m={self.spec.m} pixels, released once per record")


def make_psi(name: str, **params: Any) -> GaussianBlur | Pixelate:
    """Build a feature map by name: "gaussian_blur" (default in configs) or "pixelate" (each checks its params)."""
    if name in ("gaussian_blur", "blur"):
        return GaussianBlur(**params)
    if name == "pixelate":
        return Pixelate(**params)
    raise ValueError(
        f"unknown psi {name!r}: choose 'gaussian_blur' (params: blur_sigma_frac) or "
        "'pixelate' (params: block_size)"
    )


IMAGE_KEY = "image"


@dataclass(frozen=True)
class PsiBatch:
    """A batch whose images have been mapped by psi: the only input of the public gradient.

    Build it with ``apply_psi``; its "image" entry is psi(x), the other
    entries (pose labels, visibility, ...) are the batch's labels, which
    Feature-DP also treats as public.
    """

    tensors: Mapping[str, Tensor]
    psi_name: str

    @property
    def batch_size(self) -> int:
        return int(self.tensors[IMAGE_KEY].shape[0])


def apply_psi(psi: FeatureMap, batch: Mapping[str, Tensor]) -> PsiBatch:
    """Map batch["image"] through psi and wrap the result for ``public_gradient``.

    The raw images are not kept. Every other entry is passed through as a
    label: do not put raw-image derivatives (crops, masks computed from
    pixels) in the batch dict, they would become public too.
    """
    if not isinstance(batch, Mapping) or IMAGE_KEY not in batch:
        raise ValueError(f"apply_psi needs a batch dict with an {IMAGE_KEY!r} entry")
    with torch.no_grad():
        if getattr(psi, "per_record", False):  # dp-pixelize: each record's one release
            if "index" not in batch:
                raise ValueError(f"psi {psi.name} needs the records' indices (batch['index'])")
            mapped = psi(batch[IMAGE_KEY], batch["index"])
        else:
            mapped = psi(batch[IMAGE_KEY])
    tensors = {name: value for name, value in batch.items() if name != IMAGE_KEY}
    tensors[IMAGE_KEY] = mapped
    return PsiBatch(tensors=MappingProxyType(tensors), psi_name=psi.name)


PSI_KINDS = ("blur", "pixelate")


def psi_strength(kind: str, param: float, input_size: tuple[int, int]) -> float:
    """psi's strength as a fraction of min(H, W) of the model input (larger is stronger).

    A site pins a minimum in its policy (``psi_min``, P11). ``kind`` and
    ``param`` as in the config: blur's ``param`` already is the blur sigma as
    that fraction; pixelate's is the block side in input pixels (whole pixels
    count, as ``make_psi`` uses them).
    """
    if kind == "blur":
        return float(param)
    if kind == "pixelate":
        return float(int(param)) / float(min(input_size))
    raise ValueError(f"psi={kind!r} is not one of {PSI_KINDS}")


def psi_label_of(privacy: object) -> str:
    """``psi_label`` of a privacy config section (``psi``, ``psi_param``, ``psi_eps``, ``psi_m``)."""
    return psi_label(privacy.psi, privacy.psi_param, eps=privacy.psi_eps, m=privacy.psi_m)  # type: ignore[attr-defined]


def psi_label(kind: str, param: float, *, eps: float | None = None, m: int | None = None) -> str:
    """How claims and ledger rows name a feature map, e.g. ``blur(0.03)``: one spelling everywhere.

    dp-pixelize also names its eps_pix and m: ``dp-pixelize(8, eps=1, m=1)``.
    """
    if kind == "dp-pixelize":
        if eps is None or m is None:
            raise ValueError("psi_label: dp-pixelize needs its eps and m")
        return f"{kind}({param:g}, eps={eps:g}, m={m})"
    return f"{kind}({param:g})"
