"""Differentially private pixelization of camera frames (DESIGN P9).

Fan's DP pixelization (L. Fan, "Image pixelization with differential
privacy", DBSec 2018) releases, for a grid of b x b cells, the mean of each
cell plus Laplace noise of scale 255 m / (b^2 eps), clipped to [0, 255].
Two images are *m-neighbours* when they differ in at most m pixels (by any
amount); changing one pixel moves one cell mean by at most 255 / b^2, so the
vector of all means has L1 sensitivity 255 m / b^2 and the release is eps-DP.

This module implements the parallel, region-adaptive variant that the
project follows:

- Algorithm 2 (uniform grid): mirror-pad to a multiple of b, take grid
  means, add noise, clip, crop back to the frame size.
- Algorithm 3 (region adaptive): cells that touch the complex region (the
  body; a cell is complex when the mask covers ANY of its real pixels) are
  split into n x n subcells of side s = b / n; the other cells keep side b.
  Each released mean of a cell of side s gets noise of scale
  255 m / (s^2 eps). Why the frame is still eps-DP: in SUM units every cell
  gets the same scale 255 m / eps (mean = sum / s^2), and the L1 sensitivity
  of the vector of all cell sums is 255 m whatever the cell sizes, because
  each pixel lies in exactly one released cell. A complex cell's coarse mean
  is never released (that would count its pixels twice).

Extensions needed for an honest guarantee, beyond the paper's formula:

- Mirror padding duplicates real pixels into the padding band, so one real
  pixel can enter up to 2 (one axis padded) or 4 (corner) cell sums. A cell
  whose pixels include copies of pixels with multiplicity k gets its noise
  scaled by k (``K`` below, computed per cell as the largest multiplicity of
  any pixel it contains). For a frame whose size is a multiple of b, K = 1
  everywhere, i.e. exactly the paper's scale. Border cells of other frames
  get 2x (or 4x in the corner) noise.
- C channels: one pixel changes C values, so the noise is scaled by C
  (equivalently eps / C per channel, sequential composition). Grayscale
  (C = 1) is the paper's setting.

So the scale of a released mean is 255 * m * C * K / (s^2 * eps).

Noise (``PixelizeSpec.noise``):

- ``"discrete"`` (default): two-sided geometric ("discrete Laplace") noise
  added to the INTEGER cell sums, P(z) proportional to alpha^|z| with
  alpha = exp(-eps / (255 m C K)), then divided by the cell area. The
  released value is an integer divided by the (public) area, so the set of
  possible outputs does not depend on the image. Textbook floating-point
  Laplace noise does not have this property: its low-order bits leak the
  input and can break DP completely (Mironov, "On significance of the least
  significant bits for differential privacy", CCS 2012). The geometric draws
  come from numpy's sampler, whose probabilities are exact only up to
  floating-point rounding of the log; for a certified sampler use the exact
  discrete Laplace of Canonne, Kamath and Steinke (NeurIPS 2020).
- ``"laplace"``: continuous Laplace on the means, as in the paper (subject
  to the floating-point caveat above).

Noise draw order (fixed, so that reference implementations can reproduce
it from the same generator): first the simple cells, shape (Ns, C), in
row-major cell order; then the subcells of complex cells, shape
(Nc, n, n, C), complex cells in row-major order. Laplace draws one standard
Laplace array per level; discrete draws two geometric arrays per level
(noise = first - second).
"""

from __future__ import annotations

import logging
import math
import numbers
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from numpy.lib import format as npformat

from shared.data.joints import NUM_JOINTS, SKELETON

log = logging.getLogger(__name__)

NoiseKind = Literal["laplace", "discrete"]
_NOISE_KINDS: tuple[str, ...] = ("laplace", "discrete")

# np.pad mode used to fill the frame up to a multiple of b. 'symmetric'
# repeats the edge pixel (... c b a | a b c ...): the padding of a cell that
# straddles the border is the mirror image of the rows/columns just inside
# it, so the cell mean stays a mean of that cell's own content (when the real
# part is at least as wide as the padding, exactly the mean of its real part
# when it is exactly half of the cell). 'reflect' would skip the edge pixel
# and pull content from further inside, possibly from the previous cell.
PAD_MODE = "symmetric"

