"""One person drawn from joints: head geometry, torso, limbs, clothing and face in depth order."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import cv2
import numpy as np

from fedpose.shared.data.joints import NUM_JOINTS
from fedpose.shared.data.synth.body import (
    _DIMS,
    CHIN_FRACTION,
    HEAD_TOP,
    L_ANKLE,
    L_ELBOW,
    L_HIP,
    L_KNEE,
    L_SHOULDER,
    L_WRIST,
    NECK,
    PELVIS,
    R_ANKLE,
    R_ELBOW,
    R_HIP,
    R_KNEE,
    R_SHOULDER,
    R_WRIST,
    THORAX,
)
from fedpose.shared.data.synth.draw import _SHIFT, _disc, _ellipse, _fill, _line, _poly, _shade
from fedpose.shared.data.synth.identity import Identity
from fedpose.shared.data.synth.styles import Colour


def _body_unit(joints: np.ndarray) -> float:
    """Standing height in px implied by the joints (robust to foreshortened bones)."""
    pairs = ((R_HIP, R_KNEE, "thigh"), (L_HIP, L_KNEE, "thigh"), (R_KNEE, R_ANKLE, "shin"),
             (L_KNEE, L_ANKLE, "shin"), (PELVIS, THORAX, "spine"), (THORAX, HEAD_TOP, "head"),
             (R_SHOULDER, R_ELBOW, "upper_arm"), (L_SHOULDER, L_ELBOW, "upper_arm"))
    ratios = sorted(float(np.linalg.norm(joints[a] - joints[b])) / _DIMS[d] for a, b, d in pairs)
    return max(ratios[-3], 4.0)


def head_geometry(joints: np.ndarray) -> tuple[np.ndarray, tuple[float, float], float]:
    """Head ellipse (centre (2,), (half length along neck axis, half width), angle in degrees).

    The ellipse runs from the chin (a third of the way from thorax to head
    top) to the head top; its width is 0.8 of its length.
    """
    thorax, top = joints[THORAX].astype(np.float64), joints[HEAD_TOP].astype(np.float64)
    axis = top - thorax
    length = max(float(np.linalg.norm(axis)), 1e-3)
    centre = thorax + (CHIN_FRACTION + 1.0) / 2.0 * axis
    half_len = (1.0 - CHIN_FRACTION) / 2.0 * length
    angle = math.degrees(math.atan2(axis[1], axis[0]))
    return centre, (half_len, 0.8 * half_len), angle


def head_box(joints: np.ndarray) -> np.ndarray:
    """(2, 2) [[x1, y1], [x2, y2]] PCKh head box: square of side |head_top - upper_neck| around the head.

    MPII's head rectangles span roughly upper neck to crown, and PCKh's head
    size 0.6 x diagonal then equals about 0.85 of that segment. A square keeps
    the threshold independent of how the head is rotated (people in bed).
    """
    neck, top = joints[NECK].astype(np.float64), joints[HEAD_TOP].astype(np.float64)
    half = max(float(np.linalg.norm(top - neck)), 1e-3) / 2.0
    centre = (neck + top) / 2.0
    return np.stack([centre - half, centre + half]).astype(np.float32)


def torso_facing(points: np.ndarray) -> np.ndarray | None:
    """Unit vector the torso faces, from (16, 3) points (x right, y down, z to the camera); None if degenerate."""
    p = np.asarray(points, dtype=np.float64)
    across = p[L_SHOULDER] - p[R_SHOULDER] + p[L_HIP] - p[R_HIP]
    down = p[PELVIS] - p[THORAX]
    f = np.cross(across, down)
    norm = np.linalg.norm(f)
    return f / norm if norm > 1e-9 else None


def _facing(joints: np.ndarray, depth: np.ndarray | None, rng: np.random.Generator) -> np.ndarray:
    """Unit 3-d vector the person faces (x right, y down, z to camera)."""
    if depth is not None and (f := torso_facing(np.column_stack([joints, depth]))) is not None:
        return f
    # 2-d only: the shoulder order tells front from back; the profile side is a guess.
    across = joints[L_SHOULDER] - joints[R_SHOULDER]
    spine = joints[THORAX] - joints[PELVIS]
    width = float(np.linalg.norm(across)) / max(_body_unit(joints) * 2 * _DIMS["shoulder_half"], 1e-6)
    front = float(np.sign(across[0] * -spine[1] - across[1] * -spine[0]) or 1.0)
    z = front * min(width, 1.0)
    side = math.sqrt(max(0.0, 1 - z * z)) * (1 if rng.random() < 0.5 else -1)
    return np.array([side, 0.0, z])


def _torso_polygon(j: np.ndarray, unit: float, build: float) -> np.ndarray:
    spine = j[THORAX] - j[PELVIS]
    length = max(float(np.linalg.norm(spine)), 1e-6)
    perp = np.array([-spine[1], spine[0]]) / length
    min_top, min_bot = 0.075 * unit * build, 0.065 * unit * build
    top_mid = (j[R_SHOULDER] + j[L_SHOULDER]) / 2
    bot_mid = (j[R_HIP] + j[L_HIP]) / 2
    top_half = max(abs(float(perp @ (j[L_SHOULDER] - j[R_SHOULDER]))) / 2 + 0.01 * unit, min_top)
    bot_half = max(abs(float(perp @ (j[L_HIP] - j[R_HIP]))) / 2 + 0.02 * unit, min_bot)
    waist_mid = top_mid + 0.65 * (bot_mid - top_mid)
    waist_half = 0.88 * min(top_half, bot_half * 1.1)
    return np.array([
        top_mid + perp * top_half, waist_mid + perp * waist_half, bot_mid + perp * bot_half,
        bot_mid - perp * bot_half, waist_mid - perp * waist_half, top_mid - perp * top_half,
    ])


def _patterned_fill(img: np.ndarray, polygon: np.ndarray, base: Colour, pattern: str, colour: Colour,
                    axis: np.ndarray, unit: float) -> None:
    _fill(img, polygon, base)
    if pattern == "solid":
        return
    h, w = img.shape[:2]
    x0, y0 = np.floor(polygon.min(axis=0)).astype(int) - 1
    x1, y1 = np.ceil(polygon.max(axis=0)).astype(int) + 2
    x0, y0, x1, y1 = max(x0, 0), max(y0, 0), min(x1, w), min(y1, h)
    if x1 - x0 < 2 or y1 - y0 < 2:
        return
    roi = img[y0:y1, x0:x1]
    mask = np.zeros(roi.shape[:2], np.uint8)
    cv2.fillPoly(mask, [_poly(polygon - (x0, y0))], 255, cv2.LINE_8, _SHIFT)
    layer = roi.copy()
    step = max(2.0, 0.035 * unit)
    along = axis / max(float(np.linalg.norm(axis)), 1e-6)
    across = np.array([-along[1], along[0]])
    centre = (polygon.mean(axis=0) - (x0, y0))
    reach = float(max(x1 - x0, y1 - y0))
    if pattern in ("hstripes", "vstripes"):
        direction, offset_dir = (across, along) if pattern == "hstripes" else (along, across)
        for k in np.arange(-reach, reach, step):
            c = centre + offset_dir * k
            _line(layer, c - direction * reach, c + direction * reach, colour, 1)
    else:  # dots
        for u in np.arange(-reach, reach, step * 1.3):
            for v in np.arange(-reach, reach, step * 1.3):
                _disc(layer, centre + along * u + across * v, 0.5, colour)
    roi[mask > 0] = layer[mask > 0]


def _segment_parts(j: np.ndarray, ident: Identity, unit: float) -> dict[str, list[tuple]]:
    """Drawable parts: name -> list of (kind, args) primitives, limbs thin on purpose."""
    b = ident.build
    t_thigh = max(1, round(0.03 * unit * b))
    t_shin = max(1, round(0.022 * unit * b))
    t_upper = max(1, round(0.021 * unit * b))
    t_fore = max(1, round(0.015 * unit * b))
    shin_colour = ident.skin if ident.shorts else ident.pants
    fore_colour = ident.shirt if ident.sleeves_long else ident.skin
    marker = max(0.6, 0.011 * unit)
    parts: dict[str, list[tuple]] = {}
    for name, hip, knee, ankle in (("leg_r", R_HIP, R_KNEE, R_ANKLE), ("leg_l", L_HIP, L_KNEE, L_ANKLE)):
        parts[name] = [
            ("line", j[hip], j[knee], ident.pants, t_thigh),
            ("line", j[knee], j[ankle], shin_colour, t_shin),
            ("disc", j[knee], marker, _shade(ident.pants, 1.3, 45)),  # knee patch
            ("foot", ankle, knee),
            ("disc", j[ankle], marker * 1.1, ident.socks),  # sock band
        ]
    for name, sh, el, wr in (("arm_r", R_SHOULDER, R_ELBOW, R_WRIST), ("arm_l", L_SHOULDER, L_ELBOW, L_WRIST)):
        parts[name] = [
            ("line", j[sh], j[el], ident.shirt, t_upper),
            ("line", j[el], j[wr], fore_colour, t_fore),
            ("disc", j[el], marker, _shade(ident.shirt, 1.25, 50)),  # elbow patch
            ("hand", wr, el),
            ("disc", j[wr], marker, ident.cuff),  # wristband
        ]
    return parts


def _draw_primitives(img: np.ndarray, prims: list[tuple], j: np.ndarray, ident: Identity, unit: float,
                     facing: np.ndarray) -> None:
    for prim in prims:
        kind = prim[0]
        if kind == "line":
            _line(img, prim[1], prim[2], prim[3], prim[4])
        elif kind == "disc":
            _disc(img, prim[1], prim[2], prim[3])
        elif kind == "hand":
            wr, el = j[prim[1]], j[prim[2]]
            d = wr - el
            d = d / max(float(np.linalg.norm(d)), 1e-6)
            _disc(img, wr + d * 0.03 * unit, max(0.8, 0.018 * unit), ident.skin)
        elif kind == "foot":
            ankle, knee = j[prim[1]], j[prim[2]]
            shin = ankle - knee
            shin = shin / max(float(np.linalg.norm(shin)), 1e-6)
            forward = facing[:2]
            reach = float(np.linalg.norm(forward))
            toe = ankle + shin * 0.025 * unit
            if reach > 0.2:  # profile-ish: the foot points where the person faces
                toe = toe + forward / reach * min(reach, 1.0) * 0.05 * unit
            _line(img, ankle + shin * 0.01 * unit, toe, ident.shoes, max(1, round(0.025 * unit)))


@dataclasses.dataclass(frozen=True)
class FaceLayout:
    """Where ``_draw_head`` puts the face (pixels): the labels of the face tasks come from the same numbers.

    centre, (a, b), angle: the head ellipse (``head_geometry``); axis: unit vector towards the crown; across:
    axis turned a quarter (image right for an upright head); side = facing . across (> 0: turned towards
    +across); front = facing's z (> 0: towards the camera). eyes: the drawn eyes, (+across eye, -across eye)
    when both show, else the one near the camera; mouth: the mouth line's centre.
    """

    centre: np.ndarray
    a: float
    b: float
    angle: float
    axis: np.ndarray
    across: np.ndarray
    side: float
    front: float
    eyes: tuple[np.ndarray, ...]
    mouth: np.ndarray

    @property
    def face_shown(self) -> bool:
        return self.front > -0.35

    def skin_ellipse(self) -> tuple[np.ndarray, tuple[float, float]]:
        """The face's skin ellipse: centre and (half axis along the head, half width)."""
        centre = self.centre - self.axis * 0.2 * self.a + self.across * self.side * 0.22 * self.b
        return centre, (self.a * 0.78, self.b * (0.86 - 0.2 * abs(self.side)))


