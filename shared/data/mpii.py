"""Reader for the MPII json layout (HRNet / mmpose), used for real MPII and the synthetic ward.

File convention (that of HRNet's ``mpii.py`` and mmpose's ``MpiiDataset``):
coordinates are MATLAB 1-based, ``scale`` is roughly person height / 200 and
``center`` sits near the person's middle. Like both codebases the reader
moves the centre down by 15 * scale px, enlarges the box by 1.25 so limbs
are not cut off, and subtracts 1 from every coordinate. A ``PoseRecord``
therefore holds 0-based pixels and a box (side 200 * record.scale) that
already includes that margin. The synthetic generator writes the inverse,
so the same numbers come back out.

A json entry looks like::

    {"image": "005808361.jpg", "center": [966.0, 340.0], "scale": 4.72,
     "joints": [[x, y]] * 16, "joints_vis": [0 or 1] * 16}

``joints_vis`` = 1 means annotated (possibly occluded); unannotated joints
are (-1, -1) with 0.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fedpose.shared.data.face import FACES_FILE, read_faces
from fedpose.shared.data.image_files import image_path, image_size
from fedpose.shared.data.joints import NUM_JOINTS
from fedpose.shared.data.patients import patient_sidecar, read_patient_ids
from fedpose.shared.data.records import PoseRecord, sanitize_joints

log = logging.getLogger(__name__)

# HRNet/mmpose MPII adjustments (see module docstring).
BOX_ENLARGE = 1.25
CENTER_SHIFT = 15.0  # px per unit of json scale, applied to y
MATLAB_OFFSET = 1.0


def json_to_box(center: Sequence[float], scale: float) -> tuple[np.ndarray, float]:
    """MPII json (center, scale) -> 0-based record (center, scale) with the 1.25 margin."""
    c = np.asarray(center, dtype=np.float64).copy()
    s = float(scale)
    if c[0] != -1:
        c[1] += CENTER_SHIFT * s
        s *= BOX_ENLARGE
    return c - MATLAB_OFFSET, s


def box_to_json(center: Sequence[float], scale: float) -> tuple[list[float], float]:
    """Inverse of ``json_to_box``: record box -> MPII json numbers (for writers)."""
    c = np.asarray(center, dtype=np.float64) + MATLAB_OFFSET
    s = float(scale) / BOX_ENLARGE
    c[1] -= CENTER_SHIFT * s
    return [float(c[0]), float(c[1])], s


def _load_headboxes(headboxes: str | Path, count: int) -> list[np.ndarray | None]:
    """Head boxes aligned with the annotations, 0-based [[x1, y1], [x2, y2]] each."""
    path = Path(headboxes)
    if not path.is_file():
        raise FileNotFoundError(f"head box file not found: {path}")
    if path.suffix == ".mat":
        from scipy.io import loadmat

        try:
            mat = loadmat(str(path))
        except (OSError, ValueError) as err:
            raise OSError(f"cannot read head box file {path}: {err}") from err
        if "headboxes_src" not in mat:
            raise ValueError(f"{path} has no 'headboxes_src' (expected the official mpii_gt_val.mat)")
        src = np.asarray(mat["headboxes_src"], dtype=np.float64)  # (2 corners, 2 coords, N)
        if src.ndim != 3 or src.shape[:2] != (2, 2):
            raise ValueError(f"{path}: headboxes_src must have shape (2, 2, N), got {src.shape}")
        boxes: list[np.ndarray | None] = [src[:, :, i] - MATLAB_OFFSET for i in range(src.shape[2])]
    elif path.suffix == ".json":
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"cannot parse head box file {path}: {err}") from err
        if not isinstance(raw, list):
            raise ValueError(f"{path}: expected a list of [[x1, y1], [x2, y2]] (or null), got {type(raw).__name__}")
        boxes = []
        for i, box in enumerate(raw):
            if box is None:
                boxes.append(None)
                continue
            try:
                arr = np.asarray(box, dtype=np.float64)
            except (TypeError, ValueError) as err:
                raise ValueError(f"{path}: head box {i} must be [[x1, y1], [x2, y2]], got {box!r}") from err
            if arr.shape != (2, 2) or not np.all(np.isfinite(arr)):
                raise ValueError(f"{path}: head box {i} must be [[x1, y1], [x2, y2]], got {box!r}")
            if not (arr[1, 0] > arr[0, 0] and arr[1, 1] > arr[0, 1]):
                raise ValueError(f"{path}: head box {i} has zero or negative area (need x2 > x1, y2 > y1), "
                                 f"got {box!r}")
            boxes.append(arr - MATLAB_OFFSET)
    else:
        raise ValueError(f"head boxes must be a .json sidecar or the official .mat file, got {path}")
    if len(boxes) != count:
        raise ValueError(
            f"{path} holds {len(boxes)} head boxes but the annotation file has {count} entries; "
            "they must be aligned one to one (use the head boxes that belong to this annotation file)"
        )
    return boxes


def load_mpii(
    ann_file: str | Path,
    image_dir: str | Path,
    *,
    headboxes: str | Path | None = None,
    patients: str | Path | None = None,
    faces: str | Path | None = None,
) -> list[PoseRecord]:
    """Read an MPII-layout annotation json into records (0-based pixels).

    Args:
        ann_file: the json list described in the module docstring.
        image_dir: directory the ``image`` names are relative to.
        headboxes: None, our ``headboxes.json`` sidecar, or the official
            ``mpii_gt_val.mat`` (its ``headboxes_src`` (2, 2, N) is aligned
            with the val json order). The count must match the annotations.
        patients: None, or a sidecar json list with one patient id per annotation
            (``fedpose.shared.data.patients``); the count must match the annotations.
        faces: None, or a ``faces.json`` sidecar (``fedpose.shared.data.face``) aligned with the annotations.

    Every image must exist (checked here, so a training run does not die
    hours later); its header is read to drop joints outside the image.
    """
    ann_path = Path(ann_file)
    root = Path(image_dir).resolve()
    try:
        entries = json.loads(ann_path.read_text(encoding="utf-8"))
    except FileNotFoundError as err:
        raise FileNotFoundError(f"annotation file not found: {ann_path}") from err
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise ValueError(f"cannot parse MPII annotation file {ann_path}: {err}") from err
    if not isinstance(entries, list):
        raise ValueError(f"{ann_path}: expected a json list of annotations, got {type(entries).__name__}")
    boxes = _load_headboxes(headboxes, len(entries)) if headboxes is not None else [None] * len(entries)
    ids = read_patient_ids(patients, len(entries)) if patients is not None else [None] * len(entries)
    face_labels = read_faces(faces, len(entries))[0] if faces is not None else [None] * len(entries)

    records: list[PoseRecord] = []
    sizes: dict[Path, tuple[int, int]] = {}
    dropped = 0
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ValueError(f"{ann_path}: entry {i} must be a json object, got {type(entry).__name__}")
        path = image_path(root, entry.get("image"), where=f"{ann_path}: entry {i}")
        name = entry["image"]
        scale = entry.get("scale")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise ValueError(f"{ann_path}: entry {i} ({name}): scale must be a number, got {scale!r}")
        try:
            joints = np.asarray(entry["joints"], dtype=np.float64) - MATLAB_OFFSET
            vis = np.asarray(entry["joints_vis"], dtype=np.float64)
            center, scale = json_to_box(entry["center"], entry["scale"])
        except (KeyError, TypeError, ValueError, IndexError) as err:
            raise ValueError(f"{ann_path}: entry {i} is not a valid MPII annotation: {err}") from err
        if joints.shape != (NUM_JOINTS, 2) or vis.shape != (NUM_JOINTS,):
            raise ValueError(
                f"{ann_path}: entry {i} ({name}) must have {NUM_JOINTS} joints and joints_vis, "
                f"got {joints.shape} and {vis.shape}"
            )
        if path not in sizes:
            sizes[path] = image_size(path)
        clean, visible = sanitize_joints(joints, vis > 0, sizes[path])
        dropped += int((vis > 0).sum() - visible.sum())
        try:
            records.append(PoseRecord(path, center, scale, clean, visible, boxes[i], patient=ids[i],
                                       face=face_labels[i]))
        except ValueError as err:
            raise ValueError(f"{ann_path}: entry {i} ({name}): {err}") from err
    if dropped:
        log.info("%s: %d annotated joint(s) were non-finite or outside their image and are marked invisible",
                 ann_path, dropped)
    log.info("loaded %d MPII-layout records from %s", len(records), ann_path)
    return records


def prediction_rows(
    records: Sequence[PoseRecord], keypoints: np.ndarray, scores: np.ndarray, image_dir: str | Path
) -> list[dict]:
    """Predictions in the annotation file's own convention, one row per record in annotation order.

    ``image`` is the name relative to ``image_dir`` (as in annotations.json) and
    ``joints`` (16 x 2) are MPII's MATLAB 1-based pixel coordinates, like the
    annotations' ``joints``: a prediction can be compared with its annotation
    number for number. ``scores`` (16) are the model's confidences in [0, 1].
    """
    root = Path(image_dir).resolve()
    rows = []
    for record, kp, sc in zip(records, np.asarray(keypoints, dtype=np.float64), np.asarray(scores)):
        try:
            name = record.image.relative_to(root).as_posix()
        except ValueError:
            name = record.image.name
        rows.append({"image": name, "joints": (kp + MATLAB_OFFSET).round(2).tolist(),
                     "scores": np.asarray(sc, dtype=np.float64).round(4).tolist()})
    return rows


def load_split(root: str | Path, split: str) -> list[PoseRecord]:
    """Records of one split of our layout: ``<root>/<split>/{annotations,headboxes}.json, images/``.

    Patient ids come from the split's sidecar when it has one (``patients.json``, or the synthetic
    ward's ``identities.json``: ``fedpose.shared.data.patients.patient_sidecar``); MPII has none.
    """
    split_dir = Path(root) / split
    ann = split_dir / "annotations.json"
    if not ann.is_file():
        available = sorted(p.name for p in Path(root).iterdir() if (p / "annotations.json").is_file()) \
            if Path(root).is_dir() else []
        raise FileNotFoundError(f"no split {split!r} under {root} (missing {ann}); available: {available}")
    heads = split_dir / "headboxes.json"
    faces = split_dir / FACES_FILE
    return load_mpii(ann, split_dir / "images", headboxes=heads if heads.is_file() else None,
                     patients=patient_sidecar(split_dir), faces=faces if faces.is_file() else None)
