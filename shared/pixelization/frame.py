"""The released frame (``PixelizedFrame``): only noisy cell means, the cell layout and sizes;
rendering it back to pixels is post-processing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedpose.shared.pixelization.spec import MAX_FRAME_PIXELS, MAX_PIXEL, is_integer


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
            if not is_integer(value) or value < 1:
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
            if arr.size and not (np.isfinite(arr).all() and arr.min() >= 0 and arr.max() <= MAX_PIXEL):
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
