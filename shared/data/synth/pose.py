"""Poses: a small 3-d kinematic model posed within anatomical ranges per kind, projected and
placed in the frame."""

from __future__ import annotations

import math

import numpy as np

from fedpose.shared.data.joints import NUM_JOINTS
from fedpose.shared.data.synth.body import (
    _DIMS,
    HEAD_TOP,
    L_ANKLE,
    L_ELBOW,
    L_HIP,
    L_KNEE,
    L_SHOULDER,
    L_WRIST,
    NECK,
    NECK_FRACTION,
    POSE_KINDS,
    R_ANKLE,
    R_ELBOW,
    R_HIP,
    R_KNEE,
    R_SHOULDER,
    R_WRIST,
    THORAX,
)
from fedpose.shared.data.synth.rng import _u
from fedpose.shared.data.synth.styles import SiteStyle


def _rx(deg: float) -> np.ndarray:
    """Rotation about the body's left axis; positive tips 'up' (0, -1, 0) forward (+z)."""
    c, s = math.cos(math.radians(deg)), math.sin(math.radians(deg))
    return np.array([[1, 0, 0], [0, c, s], [0, -s, c]])


def _ry(deg: float) -> np.ndarray:
    """Yaw about the vertical; positive turns the person's front (+z) towards image right (+x)."""
    c, s = math.cos(math.radians(deg)), math.sin(math.radians(deg))
    return np.array([[c, 0, s], [0, 1, 0], [-s, 0, c]])


def _rz(deg: float) -> np.ndarray:
    """Roll in the image plane; positive tips 'up' (0, -1) towards +x."""
    c, s = math.cos(math.radians(deg)), math.sin(math.radians(deg))
    return np.array([[c, -s, 0], [s, c, 0], [0, 0, 1]])


def _limb_dir(abduction: float, flexion: float, side: int) -> np.ndarray:
    """Unit vector of a limb hanging down (0, 1, 0), abducted sideways then flexed forward."""
    a, f = math.radians(abduction), math.radians(flexion)
    return np.array([side * math.sin(a), math.cos(a) * math.cos(f), math.cos(a) * math.sin(f)])


def _bent(upper: np.ndarray, angle: float, prefer: np.ndarray) -> np.ndarray:
    """Distal segment direction: ``upper`` turned by ``angle`` degrees towards ``prefer``."""
    w = prefer - (prefer @ upper) * upper
    norm = np.linalg.norm(w)
    if norm < 1e-6:
        w = np.array([0.0, 0.0, 1.0]) - upper[2] * upper
        norm = np.linalg.norm(w)
    w /= norm
    a = math.radians(angle)
    return math.cos(a) * upper + math.sin(a) * w



