"""AFLW (Annotated Facial Landmarks in the Wild) to fedpose's layout: the face tasks on real faces.

AFLW ships its annotations as one SQLite database (``aflw.sqlite``) beside the image folders. The tables this
reader uses (the columns it reads):

- ``FaceImages`` (file_id, filepath, width, height): the image files, relative to the image root;
- ``Faces`` (face_id, file_id): one row per annotated face;
- ``FaceRect`` (face_id, x, y, w, h): the face box, pixels;
- ``FacePose`` (face_id, roll, pitch, yaw): the head pose, radians;
- ``FeatureCoords`` (face_id, feature_id, x, y) with ``FeatureCoordTypes`` (feature_id, descr): the 21
  landmarks by name (``LeftEyeCenter``, ``NoseCenter``, ``MouthLeftCorner`` ...), each present only where seen;
- ``FaceMetaData`` (face_id, sex): ``m`` / ``f`` (DPLH's gender head; here the attribute, names ``male``,
  ``female``).

Five of the 21 points are fedpose's landmarks (eye centres, nose centre, mouth corners). Which eye is the
person's right is decided from the image, not from the names: with both eyes seen, the eye on the image's left
after undoing the roll is the right eye (as for the ward). The names decide the rest (one eye or one mouth
corner seen); the reader checks on the faces with both eyes whether the names agree with the image and swaps
them for all faces if they mostly do not. The angles are converted to degrees; roll and yaw signs are checked
the same way against the eye line and the nose, and flipped if the file's convention is the mirror of ours
(``fedpose.shared.data.face``). What the reader found is logged and returned.

A face is a record of its own: the crop is centred on the face box at twice its side (head and shoulders);
it has no body joints (all invisible), so only the face losses and the joints' visibility train on it.
"""

from __future__ import annotations

import logging
import math
import sqlite3
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedpose.shared.data.face import FaceLabels, wrap_degrees
from fedpose.shared.data.joints import NUM_JOINTS
from fedpose.shared.data.records import PIXEL_STD, PoseRecord, inside, open_image

log = logging.getLogger(__name__)

ATTRIBUTES = ("male", "female")
_SEX = {"m": 0, "f": 1}
# fedpose's landmark order from AFLW's names: (right eye, left eye, nose, mouth right, mouth left), each name
# read as the person's own side (checked against the image, see the module docstring).
_NAMES = ("RightEyeCenter", "LeftEyeCenter", "NoseCenter", "MouthRightCorner", "MouthLeftCorner")
CROP_FACTOR = 2.0  # the crop's side in face-box sides


@dataclass(frozen=True)
class AflwReport:
    """What ``load_aflw`` read and decided."""

    faces: int
    skipped: int
    sides_swapped: bool
    roll_flipped: bool
    yaw_flipped: bool


def _rows(db: sqlite3.Connection, query: str) -> list[tuple]:
    try:
        return db.execute(query).fetchall()
    except sqlite3.Error as err:
        raise ValueError(f"not an AFLW database (query failed: {err}): {query.split('FROM')[1].split()[0]}") from err


