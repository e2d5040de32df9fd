"""Pure numpy pre- and post-processing around any runtime (top-down, one box per person).

preprocess: frame + person box -> affine crop at the model's input size, RGB
float32 in [0, 1], NCHW (normalisation is inside the model).
postprocess: SimCC logits -> keypoints in input pixels (``decode_simcc``) ->
mapped back through the inverse affine map to frame pixels.

Boxes are (x, y, w, h) in frame pixels. The crop uses the training
convention of ``fedpose.shared.data.transforms.affine_matrix`` (centre + scale, box
of side 200 * scale widened to the input's aspect ratio), so a box made by
``box_to_center_scale`` from a tight person box frames the person the way
training crops did (``fedpose.shared.data.synth.render.person_box``: 1.25 x the extent).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import cv2
import numpy as np

from fedpose.shared.data.records import PIXEL_STD
from fedpose.shared.data.transforms import affine_matrix, box_corners, invert_affine
from fedpose.shared.model.simcc_decode import decode_simcc

# Person box = this factor x the extent of the keypoints (the training crops' convention).
BOX_PADDING = 1.25


def box_to_center_scale(
    box: Sequence[float], input_size: Sequence[int], *, padding: float = 1.0
) -> tuple[np.ndarray, float]:
    """(x, y, w, h) box -> (center (2,) float64, scale) whose crop contains the padded box.

    The crop is the square box of side 200 * scale widened to the input's
    aspect ratio W / H (``affine_matrix``); the scale is the smallest one
    whose crop holds the box grown by ``padding`` in both directions.
    """
    x, y, w, h = (float(v) for v in box)
    if not (np.isfinite([x, y, w, h]).all() and w > 0 and h > 0):
        raise ValueError(f"box must be finite (x, y, w, h) with w, h > 0, got {tuple(box)}")
    if padding <= 0:
        raise ValueError(f"padding must be > 0, got {padding}")
    in_h, in_w = int(input_size[0]), int(input_size[1])
    aspect = in_w / in_h
    crop_w = max(w, h * aspect) * padding  # crop width needed; its height is crop_w / aspect
    side = crop_w / max(1.0, aspect)  # affine_matrix: crop_w = max(side, side * aspect)
    center = np.array([x + w / 2.0, y + h / 2.0], dtype=np.float64)
    return center, side / PIXEL_STD


def preprocess(
    frame: np.ndarray,
    boxes: np.ndarray | Sequence[Sequence[float]],
    input_size: Sequence[int],
    *,
    bgr: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Crop every box of a frame to the model input.

    Args:
        frame: (h, w, 3) uint8 image (BGR as OpenCV reads it unless ``bgr=False``)
            or (h, w) grayscale (replicated to 3 channels).
        boxes: (N, 4) float (x, y, w, h) person boxes in frame pixels.
        input_size: (H, W) of the model.

    Returns:
        batch (N, 3, H, W) float32 RGB in [0, 1], and matrices (N, 2, 3)
        float64 mapping frame pixels to input pixels (for ``postprocess``).
    """
    img = np.asarray(frame)
    if img.dtype != np.uint8 or img.ndim not in (2, 3) or (img.ndim == 3 and img.shape[2] not in (1, 3)):
        raise ValueError(f"frame must be (h, w[, 3]) uint8, got {img.shape} {img.dtype}")
    swap = bgr  # the crop's channels are swapped to RGB (as the model was trained), not the whole frame's
    if img.ndim == 2 or img.shape[2] == 1:
        img, swap = cv2.cvtColor(img.reshape(img.shape[0], img.shape[1]), cv2.COLOR_GRAY2BGR), False
    img = np.ascontiguousarray(img)
    boxes_arr = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    in_h, in_w = int(input_size[0]), int(input_size[1])
    batch = np.empty((len(boxes_arr), 3, in_h, in_w), dtype=np.float32)
    matrices = np.empty((len(boxes_arr), 2, 3), dtype=np.float64)
    for i, box in enumerate(boxes_arr):
        center, scale = box_to_center_scale(box, (in_h, in_w), padding=1.0)
        matrices[i] = affine_matrix(center, scale, (in_h, in_w))
        crop = cv2.warpAffine(
            img, matrices[i], (in_w, in_h), flags=cv2.INTER_LINEAR, borderMode=cv2.BORDER_CONSTANT, borderValue=0,
        )  # (H, W, 3) uint8, the frame's channel order
        # One pass: channels to RGB, HWC to CHW, / 255 (the same values as crop[..., ::-1].transpose(2, 0, 1) / 255).
        batch[i] = cv2.dnn.blobFromImage(crop, scalefactor=1.0 / 255.0, swapRB=swap)[0]
    return batch, matrices


