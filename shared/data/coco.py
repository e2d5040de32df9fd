"""COCO keypoints reader, mapped to the 16 MPII joints for public pretraining.

COCO-17 order: 0 nose, 1 l_eye, 2 r_eye, 3 l_ear, 4 r_ear, 5 l_shoulder,
6 r_shoulder, 7 l_elbow, 8 r_elbow, 9 l_wrist, 10 r_wrist, 11 l_hip,
12 r_hip, 13 l_knee, 14 r_knee, 15 l_ankle, 16 r_ankle.

Limbs map one to one. MPII's four trunk/head joints do not exist in COCO:
- pelvis = midpoint of the hips, thorax = midpoint of the shoulders, each
  only when both ends are labelled;
- upper_neck and head_top are an APPROXIMATION from the face points: with
  h = mean of the labelled ears (both), else of the labelled nose/eyes/ears,
  and d = h - thorax, head_top = thorax + 1.6 d (thorax-to-ear is about 0.11
  body heights, ear to crown about 0.065 in standard anthropometry,
  1 + 0.065 / 0.11 ~ 1.6) and upper_neck = thorax + 0.16 d (MPII annotators
  put the upper neck about a tenth of the way from thorax to head top). This
  ignores head tilt relative to the neck, so head_top can be off by a few
  percent of the head size; both are left invisible unless the thorax and at
  least one face point are labelled. Do not evaluate PCKh head accuracy on
  COCO-derived records.

COCO visibility v=1 (labelled, occluded) and v=2 both count as annotated, like
MPII's ``joints_vis``. The box is the COCO bbox (x, y, w, h) centre, side
max(w, h) * 1.25, as mmpose's ``bbox_xywh2cs`` with padding 1.25.
"""

from __future__ import annotations

import contextlib
import math
import io
import logging
from pathlib import Path

import numpy as np

from fedpose.shared.data.joints import JOINT_NAMES, NUM_JOINTS
from fedpose.shared.data.image_files import image_path, image_size
from fedpose.shared.data.records import PIXEL_STD, PoseRecord, sanitize_joints

log = logging.getLogger(__name__)

BBOX_PADDING = 1.25
NECK_FRACTION = 0.16
HEAD_TOP_FRACTION = 1.6

# MPII joint name -> COCO keypoint index, for joints present in both.
COCO_DIRECT: dict[str, int] = {
    "r_ankle": 16,
    "r_knee": 14,
    "r_hip": 12,
    "l_hip": 11,
    "l_knee": 13,
    "l_ankle": 15,
    "r_wrist": 10,
    "r_elbow": 8,
    "r_shoulder": 6,
    "l_shoulder": 5,
    "l_elbow": 7,
    "l_wrist": 9,
}
_FACE = (0, 1, 2, 3, 4)
_EARS = (3, 4)


