"""Top-down affine crop and flip (HRNet / mmpose convention).

A person box of side ``200 * scale`` centred at ``center`` is mapped onto the
network input of (H, W) pixels. The box is first widened or heightened to
the input's aspect ratio W / H, never shrunk, so the whole box stays in view
(mmpose's ``fix_aspect_ratio``). The box centre goes to (W / 2, H / 2).
Rotation is in degrees; positive turns the image content counter-clockwise
in the output, as in HRNet's ``get_affine_transform``. The random scale,
rotation and flip of training are drawn in ``fedpose.shared.data.augment``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import cv2
import numpy as np

from fedpose.shared.data.face import LANDMARK_FLIP, NUM_LANDMARKS, FaceLabels, wrap_degrees
from fedpose.shared.data.joints import NUM_JOINTS, flip_permutation
from fedpose.shared.data.records import PIXEL_STD, PoseRecord, inside


def _check_size(output_size: Sequence[int]) -> tuple[int, int]:
    if len(output_size) != 2 or min(output_size) < 1:
        raise ValueError(f"output_size must be (H, W) with positive entries, got {tuple(output_size)}")
    return int(output_size[0]), int(output_size[1])


def affine_matrix(
    center: Sequence[float] | np.ndarray,
    scale: float,
    output_size: Sequence[int],
    *,
    rotation: float = 0.0,
    pixel_std: float = PIXEL_STD,
) -> np.ndarray:
    """(2, 3) float64 matrix mapping original-image pixels to output pixels.

    Args:
        center: (2,) box centre in the original image.
        scale: box side / pixel_std.
        output_size: (H, W) of the output.
        rotation: degrees, positive = content turns counter-clockwise.
    """
    height, width = _check_size(output_size)
    cx, cy = (float(v) for v in np.asarray(center, dtype=np.float64).reshape(2))
    side = float(scale) * float(pixel_std)
    if not math.isfinite(side) or side <= 0:
        raise ValueError(f"scale * pixel_std must be finite and > 0, got scale={scale}, pixel_std={pixel_std}")
    # Box width/height with the output's aspect, containing the square box.
    box_w = max(side, side * width / height)
    zoom = width / box_w  # == height / box_h
    theta = math.radians(float(rotation))
    cos, sin = math.cos(theta) * zoom, math.sin(theta) * zoom
    # y points down: [[cos, sin], [-sin, cos]] turns content counter-clockwise on screen.
    linear = np.array([[cos, sin], [-sin, cos]], dtype=np.float64)
    shift = np.array([width / 2.0, height / 2.0]) - linear @ np.array([cx, cy])
    return np.hstack([linear, shift[:, None]])


def invert_affine(matrix: np.ndarray) -> np.ndarray:
    """(2, 3) -> (2, 3) inverse of an affine map."""
    m = np.asarray(matrix, dtype=np.float64)
    if m.shape != (2, 3):
        raise ValueError(f"affine matrix must have shape (2, 3), got {m.shape}")
    linear_inv = np.linalg.inv(m[:, :2])
    return np.hstack([linear_inv, (-linear_inv @ m[:, 2])[:, None]])


def warp_image(image: np.ndarray, matrix: np.ndarray, output_size: Sequence[int]) -> np.ndarray:
    """(h, w, C) image -> (H, W, C) crop: bilinear, constant border 0."""
    height, width = _check_size(output_size)
    return cv2.warpAffine(
        image,
        np.asarray(matrix, dtype=np.float64),
        (width, height),
        flags=cv2.INTER_LINEAR,
        borderMode=cv2.BORDER_CONSTANT,
        borderValue=0,
    )


def warp_points(points: np.ndarray, matrix: np.ndarray) -> np.ndarray:
    """(..., 2) points -> (..., 2) float32 points under the (2, 3) affine map."""
    pts = np.asarray(points, dtype=np.float64)
    m = np.asarray(matrix, dtype=np.float64)
    if pts.shape[-1] != 2 or m.shape != (2, 3):
        raise ValueError(f"warp_points expects (..., 2) points and a (2, 3) matrix, got {pts.shape}, {m.shape}")
    return (pts @ m[:, :2].T + m[:, 2]).astype(np.float32)


def flip_horizontal(
    image: np.ndarray, joints: np.ndarray, visible: np.ndarray, width: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mirror an image of the given width and its joints.

    x -> width - 1 - x (pixel centres map onto pixel centres) and left/right
    joints swap places (``flip_permutation``), since the mirrored person's
    right wrist is where the left one was. Invisible joints stay 0.

    Returns (image (h, width, C) copy, joints (16, 2) float32, visible (16,) bool).
    """
    if image.shape[1] != width:
        raise ValueError(f"flip_horizontal: image width {image.shape[1]} != width argument {width}")
    pts, vis = flip_joints(joints, visible, width)
    return np.ascontiguousarray(image[:, ::-1]), pts, vis


