"""The face labels of a ward person, from the same geometry the renderer draws (``person.face_layout``).

What each label is, so that a reader of the results knows what the face heads learn on the ward:
- present: the face is drawn (turned towards the camera: facing z > -0.35) and its centre is in the image;
- box: the axis-aligned hull of the drawn skin ellipse;
- landmarks: the drawn eyes and mouth corners; the nose (not drawn, inferable from them) between eyes and
  mouth, shifted to the side the face turns to. In profile only the eye near the camera counts as visible;
  a mask covers the nose and the mouth;
- head pose: yaw from the drawn face direction (``atan2(side, front)``), roll from the drawn head axis,
  pitch from the 3-d pose (the crown tipped towards where the person faces is looking down);
- attribute: the identity's face cue (``FACE_ATTRIBUTES``), the ward's stand-in for DPLH's gender head.
"""

from __future__ import annotations

import math

import numpy as np

from fedpose.shared.data.face import NUM_LANDMARKS, FaceLabels, wrap_degrees
from fedpose.shared.data.records import inside
from fedpose.shared.data.synth.body import HEAD_TOP, THORAX
from fedpose.shared.data.synth.identity import FACES, Identity
from fedpose.shared.data.synth.person import face_layout, torso_facing

FACE_ATTRIBUTES: tuple[str, ...] = FACES


def face_labels(joints: np.ndarray, pose: np.ndarray, identity: Identity, size: int) -> FaceLabels | None:
    """Labels of the face ``render_frame`` draws for pixel ``joints`` (16, 2) of the 3-d ``pose`` (16, 3).

    None when the pose is too degenerate to say where the face points (the renderer then guesses the side).
    """
    j = np.asarray(joints, dtype=np.float64)
    p = np.asarray(pose, dtype=np.float64)
    # The renderer's facing: pixel x, y with the pose's depth (render_frame passes depth=pose[:, 2]).
    facing = torso_facing(np.column_stack([j, p[:, 2]]))
    facing_3d = torso_facing(p)
    if facing is None or facing_3d is None:
        return None
    attribute = FACE_ATTRIBUTES.index(identity.face)
    f = face_layout(j, facing)
    centre, (half_len, half_wid) = f.skin_ellipse()
    if not f.face_shown or not bool(inside(centre, (size, size))):
        return FaceLabels.absent(attribute)
    theta = math.radians(f.angle)
    hx = math.hypot(half_len * math.cos(theta), half_wid * math.sin(theta))
    hy = math.hypot(half_len * math.sin(theta), half_wid * math.cos(theta))
    box = np.array([[centre[0] - hx, centre[1] - hy], [centre[0] + hx, centre[1] + hy]])

    points = np.zeros((NUM_LANDMARKS, 2))
    visible = np.zeros(NUM_LANDMARKS, bool)
    if len(f.eyes) == 2:  # frontal: the +across eye is the person's left (their left is image right when upright)
        points[1], points[0] = f.eyes
        visible[:2] = True
    else:  # profile: turned towards +across shows the right cheek, so the right eye
        near = 0 if f.side > 0 else 1
        points[near], visible[near] = f.eyes[0], True
    masked = identity.face == "mask"
    points[2] = f.centre - f.axis * 0.2 * f.a + f.across * f.side * 0.45 * f.b
    points[3] = f.mouth - f.across * 0.2 * f.b
    points[4] = f.mouth + f.across * 0.2 * f.b
    visible[2:] = not masked
    visible &= inside(points, (size, size))

    up = p[HEAD_TOP] - p[THORAX]
    up /= max(float(np.linalg.norm(up)), 1e-9)
    yaw = math.degrees(math.atan2(f.side, f.front))
    pitch = -math.degrees(math.asin(float(np.clip(up @ facing_3d, -1.0, 1.0))))
    roll = float(wrap_degrees(math.degrees(math.atan2(f.axis[0], -f.axis[1]))))
    return FaceLabels(True, box, points, visible, (yaw, pitch, roll), attribute)