def coco_to_mpii(keypoints: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(17, 3) COCO (x, y, v) -> (16, 2) MPII joints and (16,) bool annotated flags.

    See the module docstring for the derived trunk and head joints.
    """
    kp = np.asarray(keypoints, dtype=np.float64)
    if kp.shape != (17, 3):
        raise ValueError(f"COCO keypoints must have shape (17, 3), got {kp.shape}")
    xy, labelled = kp[:, :2], kp[:, 2] > 0
    joints = np.zeros((NUM_JOINTS, 2))
    vis = np.zeros(NUM_JOINTS, dtype=bool)
    index = {name: i for i, name in enumerate(JOINT_NAMES)}
    for name, k in COCO_DIRECT.items():
        if labelled[k]:
            joints[index[name]], vis[index[name]] = xy[k], True

    def midpoint(a: int, b: int) -> np.ndarray | None:
        return (xy[a] + xy[b]) / 2.0 if labelled[a] and labelled[b] else None

    pelvis, thorax = midpoint(11, 12), midpoint(5, 6)
    if pelvis is not None:
        joints[index["pelvis"]], vis[index["pelvis"]] = pelvis, True
    if thorax is not None:
        joints[index["thorax"]], vis[index["thorax"]] = thorax, True
        face = list(_EARS) if labelled[list(_EARS)].all() else [k for k in _FACE if labelled[k]]
        if face:
            d = xy[face].mean(axis=0) - thorax
            joints[index["upper_neck"]], vis[index["upper_neck"]] = thorax + NECK_FRACTION * d, True
            joints[index["head_top"]], vis[index["head_top"]] = thorax + HEAD_TOP_FRACTION * d, True
    return joints, vis


def bbox_to_box(bbox: np.ndarray) -> tuple[np.ndarray, float]:
    """COCO bbox (x, y, w, h) -> (center (2,), scale) of a padded square box."""
    x, y, w, h = (float(v) for v in bbox)
    center = np.array([x + w / 2.0, y + h / 2.0])
    return center, max(w, h) * BBOX_PADDING / PIXEL_STD


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _read_coco_json(ann_path: Path) -> dict:
    """The annotation json, structurally checked (pycocotools assumes a well-formed file)."""
    import json

    try:
        data = json.loads(ann_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise ValueError(f"cannot parse COCO annotation file {ann_path}: {err}") from err
    if not isinstance(data, dict):
        raise ValueError(f"{ann_path}: expected a COCO json object, got {type(data).__name__}")
    images, anns = data.get("images", []), data.get("annotations", [])
    if not isinstance(images, list) or not isinstance(anns, list):
        raise ValueError(f"{ann_path}: 'images' and 'annotations' must be lists")
    ids = set()
    for i, img in enumerate(images):
        if not isinstance(img, dict) or not isinstance(img.get("id"), int) or isinstance(img.get("id"), bool):
            raise ValueError(f"{ann_path}: images[{i}] must be an object with an integer id")
        if img["id"] in ids:
            raise ValueError(f"{ann_path}: images[{i}]: image id {img['id']} occurs twice")
        ids.add(img["id"])
        for key in ("height", "width"):
            if key in img and (not isinstance(img[key], int) or isinstance(img[key], bool) or img[key] < 1):
                raise ValueError(f"{ann_path}: images[{i}].{key} must be a positive integer, got {img[key]!r}")
    ann_ids = set()
    for i, ann in enumerate(anns):
        where = f"{ann_path}: annotations[{i}]"
        if not isinstance(ann, dict):
            raise ValueError(f"{where} must be an object")
        for key in ("id", "image_id"):
            if not isinstance(ann.get(key), int) or isinstance(ann.get(key), bool):
                raise ValueError(f"{where}.{key} must be an integer, got {ann.get(key)!r}")
        if ann["id"] in ann_ids:
            raise ValueError(f"{where}: annotation id {ann['id']} occurs twice")
        ann_ids.add(ann["id"])
        if ann["image_id"] not in ids:
            raise ValueError(f"{where}.image_id {ann['image_id']} names no image")
        if "category_id" in ann and (not isinstance(ann["category_id"], int) or isinstance(ann["category_id"], bool)):
            raise ValueError(f"{where}.category_id must be an integer")
        if ann.get("iscrowd", 0) not in (0, 1) or isinstance(ann.get("iscrowd", 0), bool):
            raise ValueError(f"{where}.iscrowd must be 0 or 1, got {ann.get('iscrowd')!r}")
        nk = ann.get("num_keypoints", 0)
        if not isinstance(nk, int) or isinstance(nk, bool) or not 0 <= nk <= 17:
            raise ValueError(f"{where}.num_keypoints must be an integer in [0, 17], got {nk!r}")
        bbox = ann.get("bbox")
        if not isinstance(bbox, list) or len(bbox) != 4 or not all(_number(v) for v in bbox) \
                or min(bbox[2:]) < 0:
            raise ValueError(f"{where}.bbox must be [x, y, w, h] finite numbers with w, h >= 0, got {bbox!r}")
        kps = ann.get("keypoints")
        if not isinstance(kps, list) or len(kps) != 51 or not all(_number(v) for v in kps):
            raise ValueError(f"{where}.keypoints must be 51 finite numbers (17 x (x, y, v))")
    cats = data.get("categories", [])
    if not isinstance(cats, list) or not all(isinstance(c, dict) and "id" in c for c in cats):
        raise ValueError(f"{ann_path}: 'categories' must be a list of objects with an id")
    return data


def load_coco(ann_file: str | Path, image_dir: str | Path) -> list[PoseRecord]:
    """Person keypoint annotations -> records in MPII-16 order.

    Crowd annotations, annotations with no labelled keypoints and boxes of
    zero size are skipped. Every referenced image must exist.
    """
    from pycocotools.coco import COCO

    ann_path = Path(ann_file)
    if not ann_path.is_file():
        raise FileNotFoundError(f"COCO annotation file not found: {ann_path}")
    root = Path(image_dir).resolve()
    dataset = _read_coco_json(ann_path)
    # pycocotools prints progress to stdout; keep library output in logging.
    with contextlib.redirect_stdout(io.StringIO()) as captured:
        coco = COCO()
        coco.dataset = dataset
        coco.createIndex()
    log.debug("pycocotools: %s", captured.getvalue().strip())

    records: list[PoseRecord] = []
    skipped = dropped = 0
    for image_id in sorted(coco.getImgIds()):
        info = coco.loadImgs(image_id)[0]
        anns = coco.loadAnns(coco.getAnnIds(imgIds=image_id, iscrowd=None))
        usable = [
            a for a in anns
            if not a.get("iscrowd", 0) and a.get("num_keypoints", 0) > 0 and min(a["bbox"][2:]) > 0
        ]
        skipped += len(anns) - len(usable)
        if not usable:
            continue
        path = image_path(root, info["file_name"], where=f"{ann_path}: image id {image_id}")
        size = image_size(path)  # also checks that the file exists and is readable
        if "height" in info and (info["height"], info["width"]) != size:
            raise ValueError(
                f"{path} is {size[1]}x{size[0]} but {ann_path} says {info['width']}x{info['height']}"
            )
        for ann in usable:
            joints, vis = coco_to_mpii(np.asarray(ann["keypoints"], dtype=np.float64).reshape(17, 3))
            clean, visible = sanitize_joints(joints, vis, size)
            dropped += int(vis.sum() - visible.sum())
            center, scale = bbox_to_box(np.asarray(ann["bbox"]))
            records.append(PoseRecord(path, center, scale, clean, visible, None))
    if dropped:
        log.info("%s: %d mapped joint(s) fell outside their image and are marked invisible", ann_path, dropped)
    log.info("loaded %d COCO person records from %s (skipped %d crowd/empty)", len(records), ann_path, skipped)
    return records
