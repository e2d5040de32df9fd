"""DP pixelization parameters (``PixelizeSpec``) and the bounds every input is checked against.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Literal

NoiseKind = Literal["laplace", "discrete"]
_NOISE_KINDS: tuple[str, ...] = ("laplace", "discrete")

# The largest pixel value: what one changed pixel moves a cell sum by at most (the sensitivity's 255), and the
# bound every released mean is clipped to.
MAX_PIXEL = 255

# Bounds checked before allocation (hostile NPZ files, options): an 8K frame is 33 M pixels.
MAX_FRAME_PIXELS = 64_000_000
MAX_NPZ_MEMBER_BYTES = 1 << 30
MAX_CELL = 1 << 16  # largest cell side b accepted anywhere
MAX_M = 1 << 31  # largest m-neighbourhood accepted by PixelizeSpec (pixelize() also bounds it by H x W)


def is_integer(value: object) -> bool:
    """Whether ``value`` is an integer parameter as every check of this package reads one (a bool is not)."""
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
        if not is_integer(self.b) or not 1 <= self.b <= MAX_CELL:
            raise ValueError(f"b (cell side in pixels) must be an integer >= 1 and <= {MAX_CELL}, got {self.b!r}")
        if not is_integer(self.m) or not 1 <= self.m <= MAX_M:
            raise ValueError(f"m (pixels that may differ between neighbours) must be an integer >= 1 and <= {MAX_M}, "
                             f"got {self.m!r}")
        if not is_integer(self.n) or self.n < 1:
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
        return MAX_PIXEL * self.m * channels * multiplicity / (side * side * self.eps)