_NPZ_KEYS = ("simple_means", "complex_means", "cell_mask", "b", "s_b", "height", "width", "channels")
_MAX_PIXEL = 255

# Bounds checked before allocation (hostile NPZ files, options): an 8K frame is 33 M pixels.
MAX_FRAME_PIXELS = 64_000_000
MAX_NPZ_MEMBER_BYTES = 1 << 30
MAX_CELL = 1 << 16  # largest cell side b accepted anywhere
MAX_M = 1 << 31  # largest m-neighbourhood accepted by PixelizeSpec (pixelize() also bounds it by H x W)


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclass(frozen=True, kw_only=True)
class PixelizeSpec:
    """Parameters of DP pixelization; keyword-only so eps and m cannot be swapped.

    Attributes:
        eps: per-frame privacy budget (> 0).
        b: cell side in pixels for simple (background) regions.
        m: m-neighbourhood: number of pixels that may differ between two
            neighbouring images; the guarantee covers changes of up to m pixels.
        n: complex cells are split into n x n subcells of side b / n (n = 1:
            uniform grid, Algorithm 2).
        noise: "discrete" (exact-support geometric noise on sums, default) or
            "laplace" (continuous, as in the paper).
    """

    eps: float
    b: int
    m: int
    n: int = 1
    noise: NoiseKind = "discrete"

    def __post_init__(self) -> None:
        if not isinstance(self.eps, numbers.Real) or isinstance(self.eps, bool) or not math.isfinite(self.eps):
            raise ValueError(f"eps must be a finite number, got {self.eps!r}")
        if self.eps <= 0:
            raise ValueError(f"eps must be > 0 (the per-frame privacy budget), got {self.eps}")
        if not _is_int(self.b) or not 1 <= self.b <= MAX_CELL:
            raise ValueError(f"b (cell side in pixels) must be an integer >= 1 and <= {MAX_CELL}, got {self.b!r}")
        if not _is_int(self.m) or not 1 <= self.m <= MAX_M:
            raise ValueError(f"m (pixels that may differ between neighbours) must be an integer >= 1 and <= {MAX_M}, "
                             f"got {self.m!r}")
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n (subdivision of complex cells) must be an integer >= 1, got {self.n!r}")
        if self.b % self.n != 0:
            divisors = [d for d in range(1, self.b + 1) if self.b % d == 0]
            raise ValueError(f"n={self.n} does not divide b={self.b}: choose n in {divisors} or change b")
        if self.noise not in _NOISE_KINDS:
            raise ValueError(f"noise must be one of {_NOISE_KINDS}, got {self.noise!r}")

    @property
    def s_b(self) -> int:
        """Side of the subcells used on complex regions."""
        return self.b // self.n

    def mean_scale(self, side: int, *, channels: int = 1, multiplicity: int = 1) -> float:
        """Laplace scale of one released mean of a cell of ``side``: 255 m C K / (side^2 eps)."""
        return _MAX_PIXEL * self.m * channels * multiplicity / (side * side * self.eps)


# ----------------------------------------------------------------------------- the released frame


