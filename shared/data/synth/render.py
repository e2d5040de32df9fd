"""A whole frame: background, bed or chair, the person, blanket, occluder, then the camera
(blur, gain, vignette, noise); the person box of a pose."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import cv2
import numpy as np

from fedpose.shared.data.joints import NUM_JOINTS
from fedpose.shared.data.records import PIXEL_STD
from fedpose.shared.data.synth.background import render_background
from fedpose.shared.data.synth.body import (
    HEAD_TOP,
    L_ANKLE,
    L_HIP,
    L_KNEE,
    L_SHOULDER,
    PELVIS,
    POSE_KINDS,
    R_ANKLE,
    R_HIP,
    R_KNEE,
    R_SHOULDER,
    THORAX,
)
from fedpose.shared.data.synth.draw import _SHIFT, _ellipse, _fill, _line, _pick, _poly, _rect, _shade
from fedpose.shared.data.synth.identity import Identity
from fedpose.shared.data.synth.person import _body_unit, _draw_body, _facing, _lit, head_box
from fedpose.shared.data.synth.rng import _u
from fedpose.shared.data.synth.styles import Colour, SiteStyle, _jitter_colour


def _draw_bed(img: np.ndarray, j: np.ndarray, unit: float, bedding: Colour, rng: np.random.Generator) -> None:
    feet = (j[R_ANKLE] + j[L_ANKLE]) / 2
    axis = j[HEAD_TOP] - feet
    length = float(np.linalg.norm(axis))
    if length < 1e-6:
        return
    along = axis / length
    across = np.array([-along[1], along[0]])
    centre = (j[HEAD_TOP] + feet) / 2 + across * _u(rng, -0.03, 0.03) * unit
    half_l, half_w = length / 2 + 0.12 * unit, 0.16 * unit
    signs = ((1, 1), (1, -1), (-1, -1), (-1, 1))
    corners = np.array([centre + along * half_l * sl + across * half_w * sw for sl, sw in signs])
    frame = _jitter_colour((120, 124, 130), rng, 30)
    # Legs of the bed down to the floor, then frame, mattress and pillow.
    for corner in corners:
        _line(img, corner, corner + (0, 0.12 * unit), frame, max(1, round(0.015 * unit)))
    _fill(img, corners, _shade(bedding, 0.85))
    inner = centre + (corners - centre) * np.array([[0.96], [0.96], [0.96], [0.96]])
    _fill(img, inner, bedding)
    cv2.polylines(img, [_poly(corners)], True, frame, max(1, round(0.012 * unit)), cv2.LINE_AA, _SHIFT)
    head_end = centre + along * (half_l - 0.08 * unit)
    _ellipse(img, head_end, (0.06 * unit, 0.11 * unit), math.degrees(math.atan2(along[1], along[0])),
             _shade(bedding, 1.05, 15))


def _draw_blanket(img: np.ndarray, j: np.ndarray, unit: float, colour: Colour, rng: np.random.Generator,
                  chest: bool) -> None:
    pts = [j[i] for i in (R_ANKLE, L_ANKLE, R_KNEE, L_KNEE, R_HIP, L_HIP, PELVIS)]
    if chest:
        pts += [j[PELVIS] + 0.75 * (j[i] - j[PELVIS]) for i in (R_SHOULDER, L_SHOULDER)]
    margin = 0.06 * unit
    ring = np.array([(math.cos(t), math.sin(t)) for t in np.linspace(0, 2 * math.pi, 8, endpoint=False)]) * margin
    cloud = np.concatenate([p + ring for p in pts]).astype(np.float32)
    hull = cv2.convexHull(cloud).reshape(-1, 2)
    _fill(img, hull, colour)
    axis = j[THORAX] - j[PELVIS]
    along = axis / max(float(np.linalg.norm(axis)), 1e-6)
    pattern = _shade(colour, 0.8)
    lo, hi = hull.min(axis=0), hull.max(axis=0)
    for _ in range(int(rng.integers(2, 6))):  # folds
        p = rng.uniform(lo, hi)
        _line(img, p, p + along * _u(rng, -0.1, 0.1) * unit + np.array([-along[1], along[0]]) * 0.08 * unit, pattern, 1)


def _draw_chair(img: np.ndarray, j: np.ndarray, unit: float, colour: Colour) -> None:
    hips = (j[R_HIP] + j[L_HIP]) / 2
    knees = (j[R_KNEE] + j[L_KNEE]) / 2
    seat_y = float(max(j[R_HIP][1], j[L_HIP][1])) + 0.03 * unit
    xs = [j[i][0] for i in (R_HIP, L_HIP, R_KNEE, L_KNEE)]
    x0, x1 = min(xs) - 0.04 * unit, max(xs) + 0.04 * unit
    floor_y = float(max(j[R_ANKLE][1], j[L_ANKLE][1])) + 0.02 * unit
    t = max(1, round(0.025 * unit))
    edge = _shade(colour, 0.6)
    direction = knees[0] - hips[0]
    if abs(direction) > 0.08 * unit:  # seen from the side: back rest behind the hips
        back_x = hips[0] - math.copysign(0.06 * unit, direction)
        _line(img, (back_x, seat_y), (back_x, j[THORAX][1] + 0.05 * unit), colour, t + 1)
    else:  # seen from the front: back rest as a panel behind the torso
        half = 0.16 * unit
        top = j[THORAX][1] - 0.02 * unit
        _rect(img, hips[0] - half, top, hips[0] + half, seat_y, colour)
        _rect(img, hips[0] - half, top, hips[0] + half, seat_y, edge, 1)
    _line(img, (x0, seat_y), (x1, seat_y), colour, t)
    for x in (x0 + 0.01 * unit, x1 - 0.01 * unit):
        _line(img, (x, seat_y), (x, floor_y), edge, max(1, t - 1))


def _draw_occluder(img: np.ndarray, j: np.ndarray, unit: float, palette: Sequence[Colour],
                   rng: np.random.Generator) -> None:
    """A box (table, cart, screen) in front of the person covering a few joints."""
    size = img.shape[0]
    floor_standing = rng.random() < 0.5  # furniture on the floor reaches the bottom of the frame
    for _ in range(6):
        anchor = j[int(rng.integers(NUM_JOINTS))]
        w, h = _u(rng, 0.15, 0.4) * unit, _u(rng, 0.15, 0.4) * unit
        x0 = anchor[0] - _u(rng, 0.1, 0.9) * w
        y0 = anchor[1] - _u(rng, 0.1, 0.9) * h
        if floor_standing:
            h = max(h, size - y0)
        covered = ((j[:, 0] >= x0) & (j[:, 0] <= x0 + w) & (j[:, 1] >= y0) & (j[:, 1] <= y0 + h)).sum()
        if covered <= 4:
            break
    else:
        return  # every try would hide most of the person
    colour = _pick(rng, palette)
    _rect(img, x0, y0, x0 + w, y0 + h, colour)
    _rect(img, x0, y0, x0 + w, y0 + h, _shade(colour, 0.6), 1)
    if rng.random() < 0.6:
        _line(img, (x0, y0 + h * 0.3), (x0 + w, y0 + h * 0.3), _shade(colour, 0.75), 1)


@functools.lru_cache(maxsize=8)
def _vignette_map(size: int) -> np.ndarray:
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    c = (size - 1) / 2.0
    return (((xx - c) ** 2 + (yy - c) ** 2) / (2 * c * c))[..., None]  # (size, size, 1) in [0, 1]


def _camera(img: np.ndarray, style: SiteStyle, rng: np.random.Generator) -> np.ndarray:
    size = img.shape[0]
    out = img.astype(np.float32)
    if style.blur > 0:
        out = cv2.GaussianBlur(out, (0, 0), style.blur * size / 128.0)
    gain = style.gain * _u(rng, 0.92, 1.08)
    out *= (np.asarray(style.cast, np.float32) * gain)
    if style.vignette > 0:
        out *= 1.0 - style.vignette * _vignette_map(size)
    if style.noise > 0:
        out += rng.standard_normal(out.shape, dtype=np.float32) * np.float32(style.noise)
    return np.clip(out + 0.5, 0, 255).astype(np.uint8)


def render_frame(
    joints: np.ndarray,
    *,
    style: SiteStyle,
    identity: Identity,
    size: int,
    rng: np.random.Generator,
    kind: str | None = None,
    depth: np.ndarray | None = None,
) -> np.ndarray:
    """One (size, size, 3) uint8 BGR frame of a person at pixel ``joints`` (16, 2).

    kind adds the furniture the pose needs ("lying": bed and maybe a
    blanket, "sitting": chair); depth as in ``render_person``. Occluded joints
    keep their annotation (MPII semantics), only pixels change.
    """
    if kind is not None and kind not in POSE_KINDS:
        raise ValueError(f"unknown pose kind {kind!r}; choose from {POSE_KINDS}")
    j = np.asarray(joints, dtype=np.float64)
    if j.shape != (NUM_JOINTS, 2) or not np.all(np.isfinite(j)):
        raise ValueError(f"render_frame needs finite joints of shape ({NUM_JOINTS}, 2), got {j.shape}")
    img = render_background(style, size, rng)
    unit = _body_unit(j)
    palette = style.palette
    if kind == "lying":
        _draw_bed(img, j, unit, _jitter_colour(style.bedding, rng, 12), rng)
    elif kind == "sitting":
        _draw_chair(img, j, unit, _pick(rng, palette))
    ident = _lit(identity, rng)
    facing = _facing(j, depth, rng)
    _draw_body(img, j, ident, unit, facing, depth, parts=None)  # as render_person
    if kind == "lying" and rng.random() < 0.6:
        chest = rng.random() < 0.4
        _draw_blanket(img, j, unit, _jitter_colour(style.bedding, rng, 25), rng, chest)
        if chest:  # arms rest on top of the blanket
            _draw_body(img, j, ident, unit, facing, depth, parts=("arm_r", "arm_l"))
    if rng.random() < style.occluder_prob:
        _draw_occluder(img, j, unit, palette, rng)
    return _camera(img, style, rng)


def person_box(joints: np.ndarray) -> tuple[np.ndarray, float]:
    """(center (2,), scale) of the square box around joints and head, side 1.25 x extent / 200."""
    pts = np.concatenate([np.asarray(joints, dtype=np.float64), head_box(joints).astype(np.float64)])
    lo, hi = pts.min(axis=0), pts.max(axis=0)
    return (lo + hi) / 2.0, float((hi - lo).max()) * 1.25 / PIXEL_STD
