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
from typing import Any

import numpy as np

from fedpose.shared.data.face import FaceLabels
from fedpose.shared.data.joints import NUM_JOINTS

log = logging.getLogger(__name__)

# MPII convention: the person box of a record has side PIXEL_STD * scale pixels.
PIXEL_STD = 200.0
MAX_PATIENT_ID = 256  # characters of a patient id


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
            ``fedpose.shared.data.joints.JOINT_NAMES``; invisible joints are stored as 0.
        visible: (16,) bool, True where the joint is annotated and lies inside
            the image (MPII ``joints_vis``: an occluded but annotated joint is
            visible here).
        headbox: optional (2, 2) float32 [[x1, y1], [x2, y2]] head box for PCKh.
        patient: optional id of the person shown (the privacy unit of patient-level
            DP, ``fedpose.shared.data.patients``); None when the data carries no patient ids
            (MPII, COCO).
        face: optional face labels (``fedpose.shared.data.face``) for the face tasks; None when the
            data has no face annotation for this person.

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
    patient: str | None = None
    face: FaceLabels | None = None

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

        if self.patient is not None and (not isinstance(self.patient, str) or not self.patient
                                         or len(self.patient) > MAX_PATIENT_ID):
            raise ValueError(f"PoseRecord.patient must be a non-empty string of at most {MAX_PATIENT_ID} "
                             f"characters or None, got {self.patient!r} for {image}")
        if self.face is not None and not isinstance(self.face, FaceLabels):
            raise ValueError(f"PoseRecord.face must be FaceLabels or None, got {type(self.face).__name__} for {image}")

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


# Largest image any reader accepts (width x height, checked from the header before decoding):
# an 8K frame is 33 M pixels; a crafted header claiming 100000 x 100000 would otherwise make the
# decoder allocate tens of GiB.
MAX_IMAGE_PIXELS = 64_000_000


def open_image(path: str | Path) -> Any:
    """Open an image with Pillow after checking it exists and its header is sane; errors name the file.

    Returns the (lazy, not yet decoded) ``PIL.Image``; use it as a context manager.
    Raises FileNotFoundError for a missing file and ValueError for anything that is
    not a readable image or whose header declares more than ``MAX_IMAGE_PIXELS``.
    """
    from PIL import Image, UnidentifiedImageError

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"image file not found: {path}")
    try:
        im = Image.open(path)
    except Image.DecompressionBombError as err:
        raise ValueError(f"image file {path} declares too many pixels: {err}") from err
    except (OSError, UnidentifiedImageError, ValueError, SyntaxError) as err:
        raise ValueError(f"cannot read image file {path}: not a readable image ({err})") from err
    width, height = im.size
    if width < 1 or height < 1 or width * height > MAX_IMAGE_PIXELS:
        im.close()
        raise ValueError(
            f"image file {path} declares {width}x{height} pixels: too large "
            f"(at most {MAX_IMAGE_PIXELS} pixels) or empty"
        )
    return im


def content_hash(path: str | Path) -> str:
    """sha256 hex digest of the image's decoded pixels (as 8-bit RGB) and its size.

    Used for the public/private disjointness check (invariant P2) and for the
    duplicate check on private data: two copies of one image under different
    names, or re-saved with another PNG compression level or container, must
    still count as the same image, hence the decoded pixels, not the file bytes.
    What it does NOT catch: near-duplicates whose pixels differ at all, e.g. a
    JPEG re-encoded at another quality, a resized, cropped, shifted, flipped or
    colour-adjusted copy. Those need a perceptual comparison, which this check
    does not attempt; keep the public set from a source that is disjoint by
    construction.

    Raises FileNotFoundError for a missing file, ValueError (naming the file) for
    one that is not a decodable image or is too large (``MAX_IMAGE_PIXELS``).
    """
    from PIL import Image

    with open_image(path) as im:
        try:
            im.load()
            rgb = im if im.mode == "RGB" else im.convert("RGB")
            pixels = rgb.tobytes()
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as err:
            raise ValueError(f"cannot decode image file {path}: corrupt or truncated ({err})") from err
    digest = hashlib.sha256()
    digest.update(f"{rgb.size[0]}x{rgb.size[1]}:".encode())
    digest.update(pixels)
    return digest.hexdigest()