def _sample_angles(kind: str, rng: np.random.Generator) -> dict[str, float]:
    """Joint angles in degrees within plausible ranges for the pose kind."""
    a: dict[str, float] = {
        "bend": _u(rng, -4, 8), "lean": _u(rng, -5, 5), "twist": _u(rng, -10, 10),
        "head_pitch": _u(rng, -12, 18), "head_roll": _u(rng, -10, 10), "roll": _u(rng, -5, 5),
    }
    for side in ("r", "l"):
        a.update({
            f"{side}_hip_flex": _u(rng, -5, 10), f"{side}_hip_abd": _u(rng, 0, 9), f"{side}_knee": _u(rng, 0, 10),
            f"{side}_sh_flex": _u(rng, -15, 25), f"{side}_sh_abd": _u(rng, 4, 22), f"{side}_elbow": _u(rng, 0, 40),
            f"{side}_elbow_up": _u(rng, 0.0, 1.0),
        })
    r = rng.random()
    if r < 0.65:  # facing the camera, more or less
        a["yaw"] = _u(rng, -60, 60)
    elif r < 0.9:  # profile
        a["yaw"] = _u(rng, 60, 100) * rng.choice([-1, 1])
    else:  # back to the camera
        a["yaw"] = _u(rng, 150, 210)
    if kind == "standing":
        pass
    elif kind == "walking":
        front, back = ("r", "l") if rng.random() < 0.5 else ("l", "r")
        stride = _u(rng, 14, 30)
        a.update({f"{front}_hip_flex": stride, f"{front}_knee": _u(rng, 0, 15),
                  f"{back}_hip_flex": -_u(rng, 8, 22), f"{back}_knee": _u(rng, 15, 50),
                  f"{front}_sh_flex": -_u(rng, 8, 25), f"{back}_sh_flex": _u(rng, 10, 32),
                  f"{front}_elbow": _u(rng, 5, 30), f"{back}_elbow": _u(rng, 15, 55), "bend": _u(rng, 0, 8)})
        a["yaw"] = _u(rng, 40, 100) * rng.choice([-1, 1]) if rng.random() < 0.75 else _u(rng, -40, 40)
    elif kind == "sitting":
        for side in ("r", "l"):
            flex = _u(rng, 75, 100)
            a.update({f"{side}_hip_flex": flex, f"{side}_hip_abd": _u(rng, 0, 14),
                      f"{side}_knee": flex + _u(rng, -20, 25), f"{side}_sh_flex": _u(rng, 10, 55),
                      f"{side}_elbow": _u(rng, 30, 100)})
        a["bend"] = _u(rng, -14, 10)
        a["yaw"] = _u(rng, -80, 80)
    elif kind == "lying":
        knees_up = rng.random() < 0.3
        for side in ("r", "l"):
            flex = _u(rng, 20, 50) if knees_up else _u(rng, -4, 10)
            a.update({f"{side}_hip_flex": flex, f"{side}_hip_abd": _u(rng, 0, 14),
                      f"{side}_knee": 2 * flex if knees_up else _u(rng, 0, 12),
                      f"{side}_sh_abd": _u(rng, 5, 45), f"{side}_sh_flex": _u(rng, -10, 40),
                      f"{side}_elbow": _u(rng, 0, 100)})
        a.update({"bend": 0.0, "lean": _u(rng, -4, 4), "head_pitch": _u(rng, -15, 10)})
        a["yaw"] = _u(rng, 70, 95) * rng.choice([-1, 1]) if rng.random() < 0.25 else _u(rng, -20, 20)
        # Head to the left or right of the image, bed roughly level.
        a["roll"] = rng.choice([-90.0, 90.0]) + _u(rng, -12, 12)
    elif kind == "bending":
        bend = _u(rng, 40, 95)
        knee = _u(rng, 0, 30)
        for side in ("r", "l"):
            a.update({f"{side}_hip_flex": knee * 0.5 + _u(rng, -3, 3), f"{side}_knee": knee,
                      f"{side}_sh_flex": bend + _u(rng, -20, 25), f"{side}_sh_abd": _u(rng, 0, 15),
                      f"{side}_elbow": _u(rng, 0, 35)})
        a.update({"bend": bend, "head_pitch": _u(rng, -30, 0)})
        a["yaw"] = _u(rng, 45, 100) * rng.choice([-1, 1]) if rng.random() < 0.75 else _u(rng, -30, 30)
    elif kind == "arms_raised":
        sides = ("r", "l") if rng.random() < 0.7 else (("r",) if rng.random() < 0.5 else ("l",))
        for side in sides:
            if rng.random() < 0.5:
                a.update({f"{side}_sh_abd": _u(rng, 100, 175), f"{side}_sh_flex": _u(rng, -10, 20)})
            else:
                a.update({f"{side}_sh_abd": _u(rng, 5, 30), f"{side}_sh_flex": _u(rng, 110, 175)})
            a[f"{side}_elbow"] = _u(rng, 0, 70)
    else:
        raise ValueError(f"unknown pose kind {kind!r}; choose from {POSE_KINDS}")
    return a


