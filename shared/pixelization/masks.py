"""Complex-region masks: from keypoints (body limbs and head) or from a file.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Literal

import numpy as np

from fedpose.shared.data.joints import NUM_JOINTS, SKELETON

log = logging.getLogger(__name__)


def body_mask_from_keypoints(
    shape: tuple[int, int],
    keypoints: np.ndarray,
    scores: np.ndarray | None = None,
    *,
    score_threshold: float = 0.3,
    margin: float | None = None,
    style: Literal["hull", "skeleton"] = "hull",
) -> np.ndarray:
    """Complex region around a person: (H, W) bool.

    Args:
        shape: (H, W) of the frame.
        keypoints: (K, 2) pixel (x, y); for ``style="skeleton"`` K must be 16
            (MPII order, bones from ``SKELETON``).
        scores: (K,) confidences, or None to use all finite keypoints.
        score_threshold: keypoints scoring below are ignored.
        margin: dilation radius in pixels; None = 10 % of the diagonal of the
            kept keypoints' bounding box, at least 4 px, so the whole limb
            (not just its joint centres) falls inside.
        style: "hull" = convex hull of the kept keypoints dilated by margin
            (covers the torso between the joints); "skeleton" = bones drawn
            with thickness 2 * margin + 1 and discs at the joints.

    Returns an all-False mask (uniform pixelization) when no keypoint is kept.
    """
    import cv2  # heavy optional dependency, only needed for masks

    if len(shape) != 2 or min(shape) < 1:
        raise ValueError(f"shape must be (H, W) with positive sizes, got {shape}")
    kpts = np.asarray(keypoints, dtype=np.float64)
    if kpts.ndim != 2 or kpts.shape[1] != 2:
        raise ValueError(f"keypoints must have shape (K, 2), got {kpts.shape}")
    keep = np.isfinite(kpts).all(axis=1)
    if scores is not None:
        sc = np.asarray(scores, dtype=np.float64)
        if sc.shape != (kpts.shape[0],):
            raise ValueError(f"scores must have shape ({kpts.shape[0]},), got {sc.shape}")
        keep &= sc >= score_threshold
    if style not in ("hull", "skeleton"):
        raise ValueError(f"style must be 'hull' or 'skeleton', got {style!r}")
    if style == "skeleton" and kpts.shape[0] != NUM_JOINTS:
        raise ValueError(f"style='skeleton' needs the {NUM_JOINTS} MPII joints, got {kpts.shape[0]} keypoints")

    out = np.zeros(tuple(int(v) for v in shape), dtype=np.uint8)
    if not keep.any():
        log.debug("body_mask_from_keypoints: no keypoint above %.2f, empty mask", score_threshold)
        return out.astype(bool)
    pts = kpts[keep]
    if margin is None:
        diag = float(np.linalg.norm(pts.max(axis=0) - pts.min(axis=0)))
        margin = max(4.0, 0.1 * diag)
    if not (math.isfinite(margin) and margin >= 0):
        raise ValueError(f"margin must be a finite number of pixels >= 0, got {margin}")
    radius = int(round(margin))
    ipts = np.rint(pts).astype(np.int32)  # (K', 2)

    if style == "hull":
        hull = cv2.convexHull(ipts.reshape(-1, 1, 2))
        cv2.fillConvexPoly(out, hull, 1)
        if radius > 0:
            # Stroking the hull outline with round caps = dilating the polygon by a disc.
            cv2.polylines(out, [hull], isClosed=True, color=1, thickness=2 * radius + 1)
    else:
        idx = np.rint(kpts).astype(np.int64)
        for a, bj in SKELETON:
            if keep[a] and keep[bj]:
                p0, p1 = (int(idx[a, 0]), int(idx[a, 1])), (int(idx[bj, 0]), int(idx[bj, 1]))
                cv2.line(out, p0, p1, 1, thickness=2 * radius + 1)
    for x, y in ipts:
        cv2.circle(out, (int(x), int(y)), radius, 1, thickness=-1)
    return out.astype(bool)


def load_mask(path: str | Path) -> np.ndarray:
    """Read a mask image (PNG): (H, W) bool, nonzero (in any channel) = complex."""
    import cv2

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"mask file not found: {p}")
    img = cv2.imread(str(p), cv2.IMREAD_UNCHANGED)
    if img is None:
        raise ValueError(f"cannot decode mask image {p}: write it as a PNG (nonzero = complex region)")
    if img.ndim == 3:
        return (img != 0).any(axis=2)
    return img != 0