def face_layout(j: np.ndarray, facing: np.ndarray) -> FaceLayout:
    """The head and face geometry of joints ``j`` (16, 2) facing ``facing`` (3,), as ``_draw_head`` draws it."""
    centre, (a, b), angle = head_geometry(j)
    axis = np.array([math.cos(math.radians(angle)), math.sin(math.radians(angle))])  # towards the crown
    across = np.array([-axis[1], axis[0]])
    side = float(facing[:2] @ across)  # > 0: face turned towards +across
    front = float(facing[2])
    eye_up = centre + axis * 0.05 * a + across * side * 0.35 * b
    spread = 0.38 * b * max(front, 0.15)
    eyes = (eye_up + across * spread, eye_up - across * spread) if front > 0.35 else (eye_up + across * side * 0.3 * b,)
    mouth = centre - axis * 0.5 * a + across * side * 0.4 * b
    return FaceLayout(centre, a, b, angle, axis, across, side, front, eyes, mouth)


def _draw_head(img: np.ndarray, j: np.ndarray, ident: Identity, unit: float, facing: np.ndarray) -> None:
    f = face_layout(j, facing)
    centre, a, b, angle, axis, across, side = f.centre, f.a, f.b, f.angle, f.axis, f.across, f.side
    hair = (210, 170, 120) if ident.hair_style == "cap" else ident.hair
    neck_top = j[THORAX] + (CHIN_FRACTION + 0.1) * (j[HEAD_TOP] - j[THORAX])
    _line(img, j[THORAX], neck_top, _shade(ident.skin, 0.92), max(1, round(0.035 * unit * ident.build)))
    if ident.hair_style == "long":
        _ellipse(img, centre - axis * 0.35 * a - across * side * 0.2 * b, (a * 1.25, b * 1.1), angle, hair)
    if ident.hair_style == "bald":
        _ellipse(img, centre, (a, b), angle, ident.skin)
    else:
        _ellipse(img, centre, (a, b), angle, hair)
        if f.face_shown:  # face visible: skin ellipse shifted to the chin and the facing side
            face_c, axes = f.skin_ellipse()
            _ellipse(img, face_c, axes, angle, ident.skin)
    if ident.hair_style == "bun":
        _disc(img, centre + axis * 0.95 * a - across * side * 0.5 * b, 0.35 * b, hair)
    if not f.face_shown:
        return
    eyes = f.eyes
    dot = max(0.45, 0.08 * b)
    for eye in eyes:
        _disc(img, eye, dot, (25, 25, 25))
    mouth = f.mouth
    if ident.face == "mask":
        _ellipse(img, centre - axis * 0.45 * a + across * side * 0.25 * b, (0.45 * a, 0.75 * b), angle, ident.accessory)
    else:
        if ident.face == "beard":
            _ellipse(img, centre - axis * 0.55 * a + across * side * 0.2 * b, (0.4 * a, 0.7 * b), angle,
                     _shade(ident.hair, 0.9))
        _line(img, mouth - across * 0.2 * b, mouth + across * 0.2 * b, (60, 60, 150), 1)
    if ident.face == "glasses" and len(eyes) == 2:
        _line(img, eyes[0], eyes[1], ident.accessory, 1)
        for eye in eyes:
            _disc(img, eye, dot * 1.2, ident.accessory)


