"""Face labels of one person: presence, face box, facial landmarks, head pose and one attribute.

The face tasks of DPLH (HyperFace's detection, landmarks with visibility, head
pose and gender) ride on the pose record: a ``PoseRecord`` may carry one
``FaceLabels``. Coordinates follow the records' convention (0-based pixels,
the centre of the top-left pixel at (0, 0)); angles are degrees:

- yaw: the face turned towards the image's right is positive (0 = facing the
  camera, +-90 = profile);
- pitch: looking up is positive;
- roll: the crown tipped towards the image's right is positive (0 = upright).

The sidecar file ``faces.json`` (one entry per record of a split, aligned with
``annotations.json``) is the documented annotation format; the embedded ward
writes it and ``fedpose.shared.data.aflw`` converts AFLW-style annotations to it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# detect: face presence and box; landmarks: 5 points and their visibility; head_pose: yaw, pitch, roll;
# attribute: one classification of the face (off unless asked: docs/explanation/face-tasks.md says why).
FACE_TASKS: tuple[str, ...] = ("detect", "landmarks", "head_pose", "attribute")


def valid_face_tasks(tasks: Sequence[str]) -> bool:
    """Whether ``tasks`` names distinct tasks of ``FACE_TASKS`` (a config's and a site policy's check)."""
    return all(t in FACE_TASKS for t in tasks) and len(set(tasks)) == len(tasks)


# Five facial landmarks (the usual 5-point set), named from the person's own side as MPII names joints.
LANDMARK_NAMES: tuple[str, ...] = ("right_eye", "left_eye", "nose", "mouth_right", "mouth_left")
NUM_LANDMARKS = len(LANDMARK_NAMES)
LANDMARK_FLIP: tuple[int, ...] = (1, 0, 2, 4, 3)  # mirrored, the right eye is where the left one was
FACES_FILE = "faces.json"  # the sidecar of a split, beside annotations.json
FACES_FORMAT = "fedpose-faces"
FACES_VERSION = 1
MAX_ANGLE = 180.0


def _array(value: object, *, name: str, shape: tuple[int, ...], dtype: type) -> np.ndarray:
    try:
        array = np.array(value, dtype=dtype)
    except (TypeError, ValueError) as err:
        raise ValueError(f"FaceLabels.{name}: cannot convert {value!r} to {np.dtype(dtype).name}") from err
    if array.shape != shape:
        raise ValueError(f"FaceLabels.{name}: expected shape {shape}, got {array.shape}")
    if array.dtype.kind == "f" and not np.all(np.isfinite(array)):
        raise ValueError(f"FaceLabels.{name}: must be finite, got {array.tolist()}")
    array.setflags(write=False)
    return array


@dataclass(frozen=True, eq=False)
class FaceLabels:
    """The face of one person.

    Attributes:
        present: the face is turned towards the camera and inside the image.
        box: (2, 2) float32 [[x1, y1], [x2, y2]] face box (zeros when not present).
        landmarks: (5, 2) float32 in ``LANDMARK_NAMES`` order (0 where not visible).
        visible: (5,) bool, True where the landmark is seen (not turned away or covered).
        head_pose: (3,) float32 (yaw, pitch, roll) in degrees, each in [-180, 180]; meaningful when present.
        attribute: index into the split's attribute names, or -1 when unknown.
    """

    present: bool
    box: np.ndarray
    landmarks: np.ndarray
    visible: np.ndarray
    head_pose: np.ndarray
    attribute: int = -1

    def __post_init__(self) -> None:
        object.__setattr__(self, "present", bool(self.present))
        box = _array(self.box, name="box", shape=(2, 2), dtype=np.float32)
        if self.present and not np.all(box[1] > box[0]):
            raise ValueError(f"FaceLabels.box: x2 > x1 and y2 > y1 required, got {box.tolist()}")
        object.__setattr__(self, "box", box)
        vis_in = np.asarray(self.visible)
        if vis_in.dtype != np.bool_ and not np.all(np.isin(vis_in, (0, 1))):
            raise ValueError(f"FaceLabels.visible must be boolean or 0/1, got {vis_in.tolist()}")
        visible = _array(vis_in, name="visible", shape=(NUM_LANDMARKS,), dtype=np.bool_)
        if not self.present and visible.any():
            raise ValueError("FaceLabels: an absent face has no visible landmarks")
        object.__setattr__(self, "visible", visible)
        points = np.array(_array(self.landmarks, name="landmarks", shape=(NUM_LANDMARKS, 2), dtype=np.float32))
        points[~visible] = 0.0
        points.setflags(write=False)
        object.__setattr__(self, "landmarks", points)
        pose = _array(self.head_pose, name="head_pose", shape=(3,), dtype=np.float32)
        if np.any(np.abs(pose) > MAX_ANGLE):
            raise ValueError(f"FaceLabels.head_pose: angles must lie in [-180, 180] degrees, got {pose.tolist()}")
        object.__setattr__(self, "head_pose", pose)
        if isinstance(self.attribute, bool) or not isinstance(self.attribute, (int, np.integer)) or self.attribute < -1:
            raise ValueError(f"FaceLabels.attribute must be an integer >= -1, got {self.attribute!r}")
        object.__setattr__(self, "attribute", int(self.attribute))

    @staticmethod
    def absent(attribute: int = -1) -> FaceLabels:
        """A person whose face the camera does not see (turned away or outside the image)."""
        zeros = np.zeros
        return FaceLabels(False, zeros((2, 2)), zeros((NUM_LANDMARKS, 2)), zeros(NUM_LANDMARKS, bool), zeros(3),
                          attribute)


def wrap_degrees(angle: np.ndarray | float) -> np.ndarray:
    """Angles to [-180, 180)."""
    return (np.asarray(angle, dtype=np.float64) + 180.0) % 360.0 - 180.0


# ---------------------------------------------------------------------------
# faces.json: the annotation format
# ---------------------------------------------------------------------------


def _entry(face: FaceLabels | None) -> dict | None:
    if face is None:
        return None
    if not face.present:
        return {"present": False, "attribute": face.attribute}
    return {
        "present": True,
        "box": [round(float(v), 3) for v in face.box.reshape(-1)],
        "landmarks": [[round(float(x), 3), round(float(y), 3)] if v else None
                      for (x, y), v in zip(face.landmarks, face.visible)],
        "head_pose": [round(float(v), 3) for v in face.head_pose],
        "attribute": face.attribute,
    }


def write_faces(path: str | Path, faces: Sequence[FaceLabels | None], attributes: Sequence[str]) -> None:
    """Write ``faces.json`` atomically: one entry per record (null: no face annotation)."""
    path = Path(path)
    payload = {
        "format": FACES_FORMAT,
        "version": FACES_VERSION,
        "coordinates": "0-based pixels, centre of the top-left pixel at (0, 0)",
        "angles": "degrees: yaw (+ towards image right), pitch (+ up), roll (+ crown towards image right)",
        "landmarks": list(LANDMARK_NAMES),
        "attributes": list(attributes),
        "faces": [_entry(face) for face in faces],
    }
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, path)


def _parse_entry(entry: object, attributes: Sequence[str], where: str) -> FaceLabels | None:
    if entry is None:
        return None
    if not isinstance(entry, dict) or not isinstance(entry.get("present"), bool):
        raise ValueError(f"{where}: expected null or an object with a boolean 'present'")
    attribute = entry.get("attribute", -1)
    if isinstance(attribute, bool) or not isinstance(attribute, int) or not -1 <= attribute < len(attributes):
        raise ValueError(f"{where}: attribute must be -1 or an index below {len(attributes)}, got {attribute!r}")
    if not entry["present"]:
        return FaceLabels.absent(attribute)
    try:
        box = np.asarray(entry["box"], dtype=np.float64).reshape(2, 2)
        marks = entry["landmarks"]
        if not isinstance(marks, list) or len(marks) != NUM_LANDMARKS:
            raise ValueError(f"landmarks: expected {NUM_LANDMARKS} entries ([x, y] or null)")
        visible = [m is not None for m in marks]
        points = [m if m is not None else [0.0, 0.0] for m in marks]
        return FaceLabels(True, box, points, visible, entry["head_pose"], attribute)
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{where}: {err}") from err


def read_faces(path: str | Path, count: int) -> tuple[list[FaceLabels | None], tuple[str, ...]]:
    """Read ``faces.json`` for a split of ``count`` records: (faces aligned with the records, attribute names)."""
    path = Path(path)
    try:
        payload = json.loads(path.read_text())
    except FileNotFoundError as err:
        raise FileNotFoundError(f"face annotations not found: {path}") from err
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot parse face annotations {path}: {err}") from err
    if not isinstance(payload, dict) or payload.get("format") != FACES_FORMAT:
        raise ValueError(f"{path} is not a {FACES_FORMAT} file")
    if payload.get("version") != FACES_VERSION:
        raise ValueError(f"{path}: version {payload.get('version')!r}, this reader knows {FACES_VERSION}")
    if payload.get("landmarks") != list(LANDMARK_NAMES):
        raise ValueError(f"{path}: landmarks must be {list(LANDMARK_NAMES)}, got {payload.get('landmarks')!r}")
    attributes = payload.get("attributes", [])
    if not isinstance(attributes, list) or not all(isinstance(a, str) and a for a in attributes):
        raise ValueError(f"{path}: attributes must be a list of names")
    faces = payload.get("faces")
    if not isinstance(faces, list) or len(faces) != count:
        found = len(faces) if isinstance(faces, list) else "no list of"
        raise ValueError(f"{path}: {found} faces for {count} records; the file must align with annotations.json")
    return [_parse_entry(e, attributes, f"{path}: faces[{i}]") for i, e in enumerate(faces)], tuple(attributes)


def interocular(landmarks: np.ndarray) -> np.ndarray:
    """(..., 5, 2) landmarks -> (...) distance between the eye centres (the NME normaliser)."""
    pts = np.asarray(landmarks, dtype=np.float64)
    return np.linalg.norm(pts[..., 0, :] - pts[..., 1, :], axis=-1)


def degrees_between(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Absolute angular difference in degrees, wrapped (359 and 1 are 2 apart)."""
    return np.abs(wrap_degrees(np.asarray(a, np.float64) - np.asarray(b, np.float64)))