def _assemble(a: dict[str, float], dims: dict[str, float]) -> np.ndarray:
    """Angles -> (16, 3) joints in the body frame (x = person's left, y down, z forward), pelvis at 0."""
    p = np.zeros((NUM_JOINTS, 3))
    for side, s, hip_i, knee_i, ankle_i in (("r", -1, R_HIP, R_KNEE, R_ANKLE), ("l", 1, L_HIP, L_KNEE, L_ANKLE)):
        flex, abd, knee = a[f"{side}_hip_flex"], a[f"{side}_hip_abd"], a[f"{side}_knee"]
        p[hip_i] = (s * dims["hip_half"], dims["hip_drop"], 0.0)
        p[knee_i] = p[hip_i] + dims["thigh"] * _limb_dir(abd, flex, s)
        p[ankle_i] = p[knee_i] + dims["shin"] * _limb_dir(abd, flex - knee, s)
    torso = _rx(a["bend"]) @ _rz(a["lean"]) @ _ry(a["twist"])
    p[THORAX] = torso @ (0.0, -dims["spine"], 0.0)
    for side, s, sh_i, el_i, wr_i in (("r", -1, R_SHOULDER, R_ELBOW, R_WRIST), ("l", 1, L_SHOULDER, L_ELBOW, L_WRIST)):
        upper = _limb_dir(a[f"{side}_sh_abd"], a[f"{side}_sh_flex"], s)
        fore = _bent(upper, a[f"{side}_elbow"], np.array([0.0, -a[f"{side}_elbow_up"], 1.0]))
        p[sh_i] = torso @ (s * dims["shoulder_half"], -dims["spine"] + dims["shoulder_drop"], 0.0)
        p[el_i] = p[sh_i] + dims["upper_arm"] * (torso @ upper)
        p[wr_i] = p[el_i] + dims["forearm"] * (torso @ fore)
    head_dir = torso @ _rx(a["head_pitch"]) @ _rz(a["head_roll"]) @ np.array([0.0, -1.0, 0.0])
    p[HEAD_TOP] = p[THORAX] + dims["head"] * head_dir
    p[NECK] = p[THORAX] + NECK_FRACTION * dims["head"] * head_dir
    return p


def sample_pose_3d(kind: str, rng: np.random.Generator) -> np.ndarray:
    """(16, 3) joints of a random pose: x right, y down (image plane), z towards the camera.

    Canonical frame: pelvis at the origin, units of standing height. The x, y
    part is what the camera sees (orthographic); z orders the drawing.
    """
    if kind not in POSE_KINDS:
        raise ValueError(f"unknown pose kind {kind!r}; choose from {POSE_KINDS}")
    angles = _sample_angles(kind, rng)
    dims = {k: v * float(rng.uniform(0.96, 1.04)) for k, v in _DIMS.items()}
    body = _assemble(angles, dims)
    return body @ (_rz(angles["roll"]) @ _ry(angles["yaw"])).T


def sample_pose(kind: str, rng: np.random.Generator) -> np.ndarray:
    """(16, 2) float32 joints of a random pose in the canonical frame (see ``sample_pose_3d``)."""
    return sample_pose_3d(kind, rng)[:, :2].astype(np.float32)


def place_pose(
    pose: np.ndarray, *, kind: str, style: SiteStyle, size: int, rng: np.random.Generator
) -> np.ndarray:
    """Canonical (16, 2+) pose -> (16, 2) float32 pixel joints inside a size x size frame.

    The person's standing height is ``style.person_height`` of the frame,
    squashed vertically by ``style.foreshorten``; upright people stand with
    their feet below the floor line.
    """
    pts = np.asarray(pose, dtype=np.float64)[:, :2].copy()
    height = size * _u(rng, *style.person_height)
    pts *= height
    pts[:, 1] *= style.foreshorten
    margin = max(3.0, 0.06 * height)
    lo, hi = pts.min(axis=0), pts.max(axis=0)
    extent = hi - lo
    room = size - 2 * margin
    if extent.max() > room:
        shrink = room / extent.max()
        pts *= shrink
        lo, hi, extent = lo * shrink, hi * shrink, extent * shrink
    x0 = _u(rng, margin, size - margin - extent[0])
    y_min, y_max = margin, size - margin - extent[1]
    if kind != "lying":
        floor = style.horizon[1] * size + 0.04 * size  # feet on the floor, below the wall
        y_min = min(max(y_min, floor - extent[1]), y_max)
    else:
        y_min = min(max(y_min, 0.3 * size), y_max)
    y0 = _u(rng, y_min, y_max)
    return (pts - lo + (x0, y0)).astype(np.float32)
