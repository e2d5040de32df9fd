"""One annotated person: the common currency of every reader, the dataset and the metrics.

Coordinates are 0-based image pixels with the centre of the top-left pixel at
(0, 0), x to the right and y down. Readers convert from their file convention
(MPII's MATLAB 1-based numbers, COCO's 0-based ones) so that nothing
downstream has to know where a record came from.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shared.data.joints import NUM_JOINTS

log = logging.getLogger(__name__)

# MPII convention: the person box of a record has side PIXEL_STD * scale pixels.
PIXEL_STD = 200.0


def _frozen_array(value: object, *, name: str, shape: tuple[int, ...], dtype: type) -> np.ndarray:
    try:
        array = np.array(value, dtype=dtype)  # copy: the record owns its arrays
    except (TypeError, ValueError) as err:
        raise ValueError(f"PoseRecord.{name}: cannot convert {value!r} to {np.dtype(dtype).name}") from err
    if array.shape != shape:
        raise ValueError(f"PoseRecord.{name}: expected shape {shape}, got {array.shape}")
    array.setflags(write=False)
    return array


@dataclass(frozen=True, eq=False)
class PoseRecord:
    """A single person in a single image.

    Attributes:
        image: absolute path of the image file.
        center: (2,) float32 person-box centre in pixels.
        scale: person-box side / 200 (MPII convention), > 0.
        joints: (16,) x 2 float32 pixel coordinates in the order of
            ``shared.data.joints.JOINT_NAMES``; invisible joints are stored as 0.
        visible: (16,) bool, True where the joint is annotated and lies inside
            the image (MPII ``joints_vis``: an occluded but annotated joint is
            visible here).
        headbox: optional (2, 2) float32 [[x1, y1], [x2, y2]] head box for PCKh.

    Arrays are copied and made read-only so a record really is immutable.
    Non-finite joints are rejected: readers must pass them through
    ``sanitize_joints`` first, which marks them invisible. ``eq=False``
    because element-wise array comparison has no single truth value; records
    compare by identity.
    """

    image: Path
    center: np.ndarray
    scale: float
    joints: np.ndarray
    visible: np.ndarray
    headbox: np.ndarray | None = None

    def __post_init__(self) -> None:
        image = Path(self.image)
        if not image.is_absolute():
            raise ValueError(f"PoseRecord.image must be an absolute path, got {str(image)!r}; resolve it first")
        object.__setattr__(self, "image", image)

        center = _frozen_array(self.center, name="center", shape=(2,), dtype=np.float32)
        if not np.all(np.isfinite(center)):
            raise ValueError(f"PoseRecord.center must be finite, got {center.tolist()} for {image}")
        object.__setattr__(self, "center", center)

        try:
            scale = float(self.scale)
        except (TypeError, ValueError) as err:
            raise ValueError(f"PoseRecord.scale must be a number, got {self.scale!r} for {image}") from err
        if not np.isfinite(scale) or scale <= 0:
            raise ValueError(f"PoseRecord.scale must be finite and > 0, got {scale} for {image}")
        object.__setattr__(self, "scale", scale)

        visible_in = np.asarray(self.visible)
        if visible_in.dtype != np.bool_ and not np.all(np.isin(visible_in, (0, 1))):
            raise ValueError(f"PoseRecord.visible must be boolean or 0/1, got {visible_in.tolist()} for {image}")
        visible = _frozen_array(visible_in, name="visible", shape=(NUM_JOINTS,), dtype=np.bool_)
        object.__setattr__(self, "visible", visible)

        joints = np.array(
            _frozen_array(self.joints, name="joints", shape=(NUM_JOINTS, 2), dtype=np.float32)
        )
        if not np.all(np.isfinite(joints)):
            bad = np.flatnonzero(~np.isfinite(joints).all(axis=1)).tolist()
            raise ValueError(
                f"PoseRecord.joints contain non-finite values at joints {bad} for {image}; "
                "pass reader output through sanitize_joints() first"
            )
        joints[~visible] = 0.0
        joints.setflags(write=False)
        object.__setattr__(self, "joints", joints)

        if self.headbox is not None:
            headbox = _frozen_array(self.headbox, name="headbox", shape=(2, 2), dtype=np.float32)
            if not np.all(np.isfinite(headbox)):
                raise ValueError(f"PoseRecord.headbox must be finite, got {headbox.tolist()} for {image}")
            object.__setattr__(self, "headbox", headbox)

    @property
    def box_side(self) -> float:
        """Side of the person box in pixels (MPII: 200 * scale)."""
        return PIXEL_STD * self.scale


def inside(points: np.ndarray, size_hw: tuple[int, int]) -> np.ndarray:
    """(..., 2) points -> (...) bool: finite and within [0, W) x [0, H).

    The same half-open rule as SimCC target building (a coordinate equal to W
    would fall into a bin that does not exist), so a joint the dataset keeps
    is always one the head can represent.
    """
    height, width = size_hw
    pts = np.asarray(points, dtype=np.float64)
    finite = np.isfinite(pts).all(axis=-1)
    with np.errstate(invalid="ignore"):
        return (
            finite
            & (pts[..., 0] >= 0)
            & (pts[..., 0] < width)
            & (pts[..., 1] >= 0)
            & (pts[..., 1] < height)
        )


def sanitize_joints(
    joints: np.ndarray, visible: np.ndarray, image_size: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray]:
    """Mark NaN/inf joints and joints outside the image invisible and zero them.

    Real annotation files contain (-1, -1) placeholders, NaNs from conversion
    scripts and points a few pixels past the border; none of them may reach a
    loss or a metric. This is the one place that rule lives.

    Args:
        joints: (16, 2) pixel coordinates (0-based).
        visible: (16,) bool or 0/1 annotation flags.
        image_size: (H, W) of the image the joints refer to.

    Returns:
        (joints (16, 2) float32 with invisible entries 0, visible (16,) bool).
    """
    height, width = image_size
    if height <= 0 or width <= 0:
        raise ValueError(f"image_size must be positive (H, W), got {image_size}")
    pts = np.array(joints, dtype=np.float32)
    vis = np.array(visible).astype(bool)
    if pts.shape != (NUM_JOINTS, 2) or vis.shape != (NUM_JOINTS,):
        raise ValueError(
            f"sanitize_joints expects joints ({NUM_JOINTS}, 2) and visible ({NUM_JOINTS},), "
            f"got {pts.shape} and {vis.shape}"
        )
    keep = vis & inside(pts, (height, width))
    dropped = int(vis.sum() - keep.sum())
    if dropped:
        log.debug("sanitize_joints: dropped %d annotated joint(s) that are non-finite or outside %dx%d",
                  dropped, width, height)
    pts[~keep] = 0.0
    return pts, keep


def content_hash(path: str | Path) -> str:
    """sha256 hex digest of the file's bytes.

    Used for the public/private disjointness check (invariant P2): two copies
    of one image under different names must still count as the same image.
    """
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
    except OSError as err:
        raise OSError(f"cannot hash image file {path}: {err}") from err
    return digest.hexdigest()
