"""Drawing primitives: anti-aliased OpenCV calls at fixed-point sub-pixel precision, colour helpers."""

from __future__ import annotations

from collections.abc import Sequence

import cv2
import numpy as np

from fedpose.shared.data.synth.styles import Colour

_SHIFT = 4
_ONE = 1 << _SHIFT


def _pt(p: Sequence[float]) -> tuple[int, int]:
    return (int(round(float(p[0]) * _ONE)), int(round(float(p[1]) * _ONE)))


def _poly(points: np.ndarray) -> np.ndarray:
    return np.round(np.asarray(points, dtype=np.float64) * _ONE).astype(np.int32).reshape(-1, 1, 2)


def _line(img: np.ndarray, a: Sequence[float], b: Sequence[float], colour: Colour, thickness: int) -> None:
    cv2.line(img, _pt(a), _pt(b), colour, max(1, int(thickness)), cv2.LINE_AA, _SHIFT)


def _disc(img: np.ndarray, c: Sequence[float], radius: float, colour: Colour) -> None:
    cv2.circle(img, _pt(c), max(1, int(round(radius * _ONE))), colour, -1, cv2.LINE_AA, _SHIFT)


def _fill(img: np.ndarray, points: np.ndarray, colour: Colour) -> None:
    cv2.fillPoly(img, [_poly(points)], colour, cv2.LINE_AA, _SHIFT)


def _ellipse(img: np.ndarray, c: Sequence[float], axes: Sequence[float], angle: float, colour: Colour,
             thickness: int = -1, start: float = 0.0, end: float = 360.0) -> None:
    ax = (max(1, int(round(axes[0] * _ONE))), max(1, int(round(axes[1] * _ONE))))
    cv2.ellipse(img, _pt(c), ax, float(angle), float(start), float(end), colour, thickness, cv2.LINE_AA, _SHIFT)


def _rect(img: np.ndarray, x0: float, y0: float, x1: float, y1: float, colour: Colour, thickness: int = -1) -> None:
    cv2.rectangle(img, _pt((x0, y0)), _pt((x1, y1)), colour, thickness, cv2.LINE_AA, _SHIFT)


def _shade(colour: Colour, factor: float, add: float = 0.0) -> Colour:
    return tuple(int(min(255, max(0, c * factor + add))) for c in colour)  # type: ignore[return-value]


def _pick(rng: np.random.Generator, palette: Sequence[Colour]) -> Colour:
    return palette[int(rng.integers(len(palette)))]
