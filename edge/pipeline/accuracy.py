"""Accuracy of a run against ground truth (a demo clip's sidecar): PCK@0.2 of the person's height.

The reference length is the longer side of the box around the person's true joints in that frame (the
height of a standing person; a bending or lying person is not judged by a shrunken height). A visible joint
is correct when its predicted position lies within 0.2 of that length. The same measure on the validation
split's crops tells what the model itself can do; a run far below it has a box problem, not a model one.
"""

from __future__ import annotations

from typing import Any

import numpy as np

PCK_THRESHOLD = 0.2


def pck_against_truth(
    keypoints: np.ndarray, truth_joints: np.ndarray, visible: np.ndarray, *, threshold: float = PCK_THRESHOLD
) -> dict[str, Any]:
    """PCK and errors of (F, K, 2) predicted keypoints against (F', K, 2) true joints (F' >= F) with (F', K)
    visibility. Returns frames, joints counted, pck@0.2, median and 90th percentile error in pixels."""
    pred = np.asarray(keypoints, dtype=np.float64)
    n = len(pred)
    gt = np.asarray(truth_joints, dtype=np.float64)
    vis = np.asarray(visible, dtype=bool)
    if n == 0:
        raise ValueError("no frame to score")
    if gt.shape[0] < n or gt.shape[1:] != pred.shape[1:] or vis.shape != gt.shape[:2]:
        raise ValueError(f"ground truth {gt.shape} (visible {vis.shape}) does not cover the run's {pred.shape}")
    gt, vis = gt[:n], vis[:n]
    ref = np.ptp(gt, axis=1).max(axis=1)  # (F,) the person's height (longer side of the joint box)
    err = np.linalg.norm(pred - gt, axis=-1)  # (F, K) px
    ok = vis & (ref[:, None] > 0)
    if not ok.any():
        raise ValueError("the ground truth has no visible joint in the frames run")
    return {
        "frames": n,
        "joints": int(ok.sum()),
        f"pck@{threshold:g}": round(float((err <= threshold * ref[:, None])[ok].mean()), 4),
        "median_error_px": round(float(np.median(err[ok])), 2),
        "p90_error_px": round(float(np.percentile(err[ok], 90)), 2),
        "median_height_px": round(float(np.median(ref)), 1),
    }