def render_person(canvas: np.ndarray, joints: np.ndarray, identity: Identity, rng: np.random.Generator,
                  *, depth: np.ndarray | None = None) -> None:
    """Draw one person on ``canvas`` (H, W, 3 uint8 BGR, modified in place).

    joints: (16, 2) pixel coordinates. depth: optional (16,) z towards the
    camera from ``sample_pose_3d``; it orders limbs far to near and tells
    which way the face points. Without it limbs go legs, torso, arms, head
    and the face direction is guessed from the shoulder order. rng adds the
    per-frame shading of clothes (lighting on the person).
    """
    j = np.asarray(joints, dtype=np.float64)
    if j.shape != (NUM_JOINTS, 2) or not np.all(np.isfinite(j)):
        raise ValueError(f"render_person needs finite joints of shape ({NUM_JOINTS}, 2), got {j.shape}")
    if depth is not None and np.asarray(depth).shape != (NUM_JOINTS,):
        raise ValueError(f"depth must have shape ({NUM_JOINTS},), got {np.asarray(depth).shape}")
    ident = _lit(identity, rng)
    facing = _facing(j, depth, rng)
    _draw_body(canvas, j, ident, _body_unit(j), facing, depth, parts=None)


def _lit(identity: Identity, rng: np.random.Generator) -> Identity:
    """The identity under this frame's light on the clothes."""
    shade = float(rng.uniform(0.9, 1.1))
    return dataclasses.replace(identity, shirt=_shade(identity.shirt, shade), pants=_shade(identity.pants, shade))