@dataclass(frozen=True, eq=False)
class PixelizedFrame:
    """What DP pixelization releases: noisy, clipped cell means and the public layout.

    Attributes:
        simple_means: (Ns, C) float32 in [0, 255]: one mean per b x b cell not
            flagged complex, cells in row-major order.
        complex_means: (Nc, n, n, C) float32 in [0, 255]: the n x n subcell
            means (side s_b) of each complex cell, cells in row-major order.
        cell_mask: (Hb, Wb) bool, True = complex cell; Hb = ceil(height / b).
        b, s_b: cell sides; n = b // s_b.
        height, width: frame size before padding.
        channels: 1 (grayscale, rendered as (H, W)) or 3 (rendered as (H, W, 3)).
    """

    simple_means: np.ndarray
    complex_means: np.ndarray
    cell_mask: np.ndarray
    b: int
    s_b: int
    height: int
    width: int
    channels: int

    def __post_init__(self) -> None:
        for name in ("b", "s_b", "height", "width", "channels"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
            object.__setattr__(self, name, int(value))
        if self.b % self.s_b != 0:
            raise ValueError(f"s_b={self.s_b} must divide b={self.b}")
        if self.channels not in (1, 3):
            raise ValueError(f"channels must be 1 or 3, got {self.channels}")
        if self.height * self.width > MAX_FRAME_PIXELS:
            raise ValueError(f"a {self.height}x{self.width} frame is too large (at most {MAX_FRAME_PIXELS} pixels)")
        if self.b > max(self.height, self.width):
            raise ValueError(f"b={self.b} is larger than the {self.height}x{self.width} frame")
        grid = (-(-self.height // self.b), -(-self.width // self.b))
        mask = np.array(self.cell_mask, dtype=bool, copy=True)
        if mask.shape != grid:
            raise ValueError(
                f"cell_mask has shape {mask.shape}, expected {grid} for a "
                f"{self.height}x{self.width} frame with b={self.b}"
            )
        n, c = self.b // self.s_b, self.channels
        n_complex = int(mask.sum())
        expected = {
            "simple_means": (mask.size - n_complex, c),
            "complex_means": (n_complex, n, n, c),
        }
        for name, shape in expected.items():
            arr = np.array(getattr(self, name), dtype=np.float32, copy=True)
            if arr.shape != shape:
                raise ValueError(f"{name} has shape {arr.shape}, expected {shape}")
            if arr.size and not (np.isfinite(arr).all() and arr.min() >= 0 and arr.max() <= _MAX_PIXEL):
                raise ValueError(f"{name} must hold finite values in [0, 255]")
            arr.flags.writeable = False
            object.__setattr__(self, name, arr)
        mask.flags.writeable = False
        object.__setattr__(self, "cell_mask", mask)

    @property
    def n(self) -> int:
        return self.b // self.s_b

    def render(self) -> np.ndarray:
        """The pixelized image, uint8, (H, W) for grayscale or (H, W, 3).

        Means are rounded half-to-even; a deterministic function of the stored
        fields, so a frame restored from NPZ renders bit-identically.
        """
        hb, wb = self.cell_mask.shape
        c, n = self.channels, self.n
        simple = np.rint(self.simple_means).astype(np.uint8)  # (Ns, C)
        if self.complex_means.shape[0] == 0:
            grid, side = simple.reshape(hb, wb, c), self.b  # (Hb, Wb, C)
        else:
            cells = np.empty((hb, wb, n, n, c), dtype=np.uint8)
            cells[~self.cell_mask] = simple[:, None, None, :]
            cells[self.cell_mask] = np.rint(self.complex_means).astype(np.uint8)
            grid, side = cells.transpose(0, 2, 1, 3, 4).reshape(hb * n, wb * n, c), self.s_b  # (Hb*n, Wb*n, C)
        if c == 1:
            grid = grid[:, :, 0]
        out = np.repeat(np.repeat(grid, side, axis=0), side, axis=1)  # (Hp, Wp[, C])
        return np.ascontiguousarray(out[: self.height, : self.width])


# ----------------------------------------------------------------------------- helpers


def _as_hwc(image: np.ndarray) -> np.ndarray:
    """(H, W) or (H, W, 3) uint8 -> (H, W, C) view."""
    img = np.asarray(image)
    if img.dtype != np.uint8:
        raise ValueError(
            f"image must be uint8 (0..255), got dtype {img.dtype}; convert with np.clip(...).astype(np.uint8)"
        )
    if img.ndim == 2:
        img = img[:, :, None]
    elif not (img.ndim == 3 and img.shape[2] == 3):
        raise ValueError(f"image must have shape (H, W) or (H, W, 3), got {img.shape}")
    if img.shape[0] == 0 or img.shape[1] == 0:
        raise ValueError(f"image is empty: shape {img.shape}")
    return img


def _pad_amount(length: int, b: int) -> int:
    return -length % b


def _mirror_pad(img: np.ndarray, ph: int, pw: int) -> np.ndarray:
    """(H, W, C) -> (H + ph, W + pw, C), padding at the bottom/right only."""
    if ph == 0 and pw == 0:
        return img
    return np.pad(img, ((0, ph), (0, pw), (0, 0)), mode=PAD_MODE)


def _pad_multiplicity(length: int, pad: int, side: int) -> np.ndarray:
    """Per block of ``side`` along one padded axis: the largest number of times
    any real pixel in it occurs in the padded axis (1 if no padding touches it)."""
    src = np.pad(np.arange(length), (0, pad), mode=PAD_MODE)  # (length + pad,) source index
    mult = np.bincount(src, minlength=length)[src]  # (length + pad,)
    return mult.reshape(-1, side).max(axis=1)  # ((length + pad) / side,)


def _block_sums(x: np.ndarray, side: int) -> np.ndarray:
    """(Hp, Wp, C) uint8 -> (Hp/side, Wp/side, C) int64 sums of side x side blocks.

    Rows first (a reduction over a non-contiguous axis, vectorized by numpy,
    with a narrow uint16 accumulator when it cannot overflow), then columns
    as ``side`` strided adds: both much faster (~5x at 1080p) than one
    reduction over axes (1, 3), whose inner loops are only ``side`` long.
    """
    hp, wp, c = x.shape
    acc = np.uint16 if _MAX_PIXEL * side <= np.iinfo(np.uint16).max else np.int64
    rows = x.reshape(hp // side, side, wp * c).sum(axis=1, dtype=acc)  # (Hp/side, Wp*C)
    rows = rows.reshape(hp // side, wp // side, side * c)  # (Hp/side, Wp/side, side*C)
    out = rows[:, :, 0:c].astype(np.int64)  # (Hp/side, Wp/side, C)
    for i in range(1, side):  # loop over the pixel offset inside a cell, not over cells
        out += rows[:, :, i * c : (i + 1) * c]
    return out


def _block_any(mask: np.ndarray, b: int) -> np.ndarray:
    """(H, W) bool -> (ceil(H/b), ceil(W/b)) bool: does the mask touch the cell's real pixels."""
    m = mask.view(np.uint8)

    def reduce_axis0(a: np.ndarray) -> np.ndarray:
        full = a.shape[0] // b * b
        parts = [a[:full].reshape(full // b, b, *a.shape[1:]).max(axis=1)]
        if full < a.shape[0]:
            parts.append(a[full:].max(axis=0, keepdims=True))
        return np.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]

    rows = reduce_axis0(m)  # (Hb, W)
    return reduce_axis0(rows.T).T.astype(bool)  # (Hb, Wb)


def _sum_noise(
    rng: np.random.Generator, spec: PixelizeSpec, sensitivity: np.ndarray, shape: tuple[int, ...]
) -> np.ndarray:
    """Noise for integer cell sums whose L1 sensitivity is ``sensitivity`` (broadcastable to shape).

    Laplace: scale sensitivity / eps. Discrete: two-sided geometric with
    alpha = exp(-eps / sensitivity), drawn as the difference of two geometric
    variables (the difference of two iid Geometric(1 - alpha) is two-sided
    geometric with parameter alpha).
    """
    if spec.noise == "laplace":
        return rng.laplace(0.0, 1.0, size=shape) * (sensitivity / spec.eps)
    p = -np.expm1(-spec.eps / sensitivity)  # 1 - alpha, accurate for tiny eps / sensitivity
    return rng.geometric(p, size=shape) - rng.geometric(p, size=shape)


def _release(sums: np.ndarray, noise: np.ndarray, area: int) -> np.ndarray:
    """Noisy means, clipped to [0, 255] (post-processing), as float32."""
    means = (sums + noise) / area
    np.clip(means, 0.0, _MAX_PIXEL, out=means)
    return means.astype(np.float32)


# ----------------------------------------------------------------------------- pixelize


def pixelize(
    image: np.ndarray,
    spec: PixelizeSpec,
    *,
    mask: np.ndarray | None = None,
    rng: np.random.Generator,
    _noise_off_for_tests: bool = False,
) -> PixelizedFrame:
    """DP-pixelize one frame (region-adaptive Algorithm 3; Algorithm 2 when mask is None or n = 1).

    Args:
        image: (H, W) or (H, W, 3) uint8 (any channel order; it is kept).
        spec: privacy and grid parameters.
        mask: (H, W) bool, True on the complex region (e.g. from
            ``body_mask_from_keypoints``). The mask is NOT protected: the cell
            layout it induces is released. Ignored when spec.n == 1 (it would
            change nothing but reveal the layout).
        rng: noise source; seed it from OS entropy in production (DESIGN P7).
        _noise_off_for_tests: TEST HOOK ONLY. Skips the noise, so the output
            is NOT differentially private.

    Returns:
        The released ``PixelizedFrame``; ``.render()`` gives the image.
    """
    if not isinstance(spec, PixelizeSpec):
        raise ValueError(f"spec must be a PixelizeSpec, got {type(spec).__name__}")
    if not isinstance(rng, np.random.Generator):
        raise ValueError(f"rng must be a numpy Generator (np.random.default_rng()), got {type(rng).__name__}")
    img = _as_hwc(image)  # (H, W, C)
    h, w, c = img.shape
    b, n, s = spec.b, spec.n, spec.s_b
    if h * w > MAX_FRAME_PIXELS:
        raise ValueError(f"frame of {h}x{w} pixels is too large to pixelize (at most {MAX_FRAME_PIXELS} pixels)")
    if b > max(h, w):
        raise ValueError(f"b={b} is larger than the {h}x{w} frame: choose a cell side of at most {max(h, w)} px")
    if spec.m > h * w:
        raise ValueError(f"m={spec.m} is more pixels than the {h}x{w} frame holds ({h * w})")
    hb, wb = -(-h // b), -(-w // b)

    if mask is not None:
        mask = np.asarray(mask)
        if mask.shape != (h, w):
            raise ValueError(f"mask must have the frame shape {(h, w)}, got {mask.shape}")
        if mask.dtype != np.bool_:
            raise ValueError(f"mask must be bool (True = complex region), got dtype {mask.dtype}; pass mask != 0")
    if mask is None or n == 1:
        cell_mask = np.zeros((hb, wb), dtype=bool)
    else:
        cell_mask = _block_any(np.ascontiguousarray(mask), b)  # (Hb, Wb)
    any_complex = bool(cell_mask.any())

    ph, pw = _pad_amount(h, b), _pad_amount(w, b)
    padded = _mirror_pad(img, ph, pw)  # (Hp, Wp, C)
    if _noise_off_for_tests:
        log.warning("pixelize: noise is OFF (test hook): the output is NOT differentially private")

    # Level 1: simple b x b cells. ----------------------------------------
    side_fine = s if any_complex else b
    sums = _block_sums(padded, side_fine)  # (Hp/side, Wp/side, C)
    if any_complex:
        fine = sums.reshape(hb, n, wb, n, c).transpose(0, 2, 1, 3, 4)  # (Hb, Wb, n, n, C)
        coarse = fine.sum(axis=(2, 3))  # (Hb, Wb, C)
    else:
        coarse = sums
    simple_sums = coarse[~cell_mask]  # (Ns, C)
    k_coarse = np.multiply.outer(_pad_multiplicity(h, ph, b), _pad_multiplicity(w, pw, b))  # (Hb, Wb)
    sens_simple = (_MAX_PIXEL * spec.m * c) * k_coarse[~cell_mask][:, None]  # (Ns, 1)
    if _noise_off_for_tests:
        noise_simple = np.zeros(simple_sums.shape)
    else:
        noise_simple = _sum_noise(rng, spec, sens_simple, simple_sums.shape)
    simple_means = _release(simple_sums, noise_simple, b * b)

    # Level 2: n x n subcells of side s in complex cells. ------------------
    if any_complex:
        complex_sums = fine[cell_mask]  # (Nc, n, n, C)
        k_fine = np.multiply.outer(_pad_multiplicity(h, ph, s), _pad_multiplicity(w, pw, s))  # (Hb*n, Wb*n)
        k_fine = k_fine.reshape(hb, n, wb, n).transpose(0, 2, 1, 3)[cell_mask]  # (Nc, n, n)
        sens_complex = (_MAX_PIXEL * spec.m * c) * k_fine[..., None]  # (Nc, n, n, 1)
        if _noise_off_for_tests:
            noise_complex = np.zeros(complex_sums.shape)
        else:
            noise_complex = _sum_noise(rng, spec, sens_complex, complex_sums.shape)
        complex_means = _release(complex_sums, noise_complex, s * s)
    else:
        complex_means = np.zeros((0, n, n, c), dtype=np.float32)

    return PixelizedFrame(
        simple_means=simple_means,
        complex_means=complex_means,
        cell_mask=cell_mask,
        b=b,
        s_b=s,
        height=h,
        width=w,
        channels=c,
    )


# ----------------------------------------------------------------------------- storage


def save_npz(frame: PixelizedFrame, path: str | Path) -> None:
    """Store only what was released (noisy means, cell mask, sizes), compressed.

    Written to exactly ``path`` (no ``.npz`` suffix added).
    """
    with open(path, "wb") as f:
        np.savez_compressed(
            f,
            simple_means=frame.simple_means,
            complex_means=frame.complex_means,
            cell_mask=frame.cell_mask,
            b=np.int64(frame.b),
            s_b=np.int64(frame.s_b),
            height=np.int64(frame.height),
            width=np.int64(frame.width),
            channels=np.int64(frame.channels),
        )


def _npz_headers(path: Path, zf: zipfile.ZipFile) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Declared (shape, dtype) of every expected member, read from the .npy headers only."""
    out: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
    names = set(zf.namelist())
    missing = [k for k in _NPZ_KEYS if k + ".npy" not in names]
    if missing:
        raise ValueError(f"{path} is not a pixelized frame: missing arrays {missing}")
    for key in _NPZ_KEYS:
        info = zf.getinfo(key + ".npy")
        if info.file_size > MAX_NPZ_MEMBER_BYTES:
            raise ValueError(f"{path}: {key} declares {info.file_size} bytes uncompressed: too large "
                             f"(at most {MAX_NPZ_MEMBER_BYTES})")
        with zf.open(info) as member:
            version = npformat.read_magic(member)
            if version == (1, 0):
                shape, fortran, dtype = npformat.read_array_header_1_0(member)
            elif version == (2, 0):
                shape, fortran, dtype = npformat.read_array_header_2_0(member)
            else:
                raise ValueError(f"{path}: {key} has an unsupported .npy version {version}")
        if dtype.hasobject:
            raise ValueError(f"{path}: {key} holds Python objects, which are never loaded")
        out[key] = (tuple(int(d) for d in shape), dtype)
    return out


def _check_npz_layout(path: Path, headers: dict[str, tuple[tuple[int, ...], np.dtype]],
                      scalars: dict[str, int]) -> None:
    """Check sizes and the declared array shapes against the frame's scalars, before loading arrays."""
    height, width, b, s_b, channels = (scalars[k] for k in ("height", "width", "b", "s_b", "channels"))
    for name, value in scalars.items():
        if value < 1:
            raise ValueError(f"{path}: {name} must be a positive integer, got {value}")
    if height * width > MAX_FRAME_PIXELS:
        raise ValueError(f"{path}: the frame declares {height}x{width} pixels: too large "
                         f"(at most {MAX_FRAME_PIXELS} pixels)")
    if b > max(height, width) or b % s_b != 0 or channels not in (1, 3):
        raise ValueError(f"{path}: inconsistent layout b={b}, s_b={s_b}, channels={channels} for a "
                         f"{height}x{width} frame")
    n = b // s_b
    grid = (-(-height // b), -(-width // b))
    cells = grid[0] * grid[1]
    expected_ndim = {"simple_means": 2, "complex_means": 4, "cell_mask": 2}
    for key, ndim in expected_ndim.items():
        shape, dtype = headers[key]
        if len(shape) != ndim:
            raise ValueError(f"{path}: {key} must have {ndim} dimensions, got shape {shape}")
        if key == "cell_mask":
            if dtype != np.bool_ or shape != grid:
                raise ValueError(f"{path}: cell_mask must be bool of shape {grid}, got {dtype} {shape}")
        else:
            if dtype.kind != "f":
                raise ValueError(f"{path}: {key} must hold floats, got {dtype}")
            if shape[0] > cells or shape[1:] != ((channels,) if ndim == 2 else (n, n, channels)):
                raise ValueError(f"{path}: {key} has shape {shape}, which does not fit the layout")


def load_npz(path: str | Path) -> PixelizedFrame:
    """Load a frame written by ``save_npz`` (validated like any PixelizedFrame).

    Hostile files are refused with a ValueError naming the file before anything
    large is allocated: the declared shapes are read from the .npy headers in the
    zip and checked against the frame's scalars, the frame size is bounded
    (``MAX_FRAME_PIXELS``) and so is each member's uncompressed size.
    """
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as zf:
            headers = _npz_headers(path, zf)
            scalars: dict[str, int] = {}
            for key in ("b", "s_b", "height", "width", "channels"):
                shape, dtype = headers[key]
                if shape != () or dtype.kind not in "iu":
                    raise ValueError(f"{path}: {key} must be an integer scalar, got {dtype} shape {shape}")
                with zf.open(key + ".npy") as member:
                    scalars[key] = int(npformat.read_array(member, allow_pickle=False))
            _check_npz_layout(path, headers, scalars)
            fields: dict[str, Any] = dict(scalars)
            for key in ("simple_means", "complex_means", "cell_mask"):
                with zf.open(key + ".npy") as member:
                    fields[key] = npformat.read_array(member, allow_pickle=False)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError) as err:
        raise ValueError(f"{path} is not a readable NPZ of a pixelized frame: {err}") from err
    except ValueError as err:
        if str(path) in str(err):
            raise
        raise ValueError(f"{path} is not a readable NPZ of a pixelized frame: {err}") from err
    try:
        return PixelizedFrame(**fields)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from err


def restore(path: str | Path) -> np.ndarray:
    """Rebuild the pixelized image from an NPZ file; bit-identical to ``frame.render()``."""
    return load_npz(path).render()


# ----------------------------------------------------------------------------- masks


def body_mask_from_keypoints(
    shape: tuple[int, int],
    keypoints: np.ndarray,
    scores: np.ndarray | None = None,
    *,
    score_threshold: float = 0.3,
    margin: float | None = None,
    style: Literal["hull", "skeleton"] = "hull",
) -> np.ndarray:
    """Complex region around a person: (H, W) bool.

    Args:
        shape: (H, W) of the frame.
        keypoints: (K, 2) pixel (x, y); for ``style="skeleton"`` K must be 16
            (MPII order, bones from ``SKELETON``).
        scores: (K,) confidences, or None to use all finite keypoints.
        score_threshold: keypoints scoring below are ignored.
        margin: dilation radius in pixels; None = 10 % of the diagonal of the
            kept keypoints' bounding box, at least 4 px, so the whole limb
            (not just its joint centres) falls inside.
        style: "hull" = convex hull of the kept keypoints dilated by margin
            (covers the torso between the joints); "skeleton" = bones drawn
            with thickness 2 * margin + 1 and discs at the joints.

    Returns an all-False mask (uniform pixelization) when no keypoint is kept.
    """
    import cv2  # heavy optional dependency, only needed for masks

    if len(shape) != 2 or min(shape) < 1:
        raise ValueError(f"shape must be (H, W) with positive sizes, got {shape}")
    kpts = np.asarray(keypoints, dtype=np.float64)
    if kpts.ndim != 2 or kpts.shape[1] != 2:
        raise ValueError(f"keypoints must have shape (K, 2), got {kpts.shape}")
    keep = np.isfinite(kpts).all(axis=1)
    if scores is not None:
        sc = np.asarray(scores, dtype=np.float64)
        if sc.shape != (kpts.shape[0],):
            raise ValueError(f"scores must have shape ({kpts.shape[0]},), got {sc.shape}")
        keep &= sc >= score_threshold
    if style not in ("hull", "skeleton"):
        raise ValueError(f"style must be 'hull' or 'skeleton', got {style!r}")
    if style == "skeleton" and kpts.shape[0] != NUM_JOINTS:
        raise ValueError(f"style='skeleton' needs the {NUM_JOINTS} MPII joints, got {kpts.shape[0]} keypoints")

    out = np.zeros(tuple(int(v) for v in shape), dtype=np.uint8)
    if not keep.any():
        log.debug("body_mask_from_keypoints: no keypoint above %.2f, empty mask", score_threshold)
        return out.astype(bool)
    pts = kpts[keep]
    if margin is None:
        diag = float(np.linalg.norm(pts.max(axis=0) - pts.min(axis=0)))
        margin = max(4.0, 0.1 * diag)
    if not (math.isfinite(margin) and margin >= 0):
        raise ValueError(f"margin must be a finite number of pixels >= 0, got {margin}")
    radius = int(round(margin))
    ipts = np.rint(pts).astype(np.int32)  # (K', 2)

    if style == "hull":
        hull = cv2.convexHull(ipts.reshape(-1, 1, 2))
        cv2.fillConvexPoly(out, hull, 1)
        if radius > 0:
            # Stroking the hull outline with round caps = dilating the polygon by a disc.
            cv2.polylines(out, [hull], isClosed=True, color=1, thickness=2 * radius + 1)
    else:
        idx = np.rint(kpts).astype(np.int64)
        for a, bj in SKELETON:
            if keep[a] and keep[bj]:
                p0, p1 = (int(idx[a, 0]), int(idx[a, 1])), (int(idx[bj, 0]), int(idx[bj, 1]))
                cv2.line(out, p0, p1, 1, thickness=2 * radius + 1)
    for x, y in ipts:
        cv2.circle(out, (int(x), int(y)), radius, 1, thickness=-1)
    return out.astype(bool)


def load_mask(path: str | Path) -> np.ndarray:
    """Read a mask image (PNG): (H, W) bool, nonzero (in any channel) = complex."""
    import cv2

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"mask file not found: {p}")
    img = cv2.imread(str(p), cv2.IMREAD_UNCHANGED)
    if img is None:
        raise ValueError(f"cannot decode mask image {p}: write it as a PNG (nonzero = complex region)")
    if img.ndim == 3:
        return (img != 0).any(axis=2)
    return img != 0


# ----------------------------------------------------------------------------- claim


_MASK_SOURCES = ("none", "keypoints", "file")


def pixelize_claim(spec: PixelizeSpec, *, mask_source: str, frames: int) -> str:
    """The honest privacy statement for DP pixelization (DESIGN P9), to print.

    Args:
        spec: the parameters used.
        mask_source: "none" (uniform grid), "keypoints" (mask from a pose
            estimate of the same frame) or "file" (a fixed mask image).
        frames: number of frames F released for the video.
    """
    if mask_source not in _MASK_SOURCES:
        raise ValueError(f"mask_source must be one of {_MASK_SOURCES}, got {mask_source!r}")
    if not _is_int(frames) or frames < 1:
        raise ValueError(f"frames must be an integer >= 1, got {frames!r}")
    noise = (
        "two-sided geometric noise on integer cell sums (exact output support)"
        if spec.noise == "discrete"
        else "continuous Laplace noise (floating point; see Mironov 2012)"
    )
    adaptive = mask_source != "none" and spec.n > 1
    sizes = [spec.b, spec.s_b] if adaptive else [spec.b]
    scales = ", ".join(f"{spec.mean_scale(s):.4g} for {s}x{s} cells" for s in sizes)
    lines = [
        f"DP pixelization (Fan 2018; {'region-adaptive Algorithm 3' if adaptive else 'uniform grid Algorithm 2'}): "
        f"each frame is {spec.eps:g}-DP with respect to m-neighbouring images, i.e. images that differ in at most "
        f"m={spec.m} pixels (by any amount).",
        f"Noise: {noise}; Laplace scale 255*m/(s^2*eps) per released cell mean of side s: {scales} (grayscale); "
        "x3 for RGB (eps split over channels); xK on border cells holding mirror-padded copies of pixels that "
        "then count K times (K = 2 per padded axis; more only for frames smaller than b/2); means clipped to "
        "[0, 255] afterwards (post-processing).",
        f"A change of k > m pixels (e.g. a whole person) is only protected at ceil(k/m)*{spec.eps:g} "
        "(group privacy).",
    ]
    if mask_source == "keypoints":
        lines.append(
            "NOT protected: the region mask. It comes from the pose keypoints of the frame, so the cell layout "
            "(which cells are subdivided) reveals where the body is, frame by frame; the guarantee above holds "
            "for the pixel content given that layout."
        )
    elif mask_source == "file":
        lines.append("NOT protected: the region mask from the file is public; the cell layout it induces is released.")
    elif spec.n > 1:
        lines.append("No region mask: every cell has side b (n is unused).")
    lines.append(
        f"Video: over F={frames} frames the guarantee composes to F*eps = {frames * spec.eps:g} (basic composition) "
        "for a person present in all frames."
    )
    return "\n".join(lines)