def postprocess(
    simcc_x: np.ndarray,
    simcc_y: np.ndarray,
    matrices: np.ndarray,
    input_size: Sequence[int],
) -> tuple[np.ndarray, np.ndarray]:
    """SimCC logits -> keypoints in frame pixels and scores.

    Args:
        simcc_x: (N, K, W*s) x logits; simcc_y: (N, K, H*s) y logits.
        matrices: (N, 2, 3) frame -> input maps from ``preprocess``.
        input_size: (H, W); the split ratio s is bins / pixels.

    Returns:
        keypoints (N, K, 2) float32 (x, y) in frame pixels, scores (N, K)
        float32 in [0, 1] (``decode_simcc``'s peak probability).
    """
    in_h, in_w = int(input_size[0]), int(input_size[1])
    sx = simcc_x.shape[-1] / in_w
    sy = simcc_y.shape[-1] / in_h
    if not math.isclose(sx, sy, rel_tol=1e-3):
        raise ValueError(
            f"SimCC bins do not match the input size {in_h}x{in_w}: {simcc_x.shape[-1]} x bins, "
            f"{simcc_y.shape[-1]} y bins"
        )
    mats = np.asarray(matrices, dtype=np.float64).reshape(-1, 2, 3)
    if mats.shape[0] != simcc_x.shape[0]:
        raise ValueError(f"{mats.shape[0]} matrices for {simcc_x.shape[0]} predictions")
    kp_input, scores = decode_simcc(simcc_x, simcc_y, split_ratio=float(sx))  # (N, K, 2) input px
    out = np.empty_like(kp_input, dtype=np.float64)
    for i, m in enumerate(mats):
        inv = invert_affine(m)
        out[i] = kp_input[i] @ inv[:, :2].T + inv[:, 2]
    return out.astype(np.float32), scores


def face_to_frame(face: dict[str, np.ndarray], matrices: np.ndarray) -> list[dict[str, Any]]:
    """Decoded face outputs (``fedpose.shared.model.face_decode.decode_face``, input px) -> one JSON-ready dict per crop
    in frame pixels.

    Keys, as the model has the tasks: presence (probability), box [x1, y1, x2, y2] (the hull of the mapped
    box), landmarks 5 x [x, y, visibility probability] (right eye, left eye, nose, right and left mouth
    corner), head_pose [yaw, pitch, roll] degrees (the crop is not rotated, so the angles hold in the frame),
    attribute (class index) and attribute_probability.
    """
    mats = np.asarray(matrices, dtype=np.float64).reshape(-1, 2, 3)
    out: list[dict[str, Any]] = []
    for i, m in enumerate(mats):
        inv = invert_affine(m)
        to_frame = lambda pts: np.asarray(pts, np.float64) @ inv[:, :2].T + inv[:, 2]  # noqa: E731
        rec: dict[str, Any] = {}
        if "presence" in face:
            corners = to_frame(box_corners(face["box"][i]))
            rec["presence"] = round(float(face["presence"][i]), 4)
            rec["box"] = [round(float(v), 2) for v in (*corners.min(axis=0), *corners.max(axis=0))]
        if "landmarks" in face:
            pts = to_frame(face["landmarks"][i])
            rec["landmarks"] = [[round(float(x), 2), round(float(y), 2), round(float(v), 4)]
                                for (x, y), v in zip(pts, face["landmark_visibility"][i])]
        if "head_pose" in face:
            rec["head_pose"] = [round(float(v), 2) for v in face["head_pose"][i]]
        if "attribute" in face:
            rec["attribute"] = int(face["attribute"][i])
            rec["attribute_probability"] = [round(float(v), 4) for v in face["attribute_probability"][i]]
        out.append(rec)
    return out


def box_from_keypoints(
    keypoints: np.ndarray,
    scores: np.ndarray,
    *,
    threshold: float,
    min_points: int = 4,
    padding: float = BOX_PADDING,
) -> np.ndarray | None:
    """(K, 2) keypoints + (K,) scores -> padded square-ish (x, y, w, h) box, or None when lost.

    The box is the extent of the keypoints scoring >= ``threshold`` grown by
    ``padding`` about its centre and made square (side = the longer extent),
    matching how training boxes were drawn. Fewer than ``min_points``
    confident keypoints: None (the caller falls back to its ROI).
    """
    kp = np.asarray(keypoints, dtype=np.float64).reshape(-1, 2)
    sc = np.asarray(scores, dtype=np.float64).reshape(-1)
    keep = (sc >= threshold) & np.isfinite(kp).all(axis=1)
    if int(keep.sum()) < min_points:
        return None
    pts = kp[keep]
    lo, hi = pts.min(axis=0), pts.max(axis=0)
    side = float((hi - lo).max()) * padding
    if side <= 1.0:
        return None
    cx, cy = (lo + hi) / 2.0
    return np.array([cx - side / 2.0, cy - side / 2.0, side, side], dtype=np.float64)


def clip_box(box: np.ndarray, frame_size: Sequence[int], *, min_side: float = 8.0) -> np.ndarray:
    """Keep an (x, y, w, h) box's centre inside the (H, W) frame and its size within [min_side, 2 x frame]."""
    fh, fw = float(frame_size[0]), float(frame_size[1])
    x, y, w, h = (float(v) for v in box)
    w = float(np.clip(w, min_side, 2.0 * fw))
    h = float(np.clip(h, min_side, 2.0 * fh))
    cx = float(np.clip(x + w / 2.0, 0.0, fw))
    cy = float(np.clip(y + h / 2.0, 0.0, fh))
    return np.array([cx - w / 2.0, cy - h / 2.0, w, h], dtype=np.float64)
