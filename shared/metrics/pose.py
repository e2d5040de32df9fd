"""Pose metrics: PCKh for MPII-style data and OKS AP for COCO-style data.

PCKh follows the definition used by the MPII benchmark as implemented in
mmpose (``MpiiPCKAccuracy``) and the HRNet ``evaluate`` script, so numbers are
comparable with the paper's table:

- head size = ``SC_BIAS`` (0.6) * length of the head-box diagonal;
- a visible joint is correct when ``||pred - gt|| / head_size <= threshold``
  (``<=`` as in the official MPII / HRNet ``evaluate``; mmpose 1.x's
  ``keypoint_pck_accuracy`` uses ``<``, which only differs for errors lying
  exactly on the threshold);
- per-joint PCKh = correct / visible, over all people;
- a column (Shoulder, Elbow, ...) is the plain mean of its joints' PCKh,
  i.e. the mean of left and right, as mmpose reports it;
- Mean = sum over joints of PCKh_j * jnt_ratio_j, where jnt_ratio_j is joint
  j's share of all visible joints, pelvis and thorax (``PCKH_EXCLUDED``)
  left out. This equals (all correct joints) / (all visible joints) over the
  non-excluded joints, which is how it is computed here. Note that the upper
  neck is in the Mean although it has no column, exactly as in mmpose.

OKS AP uses pycocotools' COCOeval (``iouType='keypoints'``); its console
output is captured and sent to the log instead.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from fedpose.shared.data.joints import NUM_JOINTS, PCKH_EXCLUDED, PCKH_GROUPS

log = logging.getLogger(__name__)

# MPII head size = SC_BIAS * head-box diagonal (MPII evaluation code, mmpose, HRNet).
SC_BIAS = 0.6

# Keys of a PCKh result, in the order of the paper's table.
PCKH_KEYS: tuple[str, ...] = (*PCKH_GROUPS.keys(), "mean")

# Keys of an OKS result -> index in COCOeval.stats for iouType='keypoints'.
_OKS_STATS: dict[str, int] = {"AP": 0, "AP50": 1, "AP75": 2, "APm": 3, "APl": 4, "AR": 5}


# ----------------------------------------------------------------------------- PCKh


def _check_pckh_inputs(
    pred: np.ndarray, gt: np.ndarray, visible: np.ndarray, headboxes: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Validate shapes/values and return float64 / bool copies."""
    pred = np.asarray(pred, dtype=np.float64)
    gt = np.asarray(gt, dtype=np.float64)
    vis = np.asarray(visible)
    boxes = np.asarray(headboxes, dtype=np.float64)

    if gt.ndim != 3 or gt.shape[1:] != (NUM_JOINTS, 2):
        raise ValueError(f"gt must have shape (N, {NUM_JOINTS}, 2), got {gt.shape}")
    n = gt.shape[0]
    if n == 0:
        raise ValueError("PCKh needs at least one person: gt, pred, visible and headboxes are empty")
    if pred.shape != gt.shape:
        raise ValueError(f"pred shape {pred.shape} does not match gt shape {gt.shape}")
    if vis.shape != (n, NUM_JOINTS):
        raise ValueError(f"visible must have shape ({n}, {NUM_JOINTS}) to match gt, got {vis.shape}")
    if boxes.shape != (n, 2, 2):
        raise ValueError(
            f"headboxes must have shape ({n}, 2, 2) ([[x1, y1], [x2, y2]] per person), got {boxes.shape}"
        )
    if vis.dtype != np.bool_:
        if not np.isin(vis, (0, 1)).all():
            raise ValueError("visible must be boolean (or 0/1); found other values")
        vis = vis.astype(bool)

    if not np.isfinite(boxes).all():
        raise ValueError("headboxes contain non-finite values")
    diag = np.linalg.norm(boxes[:, 1, :] - boxes[:, 0, :], axis=1)  # (N,)
    bad = np.flatnonzero(diag <= 0)
    if bad.size:
        raise ValueError(
            f"headboxes of zero size for person index(es) {bad[:10].tolist()}: "
            "give each person a head box with two distinct corners"
        )
    for name, arr in (("gt", gt), ("pred", pred)):
        nonfinite = ~np.isfinite(arr).all(axis=2) & vis
        if nonfinite.any():
            i, j = np.argwhere(nonfinite)[0]
            raise ValueError(f"{name} has a non-finite coordinate at visible joint (person {i}, joint {j})")
    return pred, gt, vis, boxes