def flip_joints(joints: np.ndarray, visible: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """The joints half of ``flip_horizontal``: (joints (16, 2) float32, visible (16,) bool) of the mirrored crop, for
    a batch whose pixels are mirrored elsewhere (on the training device)."""
    pts = np.array(joints, dtype=np.float32)
    vis = np.array(visible).astype(bool)
    if pts.shape != (NUM_JOINTS, 2) or vis.shape != (NUM_JOINTS,):
        raise ValueError(f"flip_horizontal expects joints (16, 2) and visible (16,), got {pts.shape}, {vis.shape}")
    perm = flip_permutation()
    pts[:, 0] = (width - 1) - pts[:, 0]
    pts, vis = pts[perm], vis[perm]
    pts[~vis] = 0.0
    return pts, vis


def box_corners(box: np.ndarray) -> np.ndarray:
    """(4,) x1, y1, x2, y2 -> (4, 2) corners: a turned box's axis-aligned hull is the hull of these, mapped."""
    x1, y1, x2, y2 = (float(v) for v in box)
    return np.array([[x1, y1], [x2, y1], [x2, y2], [x1, y2]])


def transform_face(
    face: FaceLabels, matrix: np.ndarray, *, rotation: float, flip_width: int | None, size_hw: tuple[int, int]
) -> tuple[bool, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A face through the crop's affine map (and the horizontal flip), in input pixels.

    Args:
        matrix: (2, 3) image -> input map (``fedpose.shared.data.transforms.affine_matrix``), rotating the content
            ``rotation`` degrees counter-clockwise.
        flip_width: the input width when the crop is mirrored afterwards, else None.
        size_hw: (H, W) of the input; a face whose box centre leaves it is no longer present.

    Returns:
        present, box (4,) float32 (x1, y1, x2, y2), landmarks (5, 2) float32, visible (5,) bool,
        head_pose (3,) float32 degrees. The box is the axis-aligned hull of the turned box; the roll turns
        with the content; a mirror negates yaw and roll and swaps the left and right landmarks.
    """
    if not face.present:
        return False, np.zeros(4, np.float32), np.zeros((NUM_LANDMARKS, 2), np.float32), \
            np.zeros(NUM_LANDMARKS, bool), np.zeros(3, np.float32)
    corners = warp_points(box_corners(face.box.reshape(-1)), matrix)  # (4, 2)
    points = warp_points(face.landmarks, matrix)  # (5, 2)
    visible = face.visible.copy()
    yaw, pitch, roll = (float(v) for v in face.head_pose)
    roll = float(wrap_degrees(roll - rotation))  # content turned counter-clockwise: the crown tips left
    if flip_width is not None:
        corners[:, 0] = (flip_width - 1) - corners[:, 0]
        points[:, 0] = (flip_width - 1) - points[:, 0]
        points, visible = points[list(LANDMARK_FLIP)], visible[list(LANDMARK_FLIP)]
        yaw, roll = -yaw, -roll
    box = np.concatenate([corners.min(axis=0), corners.max(axis=0)]).astype(np.float32)
    present = bool(inside((box[:2] + box[2:]) / 2.0, size_hw))
    visible &= inside(points, size_hw) & present
    points[~visible] = 0.0
    if not present:
        box[:] = 0.0
    return present, box, points.astype(np.float32), visible, np.array([yaw, pitch, roll], np.float32)


def record_boxes(records: Sequence[PoseRecord]) -> tuple[np.ndarray, np.ndarray]:
    """Records -> (centers (N, 2) float64, scales (N,) float64) for ``inverse_transform``."""
    centers = np.array([r.center for r in records], dtype=np.float64).reshape(len(records), 2)
    scales = np.array([r.scale for r in records], dtype=np.float64).reshape(len(records))
    return centers, scales


def inverse_transform(
    joints_input: np.ndarray,
    centers: np.ndarray,
    scales: np.ndarray,
    input_size: Sequence[int],
) -> np.ndarray:
    """Map predictions from input-crop pixels back to original-image pixels.

    Predictions are reported in original pixels so PCKh/OKS compare against
    the untouched annotations. Assumes the un-augmented crop (evaluation).

    Args:
        joints_input: (N, K, 2) coordinates in the (H, W) input.
        centers: (N, 2) box centres; scales: (N,) box scales (see ``record_boxes``).
        input_size: (H, W).

    Returns:
        (N, K, 2) float32 original-image coordinates.
    """
    pts = np.asarray(joints_input, dtype=np.float64)
    centers = np.asarray(centers, dtype=np.float64)
    scales = np.asarray(scales, dtype=np.float64)
    if pts.ndim != 3 or pts.shape[2] != 2:
        raise ValueError(f"joints_input must have shape (N, K, 2), got {pts.shape}")
    n = pts.shape[0]
    if centers.shape != (n, 2) or scales.shape != (n,):
        raise ValueError(
            f"centers must be ({n}, 2) and scales ({n},) to match joints_input, got {centers.shape}, {scales.shape}"
        )
    out = np.empty_like(pts)
    for i in range(n):
        inv = invert_affine(affine_matrix(centers[i], scales[i], input_size))
        out[i] = pts[i] @ inv[:, :2].T + inv[:, 2]
    return out.astype(np.float32)
