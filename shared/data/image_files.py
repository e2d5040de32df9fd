"""The image files behind the records: an annotation's image name resolved safely under its images folder,
an image's size read from its header (readers check every file exists and is sane before training), and
decoding an image for the dataset. Pillow's checked open is ``fedpose.shared.data.records.open_image``.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath, PureWindowsPath

import cv2
import numpy as np

from fedpose.shared.data.records import open_image


def image_size(path: Path) -> tuple[int, int]:
    """(H, W) of an image file from its header (plus PNG chunk CRCs); errors name the file.

    FileNotFoundError for a missing file; ValueError for a zero-byte, truncated
    (PNG), non-image or too large (``MAX_IMAGE_PIXELS``) file.
    """
    with open_image(path) as im:
        width, height = im.size
        try:
            im.verify()  # PNG: checks every chunk's CRC without decoding (catches truncation)
        except Exception as err:  # Pillow raises many types here (SyntaxError, struct.error, ...)
            raise ValueError(f"cannot read image file {path}: corrupt or truncated ({err!r})") from err
    return int(height), int(width)


def image_path(root: Path, name: object, *, where: str) -> Path:
    """``root / name`` for an annotation's image name, refusing names that leave ``root``.

    Names must be non-empty relative strings without ``..`` components (an
    annotation file must not make the reader open files outside its split's
    images/ folder); the resolved path must lie under ``root``.
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"{where}: image must be a non-empty file name string, got {name!r}")
    pure = PurePosixPath(name.replace("\\", "/"))
    if pure.is_absolute() or PureWindowsPath(name).is_absolute() or PureWindowsPath(name).drive \
            or ".." in pure.parts or "\0" in name:
        raise ValueError(f"{where}: image name {name!r} is absolute or leaves the images folder {root}")
    path = root / pure
    try:
        path.resolve().relative_to(root)
    except ValueError as err:
        raise ValueError(f"{where}: image {name!r} resolves outside the images folder {root}") from err
    return path


def read_image(path: str) -> np.ndarray:
    """(H, W, 3) uint8 BGR; missing or unreadable files raise with the file named."""
    image = cv2.imread(str(path), cv2.IMREAD_COLOR)
    if image is None:
        if not Path(path).is_file():
            raise FileNotFoundError(f"image file not found: {path}")
        raise OSError(f"cannot decode image file {path}")
    return image
