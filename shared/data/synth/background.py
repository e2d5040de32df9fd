"""The room behind the person: walls, floor pattern, furniture and thin-line clutter."""

from __future__ import annotations

import math
from collections.abc import Sequence

import cv2
import numpy as np

from fedpose.shared.data.synth.draw import _SHIFT, _disc, _ellipse, _fill, _line, _pick, _poly, _rect, _shade
from fedpose.shared.data.synth.identity import _BRIGHT
from fedpose.shared.data.synth.rng import _u
from fedpose.shared.data.synth.styles import Colour, SiteStyle, _jitter_colour


def render_background(style: SiteStyle, size: int, rng: np.random.Generator) -> np.ndarray:
    """(size, size, 3) uint8 BGR room: wall, floor pattern, furniture and fine clutter."""
    jit = style.colour_jitter
    wall = _jitter_colour(style.wall, rng, jit)
    floor = _jitter_colour(style.floor, rng, jit)
    palette = [_jitter_colour(c, rng, jit * 0.5) for c in style.palette]
    img = np.empty((size, size, 3), np.uint8)
    horizon = _u(rng, *style.horizon) * size
    hy = int(horizon)
    # Wall with a soft vertical gradient, floor below the horizon.
    ramp = np.linspace(1.08, 0.92, max(hy, 1))[:, None, None]
    img[:hy] = np.clip(np.asarray(wall, np.float32) * ramp, 0, 255).astype(np.uint8)
    img[hy:] = floor
    _draw_floor(img, style.floor_pattern, floor, horizon, size, rng)
    # Skirting board / handrail: long thin horizontal lines.
    _line(img, (0, horizon), (size, horizon), _shade(wall, 0.6), max(1, size // 96))
    if rng.random() < 0.6:
        y = horizon - _u(rng, 0.12, 0.25) * size
        _line(img, (0, y), (size, y), _pick(rng, palette), 1)
    n_items = int(rng.integers(style.clutter[0], style.clutter[1] + 1))
    for _ in range(n_items):
        kind = style.furniture[int(rng.integers(len(style.furniture)))]
        _draw_furniture(img, kind, horizon, size, palette, style.bedding, rng)
    # Fine clutter: short thin strokes and bright specks in the room's colours.
    for _ in range(int(rng.integers(3, 9))):
        x, y = rng.uniform(0, size, 2)
        length, angle = _u(rng, 0.03, 0.12) * size, _u(rng, 0, math.pi)
        _line(img, (x, y), (x + length * math.cos(angle), y + length * math.sin(angle)), _pick(rng, palette), 1)
    for _ in range(int(rng.integers(2, 6))):
        _disc(img, rng.uniform(0, size, 2), _u(rng, 0.5, 1.2) * size / 128, _BRIGHT[int(rng.integers(len(_BRIGHT)))])
    return img


def _draw_floor(img: np.ndarray, pattern: str, floor: Colour, horizon: float, size: int,
                rng: np.random.Generator) -> None:
    dark = _shade(floor, 0.8)
    if pattern == "tiles":
        vx = _u(rng, 0.2, 0.8) * size
        y, step = horizon, 0.03 * size
        while y < size:
            _line(img, (0, y), (size, y), dark, 1)
            y += step
            step *= 1.35
        for k in range(-8, 9):
            _line(img, (vx + k * 0.02 * size, horizon), (vx + k * 0.25 * size, size), dark, 1)
    elif pattern == "wood":
        y = horizon
        while y < size:
            h = _u(rng, 0.025, 0.05) * size
            _rect(img, 0, y, size, y + h, _shade(floor, _u(rng, 0.85, 1.15)))
            _line(img, (0, y), (size, y), _shade(floor, 0.6), 1)
            y += h
    elif pattern == "checker":
        alt = _shade(floor, 0.7)
        cell = _u(rng, 0.06, 0.1) * size
        ys = np.arange(horizon, size, cell * 0.6)
        for r, y in enumerate(ys):
            for c, x in enumerate(np.arange(-cell * ((r % 2) * 0.5), size, cell)):
                if (r + c) % 2 == 0:
                    _rect(img, x, y, x + cell, y + cell * 0.6, alt)
    else:  # plain with scuffs
        for _ in range(int(rng.integers(4, 10))):
            x, y = _u(rng, 0, size), _u(rng, horizon, size)
            _ellipse(img, (x, y), (_u(rng, 2, 10) * size / 128, _u(rng, 1, 3) * size / 128), _u(rng, -20, 20), dark)


def _draw_furniture(img: np.ndarray, kind: str, horizon: float, size: int, palette: Sequence[Colour],
                    bedding: Colour, rng: np.random.Generator) -> None:
    s = size / 128.0
    colour = _pick(rng, palette)
    edge = _shade(colour, 0.55)
    x = _u(rng, -0.1, 1.0) * size
    if kind == "window":
        w, h = _u(rng, 14, 34) * s, _u(rng, 12, 26) * s
        y = horizon - h - _u(rng, 4, 20) * s
        sky = _jitter_colour((235, 215, 180), rng, 30)
        _rect(img, x, y, x + w, y + h, sky)
        _rect(img, x, y, x + w, y + h, colour, max(1, int(s)))
        _line(img, (x + w / 2, y), (x + w / 2, y + h), colour, 1)
        _line(img, (x, y + h / 2), (x + w, y + h / 2), colour, 1)
    elif kind == "cabinet":
        w, h = _u(rng, 10, 24) * s, _u(rng, 14, 40) * s
        y1 = horizon + _u(rng, 0, 10) * s
        _rect(img, x, y1 - h, x + w, y1, colour)
        _rect(img, x, y1 - h, x + w, y1, edge, 1)
        for k in range(1, int(rng.integers(2, 4))):
            yy = y1 - h * k / 3
            _line(img, (x, yy), (x + w, yy), edge, 1)
            _disc(img, (x + w / 2, yy + 2 * s), 0.8 * s, _shade(colour, 1.5, 40))
    elif kind == "monitor":
        w, h = _u(rng, 10, 18) * s, _u(rng, 7, 12) * s
        y = horizon - _u(rng, 18, 40) * s
        _rect(img, x, y, x + w, y + h, (30, 30, 30))
        for k in range(int(rng.integers(1, 4))):
            yy = y + h * (k + 1) / 4
            trace = [(x + 1 + i * (w - 2) / 8, yy + rng.uniform(-1.5, 1.5) * s) for i in range(9)]
            cv2.polylines(img, [_poly(np.array(trace))], False, _BRIGHT[int(rng.integers(len(_BRIGHT)))], 1,
                          cv2.LINE_AA, _SHIFT)
        _line(img, (x + w / 2, y + h), (x + w / 2, y + h + _u(rng, 5, 25) * s), (90, 90, 90), 1)
    elif kind == "iv_pole":
        y1 = horizon + _u(rng, 2, 30) * s
        top = y1 - _u(rng, 50, 80) * s
        _line(img, (x, top), (x, y1), (170, 170, 175), 1)
        _line(img, (x - 4 * s, y1), (x + 4 * s, y1), (120, 120, 125), 1)
        _rect(img, x + 1 * s, top + 2 * s, x + 5 * s, top + 10 * s, _jitter_colour((220, 225, 215), rng, 20))
        _line(img, (x + 3 * s, top + 10 * s), (x + _u(rng, -10, 15) * s, y1 - _u(rng, 10, 30) * s), (200, 200, 200), 1)
    elif kind == "curtain":
        w = _u(rng, 12, 30) * s
        y1 = horizon + _u(rng, 10, 40) * s
        _rect(img, x, 0, x + w, y1, colour)
        for k in range(int(w / (3 * s)) + 1):
            xx = x + k * 3 * s
            _line(img, (xx, 0), (xx + rng.uniform(-1, 1) * s, y1), _shade(colour, 0.8), 1)
    elif kind == "bed":
        w, h = _u(rng, 30, 50) * s, _u(rng, 8, 14) * s
        y1 = horizon + _u(rng, 4, 25) * s
        _rect(img, x, y1 - h, x + w, y1 - h * 0.4, bedding)
        _rect(img, x, y1 - h, x + w, y1 - h * 0.4, _shade(bedding, 0.6), 1)
        _line(img, (x, y1 - h * 1.8), (x, y1), (110, 110, 115), max(1, int(s)))
        _line(img, (x + w, y1 - h * 1.2), (x + w, y1), (110, 110, 115), max(1, int(s)))
    elif kind == "bars":
        y = horizon + _u(rng, 0, 20) * s
        h, w = _u(rng, 18, 28) * s, _u(rng, 30, 70) * s
        for dy in (0, _u(rng, 4, 10) * s):
            _line(img, (x, y - h + dy), (x + w, y - h + dy), (170, 170, 170), 1)
            for xx in (x, x + w):
                _line(img, (xx, y - h + dy), (xx, y + dy), (140, 140, 140), 1)
    elif kind == "chair":
        w = _u(rng, 8, 14) * s
        y = horizon + _u(rng, 2, 25) * s
        _line(img, (x, y - w), (x + w, y - w), colour, max(1, int(2 * s)))
        _line(img, (x, y - w), (x, y - 2.2 * w), colour, max(1, int(2 * s)))
        _line(img, (x, y - w), (x, y), edge, 1)
        _line(img, (x + w, y - w), (x + w, y), edge, 1)
    elif kind == "door":
        w, h = _u(rng, 14, 22) * s, _u(rng, 40, 60) * s
        y1 = horizon + 2 * s
        _rect(img, x, y1 - h, x + w, y1, colour)
        _rect(img, x, y1 - h, x + w, y1, edge, 1)
        _disc(img, (x + w * 0.85, y1 - h * 0.45), 1.0 * s, _shade(colour, 1.6, 50))
    elif kind == "poster":
        w, h = _u(rng, 8, 16) * s, _u(rng, 10, 20) * s
        y = horizon - h - _u(rng, 6, 30) * s
        _rect(img, x, y, x + w, y + h, _jitter_colour((225, 230, 230), rng, 25))
        for _ in range(int(rng.integers(2, 5))):
            px, py = x + _u(rng, 1, w - 1), y + _u(rng, 1, h - 1)
            _line(img, (px, py), (px + _u(rng, -4, 4) * s, py + _u(rng, -4, 4) * s), _pick(rng, palette), 1)
    elif kind == "plant":
        y = horizon + _u(rng, 2, 20) * s
        _rect(img, x - 3 * s, y - 5 * s, x + 3 * s, y, _shade(colour, 0.8))
        for _ in range(int(rng.integers(4, 9))):
            _line(img, (x, y - 5 * s), (x + _u(rng, -8, 8) * s, y - _u(rng, 8, 18) * s),
                  _jitter_colour((60, 140, 60), rng, 30), 1)
    elif kind == "cart":
        w, h = _u(rng, 10, 18) * s, _u(rng, 12, 20) * s
        y1 = horizon + _u(rng, 5, 35) * s
        for k in range(3):
            yy = y1 - h + k * h / 2.2
            _line(img, (x, yy), (x + w, yy), colour, max(1, int(1.5 * s)))
        _line(img, (x, y1 - h), (x, y1), edge, 1)
        _line(img, (x + w, y1 - h), (x + w, y1), edge, 1)
        _disc(img, (x, y1 + s), 1.2 * s, (30, 30, 30))
        _disc(img, (x + w, y1 + s), 1.2 * s, (30, 30, 30))
    elif kind == "mat":
        w, h = _u(rng, 30, 60) * s, _u(rng, 4, 9) * s
        y = horizon + _u(rng, 8, 50) * s
        _fill(img, np.array([(x, y), (x + w, y), (x + w + 4 * s, y + h), (x - 4 * s, y + h)]), colour)