_PART_JOINTS = {
    "leg_r": (R_HIP, R_KNEE, R_ANKLE), "leg_l": (L_HIP, L_KNEE, L_ANKLE),
    "arm_r": (R_SHOULDER, R_ELBOW, R_WRIST), "arm_l": (L_SHOULDER, L_ELBOW, L_WRIST),
    "torso": (R_SHOULDER, L_SHOULDER, R_HIP, L_HIP, PELVIS, THORAX),
}
_DEFAULT_ORDER = {"leg_r": 0.0, "leg_l": 0.0, "torso": 1.0, "arm_r": 2.0, "arm_l": 2.0}


def _draw_body(canvas: np.ndarray, j: np.ndarray, ident: Identity, unit: float, facing: np.ndarray,
               depth: np.ndarray | None, parts: Sequence[str] | None) -> None:
    prims = _segment_parts(j, ident, unit)
    names = list(_PART_JOINTS) if parts is None else list(parts)
    if depth is None:
        order = sorted(names, key=lambda n: _DEFAULT_ORDER[n])
    else:
        z = np.asarray(depth, dtype=np.float64) * unit
        # Legs start inside the torso outline: bias them back so hips do not cover the trunk.
        bias = {"leg_r": -0.04 * unit, "leg_l": -0.04 * unit, "torso": 0.0, "arm_r": 0.0, "arm_l": 0.0}
        order = sorted(names, key=lambda n: float(z[list(_PART_JOINTS[n])].mean()) + bias[n])
    for name in order:
        if name == "torso":
            polygon = _torso_polygon(j, unit, ident.build)
            _patterned_fill(canvas, polygon, ident.shirt, ident.shirt_pattern, ident.pattern,
                            j[THORAX] - j[PELVIS], unit)
            _line(canvas, j[R_HIP], j[L_HIP], ident.pants, max(1, round(0.05 * unit * ident.build)))
            if ident.badge and facing[2] > 0.3:
                chest = j[THORAX] + 0.3 * (j[PELVIS] - j[THORAX]) + 0.35 * (j[L_SHOULDER] - j[R_SHOULDER])
                _disc(canvas, chest, max(0.6, 0.012 * unit), (250, 250, 250))
        else:
            _draw_primitives(canvas, prims[name], j, ident, unit, facing)
    if parts is None:
        _draw_head(canvas, j, ident, unit, facing)
