"""NPZ storage of a released frame: save only what was released; load with every header and size
checked before allocation (hostile files).
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import numpy as np
from numpy.lib import format as npformat

from fedpose.shared.pixelization.frame import PixelizedFrame
from fedpose.shared.pixelization.spec import MAX_FRAME_PIXELS, MAX_NPZ_MEMBER_BYTES

_NPZ_KEYS = ("simple_means", "complex_means", "cell_mask", "b", "s_b", "height", "width", "channels")


def save_npz(frame: PixelizedFrame, path: str | Path) -> None:
    """Store only what was released (noisy means, cell mask, sizes), compressed.

    Written to exactly ``path`` (no ``.npz`` suffix added).
    """
    with open(path, "wb") as f:
        np.savez_compressed(
            f,
            simple_means=frame.simple_means,
            complex_means=frame.complex_means,
            cell_mask=frame.cell_mask,
            b=np.int64(frame.b),
            s_b=np.int64(frame.s_b),
            height=np.int64(frame.height),
            width=np.int64(frame.width),
            channels=np.int64(frame.channels),
        )


def _npz_headers(path: Path, zf: zipfile.ZipFile) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Declared (shape, dtype) of every expected member, read from the .npy headers only."""
    out: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
    names = set(zf.namelist())
    missing = [k for k in _NPZ_KEYS if k + ".npy" not in names]
    if missing:
        raise ValueError(f"{path} is not a pixelized frame: missing arrays {missing}")
    for key in _NPZ_KEYS:
        info = zf.getinfo(key + ".npy")
        if info.file_size > MAX_NPZ_MEMBER_BYTES:
            raise ValueError(f"{path}: {key} declares {info.file_size} bytes uncompressed: too large "
                             f"(at most {MAX_NPZ_MEMBER_BYTES})")
        with zf.open(info) as member:
            version = npformat.read_magic(member)
            if version == (1, 0):
                shape, fortran, dtype = npformat.read_array_header_1_0(member)
            elif version == (2, 0):
                shape, fortran, dtype = npformat.read_array_header_2_0(member)
            else:
                raise ValueError(f"{path}: {key} has an unsupported .npy version {version}")
        if dtype.hasobject:
            raise ValueError(f"{path}: {key} holds Python objects, which are never loaded")
        out[key] = (tuple(int(d) for d in shape), dtype)
    return out


def _check_npz_layout(path: Path, headers: dict[str, tuple[tuple[int, ...], np.dtype]],
                      scalars: dict[str, int]) -> None:
    """Check sizes and the declared array shapes against the frame's scalars, before loading arrays."""
    height, width, b, s_b, channels = (scalars[k] for k in ("height", "width", "b", "s_b", "channels"))
    for name, value in scalars.items():
        if value < 1:
            raise ValueError(f"{path}: {name} must be a positive integer, got {value}")
    if height * width > MAX_FRAME_PIXELS:
        raise ValueError(f"{path}: the frame declares {height}x{width} pixels: too large "
                         f"(at most {MAX_FRAME_PIXELS} pixels)")
    if b > max(height, width) or b % s_b != 0 or channels not in (1, 3):
        raise ValueError(f"{path}: inconsistent layout b={b}, s_b={s_b}, channels={channels} for a "
                         f"{height}x{width} frame")
    n = b // s_b
    grid = (-(-height // b), -(-width // b))
    cells = grid[0] * grid[1]
    expected_ndim = {"simple_means": 2, "complex_means": 4, "cell_mask": 2}
    for key, ndim in expected_ndim.items():
        shape, dtype = headers[key]
        if len(shape) != ndim:
            raise ValueError(f"{path}: {key} must have {ndim} dimensions, got shape {shape}")
        if key == "cell_mask":
            if dtype != np.bool_ or shape != grid:
                raise ValueError(f"{path}: cell_mask must be bool of shape {grid}, got {dtype} {shape}")
        else:
            if dtype.kind != "f":
                raise ValueError(f"{path}: {key} must hold floats, got {dtype}")
            if shape[0] > cells or shape[1:] != ((channels,) if ndim == 2 else (n, n, channels)):
                raise ValueError(f"{path}: {key} has shape {shape}, which does not fit the layout")


def load_npz(path: str | Path) -> PixelizedFrame:
    """Load a frame written by ``save_npz`` (validated like any PixelizedFrame).

    Hostile files are refused with a ValueError naming the file before anything
    large is allocated: the declared shapes are read from the .npy headers in the
    zip and checked against the frame's scalars, the frame size is bounded
    (``MAX_FRAME_PIXELS``) and so is each member's uncompressed size.
    """
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as zf:
            headers = _npz_headers(path, zf)
            scalars: dict[str, int] = {}
            for key in ("b", "s_b", "height", "width", "channels"):
                shape, dtype = headers[key]
                if shape != () or dtype.kind not in "iu":
                    raise ValueError(f"{path}: {key} must be an integer scalar, got {dtype} shape {shape}")
                with zf.open(key + ".npy") as member:
                    scalars[key] = int(npformat.read_array(member, allow_pickle=False))
            _check_npz_layout(path, headers, scalars)
            fields: dict[str, Any] = dict(scalars)
            for key in ("simple_means", "complex_means", "cell_mask"):
                with zf.open(key + ".npy") as member:
                    fields[key] = npformat.read_array(member, allow_pickle=False)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError) as err:
        raise ValueError(f"{path} is not a readable NPZ of a pixelized frame: {err}") from err
    except ValueError as err:
        if str(path) in str(err):
            raise
        raise ValueError(f"{path} is not a readable NPZ of a pixelized frame: {err}") from err
    try:
        return PixelizedFrame(**fields)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from err


def restore(path: str | Path) -> np.ndarray:
    """Rebuild the pixelized image from an NPZ file; bit-identical to ``frame.render()``."""
    return load_npz(path).render()