def pckh(
    pred: np.ndarray,
    gt: np.ndarray,
    visible: np.ndarray,
    headboxes: np.ndarray,
    *,
    threshold: float = 0.5,
) -> dict[str, float]:
    """PCKh in percent (0..100) per paper column plus the weighted Mean.

    Args:
        pred: (N, 16, 2) predicted (x, y) in image pixels, MPII joint order.
        gt: (N, 16, 2) ground-truth (x, y) in the same pixel frame.
        visible: (N, 16) bool, True where the ground-truth joint is annotated
            (MPII ``1 - jnt_missing``); invisible joints count nowhere.
        headboxes: (N, 2, 2) head box corners [[x1, y1], [x2, y2]].
        threshold: fraction of the head size (0.5 for PCKh@0.5).

    Coordinates are 0-based on BOTH sides. mmpose adds 1 to the predictions
    because the official MPII ground truth is 1-based (MATLAB); here pred
    and gt must already be in the same frame, so no shift is applied.

    Returns:
        {"head", "shoulder", "elbow", "wrist", "hip", "knee", "ankle", "mean"}
        as floats. A joint with no visible instance has no PCKh: its column
        uses the other joint of the group, or is NaN if the whole group is
        unseen; it has zero weight in the Mean (as with mmpose's jnt_ratio).

    Raises:
        ValueError: mismatched shapes, empty input, zero-size head boxes,
            non-finite coordinates at visible joints, no visible joint at all.
    """
    if not (isinstance(threshold, (int, float)) and math.isfinite(threshold) and threshold > 0):
        raise ValueError(f"threshold must be a positive finite float, got {threshold!r}")
    pred, gt, vis, boxes = _check_pckh_inputs(pred, gt, visible, headboxes)

    head_size = SC_BIAS * np.linalg.norm(boxes[:, 1, :] - boxes[:, 0, :], axis=1)  # (N,)
    with np.errstate(invalid="ignore"):
        scaled_err = np.linalg.norm(pred - gt, axis=2) / head_size[:, None]  # (N, 16)
    correct = (scaled_err <= threshold) & vis  # (N, 16)
    count = vis.sum(axis=0)  # (16,) visible instances per joint
    hits = correct.sum(axis=0)  # (16,)

    included = np.ones(NUM_JOINTS, dtype=bool)
    included[list(PCKH_EXCLUDED)] = False
    total = int(count[included].sum())
    if total == 0:
        raise ValueError("no visible joint outside pelvis/thorax: PCKh is undefined")

    per_joint = np.full(NUM_JOINTS, np.nan)
    seen = count > 0
    per_joint[seen] = 100.0 * hits[seen] / count[seen]

    result: dict[str, float] = {}
    for name, joints in PCKH_GROUPS.items():
        values = per_joint[list(joints)]
        values = values[~np.isnan(values)]
        result[name] = float(values.mean()) if values.size else float("nan")
    # sum_j PCKh_j * count_j / sum_j count_j == sum_j hits_j / sum_j count_j
    result["mean"] = float(100.0 * hits[included].sum() / total)
    return result


def pckh_report(
    pred: np.ndarray, gt: np.ndarray, visible: np.ndarray, headboxes: np.ndarray
) -> dict[str, dict[str, float]]:
    """PCKh@0.5 (the paper's table) and PCKh@0.1 (fine localisation), same keys in both."""
    return {
        "pckh": pckh(pred, gt, visible, headboxes, threshold=0.5),
        "pckh@0.1": pckh(pred, gt, visible, headboxes, threshold=0.1),
    }


def pckh_table(results: Mapping[str, Mapping[str, float]]) -> str:
    """Readable text table of PCKh results, one row per entry, the paper's columns.

    ``results`` maps a row label (method, site, ...) to a dict from ``pckh``.
    NaN cells (joint group never visible) print as ``-``.
    """
    if not results:
        raise ValueError("pckh_table needs at least one result row")
    headers = [k.capitalize() for k in PCKH_KEYS]
    label_w = max(len("Method"), *(len(str(k)) for k in results))
    col_w = max(8, *(len(h) for h in headers)) + 1  # +1: a space between columns
    lines = ["Method".ljust(label_w) + "".join(h.rjust(col_w) for h in headers)]
    lines.append("-" * len(lines[0]))
    for label, row in results.items():
        missing = [k for k in PCKH_KEYS if k not in row]
        if missing:
            raise ValueError(f"result row {label!r} lacks keys {missing}; pass dicts returned by pckh()")
        cells = []
        for k in PCKH_KEYS:
            v = float(row[k])
            cells.append(("-" if math.isnan(v) else f"{v:.2f}").rjust(col_w))
        lines.append(str(label).ljust(label_w) + "".join(cells))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- OKS AP


