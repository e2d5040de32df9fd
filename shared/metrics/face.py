"""Metrics of the face tasks: the ones DPLH reports, and the field's usual ones beside them.

DPLH (after HyperFace) reports detection and gender accuracy and mean squared errors of the landmarks, their
visibility and the head pose. Its normalisation of those errors is not stated, so the MSEs here are defined
in units this project states (below) and are comparable between our runs, not with the paper's numbers. The
field's usual metrics come beside them: landmark NME by the inter-ocular distance, head-pose MAE in degrees,
and the face box's IoU.

All inputs are in the same frame (input-crop pixels here), one row per record; records without face labels
are left out; box, landmark and pose metrics count faces that are present only.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedpose.shared.data.face import degrees_between, interocular

ANGLES = ("yaw", "pitch", "roll")


def _mean(values: np.ndarray) -> float | None:
    return float(np.mean(values)) if values.size else None


def box_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(N, 4) x1, y1, x2, y2 boxes -> (N,) IoU of each pair."""
    lo, hi = np.maximum(a[:, :2], b[:, :2]), np.minimum(a[:, 2:], b[:, 2:])
    inter = np.prod(np.clip(hi - lo, 0, None), axis=1)
    area = lambda z: np.prod(np.clip(z[:, 2:] - z[:, :2], 0, None), axis=1)  # noqa: E731
    return inter / np.maximum(area(a) + area(b) - inter, 1e-12)


def face_report(pred: dict[str, np.ndarray], truth: dict[str, np.ndarray], *,
                input_size: tuple[int, int]) -> dict[str, Any]:
    """Metrics of the tasks ``pred`` holds (``face_head.decode_face``'s keys) against ``truth``.

    truth: labelled (N,) bool, present (N,) bool, box (N, 4), landmarks (N, 5, 2), visible (N, 5) bool,
    head_pose (N, 3) degrees, attribute (N,) int (-1 unknown).

    Units: landmark_mse is the squared error of a visible landmark in fractions of the input width / height
    (the training loss's unit); visibility_mse the squared error of the predicted probability; pose_mse the
    squared error of each angle in units of 90 degrees. ``count`` says how many faces each metric saw.
    """
    h, w = input_size
    scale = np.array([w, h], dtype=np.float64)
    lab = np.asarray(truth["labelled"], bool)
    present = lab & np.asarray(truth["present"], bool)
    out: dict[str, Any] = {"faces_labelled": int(lab.sum()), "faces_present": int(present.sum())}
    if "presence" in pred:
        guess = np.asarray(pred["presence"]) > 0.5
        out["detection_accuracy"] = _mean((guess == present)[lab])
        out["box_iou"] = _mean(box_iou(np.asarray(pred["box"])[present], np.asarray(truth["box"])[present]))
    if "landmarks" in pred:
        vis = np.asarray(truth["visible"], bool) & present[:, None]
        err = (np.asarray(pred["landmarks"]) - truth["landmarks"]) / scale  # (N, 5, 2) fractions
        out["landmark_mse"] = _mean((err**2).sum(-1)[vis])
        prob = np.asarray(pred["landmark_visibility"])
        out["visibility_mse"] = _mean(((prob - vis) ** 2)[present])
        out["visibility_accuracy"] = _mean(((prob > 0.5) == vis)[present])
        both_eyes = present & vis[:, 0] & vis[:, 1]
        iod = interocular(truth["landmarks"])
        usable = both_eyes & (iod > 1e-6)
        dist = np.linalg.norm(np.asarray(pred["landmarks"]) - truth["landmarks"], axis=-1)  # (N, 5) px
        per_face = (dist * vis).sum(1) / np.maximum(vis.sum(1), 1) / np.maximum(iod, 1e-6)
        out["nme_interocular"] = _mean(per_face[usable])
        out["nme_faces"] = int(usable.sum())
    if "head_pose" in pred:
        diff = degrees_between(pred["head_pose"], truth["head_pose"])[present]  # (P, 3)
        out["pose_mse"] = _mean((diff / 90.0) ** 2)
        out["pose_mae_degrees"] = {name: _mean(diff[:, i]) for i, name in enumerate(ANGLES)}
    if "attribute" in pred:
        known = lab & (np.asarray(truth["attribute"]) >= 0)
        out["attribute_accuracy"] = _mean((np.asarray(pred["attribute"]) == truth["attribute"])[known])
        out["attribute_count"] = int(known.sum())
    return out


def face_lines(report: dict[str, Any]) -> list[str]:
    """The face report as lines a person reads (``fedpose eval``)."""
    def fmt(v: float | None, spec: str) -> str:
        return "n/a" if v is None else format(v, spec)

    lines = [f"faces: {report['faces_present']} present of {report['faces_labelled']} labelled"]
    if "detection_accuracy" in report:
        lines.append(f"  detection accuracy {fmt(report['detection_accuracy'], '.3f')}, "
                     f"box IoU {fmt(report['box_iou'], '.3f')}")
    if "landmark_mse" in report:
        lines.append(f"  landmarks: NME (inter-ocular) {fmt(report['nme_interocular'], '.3f')} over "
                     f"{report['nme_faces']} faces, MSE {fmt(report['landmark_mse'], '.4f')}, visibility accuracy "
                     f"{fmt(report['visibility_accuracy'], '.3f')} (MSE {fmt(report['visibility_mse'], '.3f')})")
    if "pose_mse" in report:
        mae = report["pose_mae_degrees"]
        lines.append("  head pose MAE (degrees): " + ", ".join(f"{k} {fmt(mae[k], '.1f')}" for k in ANGLES)
                     + f"; MSE {fmt(report['pose_mse'], '.4f')}")
    if "attribute_accuracy" in report:
        lines.append(f"  attribute accuracy {fmt(report['attribute_accuracy'], '.3f')} "
                     f"({report['attribute_count']} known)")
    return lines