def load_aflw(database: str | Path, images: str | Path) -> tuple[list[PoseRecord], AflwReport]:
    """Read ``aflw.sqlite`` and the images under ``images`` into records carrying face labels."""
    database, images = Path(database), Path(images)
    if not database.is_file():
        raise FileNotFoundError(f"AFLW database not found: {database}")
    if not images.is_dir():
        raise FileNotFoundError(f"AFLW image folder not found: {images}")
    with sqlite3.connect(f"file:{database}?mode=ro", uri=True) as db:
        faces = _rows(db, "SELECT f.face_id, i.filepath, r.x, r.y, r.w, r.h FROM Faces f "
                          "JOIN FaceImages i ON i.file_id = f.file_id JOIN FaceRect r ON r.face_id = f.face_id "
                          "ORDER BY f.face_id")
        poses = {r[0]: r[1:] for r in _rows(db, "SELECT face_id, roll, pitch, yaw FROM FacePose")}
        sexes = {r[0]: r[1] for r in _rows(db, "SELECT face_id, sex FROM FaceMetaData")}
        points: dict[int, dict[str, tuple[float, float]]] = {}
        for face_id, name, x, y in _rows(db, "SELECT c.face_id, t.descr, c.x, c.y FROM FeatureCoords c "
                                             "JOIN FeatureCoordTypes t ON t.feature_id = c.feature_id"):
            points.setdefault(face_id, {})[str(name)] = (float(x), float(y))
    raw, skipped = [], 0
    sizes: dict[Path, tuple[int, int]] = {}
    for face_id, filepath, x, y, w, h in faces:
        path = (images / str(filepath)).resolve()
        if not path.is_file() or face_id not in poses or not (w and h and w > 0 and h > 0):
            skipped += 1
            continue
        if path not in sizes:
            with open_image(path) as im:
                sizes[path] = (im.size[1], im.size[0])
        named = points.get(face_id, {})
        marks = np.array([named.get(n, (np.nan, np.nan)) for n in _NAMES], dtype=np.float64)  # (5, 2)
        roll, pitch, yaw = (math.degrees(float(v)) for v in poses[face_id])
        raw.append((path, float(x), float(y), float(w), float(h), marks, [yaw, pitch, roll], sexes.get(face_id)))
    if not raw:
        raise ValueError(f"{database}: no usable face (each needs its image under {images}, a box and a pose)")
    swap, flip_roll, flip_yaw = _conventions(raw)
    records = []
    for path, x, y, w, h, marks, (yaw, pitch, roll), sex in raw:
        if swap:
            marks = marks[[1, 0, 2, 4, 3]]
        roll, yaw = (-roll if flip_roll else roll), (-yaw if flip_yaw else yaw)
        seen = np.isfinite(marks).all(axis=1) & inside(np.nan_to_num(marks, nan=-1.0), sizes[path])
        face = FaceLabels(True, [[x, y], [x + w, y + h]], np.nan_to_num(marks), seen,
                          [float(wrap_degrees(a)) for a in (yaw, pitch, roll)], _SEX.get(str(sex), -1))
        side = max(w, h)
        records.append(PoseRecord(path, (x + w / 2.0, y + h / 2.0), side * CROP_FACTOR / PIXEL_STD,
                                  np.zeros((NUM_JOINTS, 2)), np.zeros(NUM_JOINTS, bool),
                                  headbox=[[x, y], [x + w, y + h]], face=face))
    report = AflwReport(len(records), skipped, swap, flip_roll, flip_yaw)
    log.info("AFLW %s: %d faces (%d skipped: image, box or pose missing); names read as %s sides; roll %s, yaw %s",
             database, report.faces, skipped, "the viewer's" if swap else "the person's own",
             "flipped" if flip_roll else "as stored", "flipped" if flip_yaw else "as stored")
    return records, report


def _conventions(raw: list) -> tuple[bool, bool, bool]:
    """(swap left and right names, flip roll, flip yaw), decided on the faces with both eyes and the nose seen.

    With the names as the person's sides, the right eye lies on the image's left once the roll is undone, the
    eye line's angle (right -> left eye) is the roll, and a face turned to the image's right (yaw > 0) has its
    nose right of the eyes' midpoint. Each decision is a majority over the faces that show it.
    """
    disagree = agree = roll_same = roll_opposite = yaw_same = yaw_opposite = 0
    for *_, marks, (yaw, _pitch, roll), _sex in raw:
        right, left, nose = marks[0], marks[1], marks[2]
        if not (np.isfinite(right).all() and np.isfinite(left).all()):
            continue
        d = left - right
        angle = math.degrees(math.atan2(d[1], d[0]))  # ~roll if the names are the person's sides, ~roll+180 if not
        names_ok = abs(float(wrap_degrees(angle - roll))) < 90 or abs(float(wrap_degrees(angle + roll))) < 90
        agree += names_ok
        disagree += not names_ok
        line = d if names_ok else -d
        eye_angle = math.degrees(math.atan2(line[1], line[0]))
        if abs(roll) > 5:
            same = abs(float(wrap_degrees(eye_angle - roll))) < abs(float(wrap_degrees(eye_angle + roll)))
            roll_same += same
            roll_opposite += not same
        if np.isfinite(nose).all() and abs(yaw) > 10:
            axis = line / max(float(np.linalg.norm(line)), 1e-9)  # towards the image's right for an upright face
            offset = float((nose - (left + right) / 2.0) @ axis)
            yaw_same += (offset > 0) == (yaw > 0)
            yaw_opposite += (offset > 0) != (yaw > 0)
    return disagree > agree, roll_opposite > roll_same, yaw_opposite > yaw_same