def _load_coco_json(gt_json_path: str | Path) -> dict:
    path = Path(gt_json_path)
    if not path.is_file():
        raise FileNotFoundError(f"COCO ground-truth json not found: {path}")
    with path.open() as f:
        return json.load(f)


def gt_as_detections(gt_json_path: str | Path) -> list[dict]:
    """Turn the ground truth into perfect detections (score 1), for tests.

    Crowd annotations and people without any labelled keypoint are skipped:
    COCOeval ignores them as ground truth, so a detection for them could
    only be a false positive.
    """
    data = _load_coco_json(gt_json_path)
    dets = []
    for ann in data.get("annotations", []):
        if ann.get("iscrowd", 0) or ann.get("num_keypoints", 0) <= 0:
            continue
        dets.append(
            {
                "image_id": ann["image_id"],
                "category_id": ann["category_id"],
                "keypoints": [float(v) for v in ann["keypoints"]],
                "score": 1.0,
            }
        )
    return dets


def _clean_detections(detections: Sequence[dict], image_ids: set, num_kpts: dict[int, int]) -> list[dict]:
    """Validate detections and copy them (COCO.loadRes mutates its input)."""
    if len(detections) == 0:
        raise ValueError("detections is empty: pass at least one detection (COCOeval cannot load none)")
    out = []
    for i, det in enumerate(detections):
        try:
            image_id, cat, kpts, score = det["image_id"], det["category_id"], det["keypoints"], det["score"]
        except (KeyError, TypeError) as err:
            raise ValueError(
                f"detection {i} must be a dict with image_id, category_id, keypoints, score"
            ) from err
        if image_id not in image_ids:
            raise ValueError(f"detection {i} has image_id {image_id!r} that is not in the ground truth")
        if cat not in num_kpts:
            raise ValueError(f"detection {i} has category_id {cat!r} that is not in the ground truth")
        kpts = [float(v) for v in kpts]
        if len(kpts) != 3 * num_kpts[cat]:
            raise ValueError(
                f"detection {i} has {len(kpts)} keypoint values, expected 3 * {num_kpts[cat]} (x, y, v)"
            )
        if not all(math.isfinite(v) for v in kpts) or not math.isfinite(float(score)):
            raise ValueError(f"detection {i} has non-finite keypoints or score")
        out.append({"image_id": image_id, "category_id": cat, "keypoints": kpts, "score": float(score)})
    return out


def oks_ap(gt_json_path: str | Path, detections: Sequence[dict]) -> dict[str, float]:
    """COCO keypoint AP/AR (OKS) of ``detections`` against a COCO json.

    Args:
        gt_json_path: COCO keypoints annotation file.
        detections: COCO result dicts {image_id, category_id, keypoints
            (3*17 floats: x, y, v), score}. They are copied, not modified.

    Returns:
        {"AP", "AP50", "AP75", "APm", "APl", "AR"} in [0, 1] from
        ``COCOeval(..., 'keypoints').stats``. COCOeval's -1 ("no ground truth
        in this area range") is returned as NaN so it cannot be averaged in
        by mistake.
    """
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    data = _load_coco_json(gt_json_path)
    image_ids = {img["id"] for img in data.get("images", [])}
    num_kpts = {c["id"]: len(c.get("keypoints", [])) for c in data.get("categories", [])}
    for cat, k in num_kpts.items():
        if k != 17:
            raise ValueError(
                f"category {cat} has {k} keypoints; COCOeval's OKS sigmas are for the 17 COCO keypoints"
            )
    dets = _clean_detections(detections, image_ids, num_kpts)

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        coco_gt = COCO(str(gt_json_path))
        coco_dt = coco_gt.loadRes(dets)
        evaluator = COCOeval(coco_gt, coco_dt, "keypoints")
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    log.info("COCOeval keypoints output:\n%s", buf.getvalue().rstrip())

    stats = evaluator.stats
    return {k: (float("nan") if stats[i] < 0 else float(stats[i])) for k, i in _OKS_STATS.items()}
