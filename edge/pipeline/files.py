"""DP pixelization of files: an image, a folder of images or a video, and a frame restored from its NPZ.

What ``fedpose edge pixelize`` and ``fedpose edge restore`` run. The mask of the cells that may hold a person is
none (a uniform grid), a fixed mask image, or the body region of a full-frame pose estimate of each image
(``mask="pose"``, with a pose model). OpenCV and the runtimes are imported inside, so a camera without torch
runs them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedpose.shared.pixelization.spec import PixelizeSpec

log = logging.getLogger("fedpose.edge")

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff")
VIDEO_SUFFIXES = (".mp4", ".avi", ".mkv", ".mov")


def read_inputs(path: Path, gray: bool) -> tuple[str, list[tuple[str, Any]]]:
    """(kind, [(name, image)]) for an image file, a directory of images or a video."""
    import cv2

    def load(p: Path) -> Any:
        img = cv2.imread(str(p), cv2.IMREAD_UNCHANGED)
        if img is None:
            raise ValueError(f"cannot decode image {p}")
        if img.dtype != "uint8":
            raise ValueError(f"{p}: only 8-bit images can be pixelized, got {img.dtype}")
        if img.ndim == 3 and img.shape[2] == 4:
            img = cv2.cvtColor(img, cv2.COLOR_BGRA2BGR)
        if gray and img.ndim == 3:
            img = cv2.cvtColor(img, cv2.COLOR_BGR2GRAY)
        return img

    if not path.exists():
        raise FileNotFoundError(f"--in {path} does not exist")
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        if not files:
            raise ValueError(f"--in {path} contains no images ({', '.join(IMAGE_SUFFIXES)})")
        return "dir", [(p.stem, load(p)) for p in files]
    if path.suffix.lower() in VIDEO_SUFFIXES:
        cap = cv2.VideoCapture(str(path))
        if not cap.isOpened():
            raise ValueError(f"cannot open video {path}")
        frames = []
        try:
            while True:
                ok, frame = cap.read()
                if not ok:
                    break
                frames.append((f"frame_{len(frames):06d}", cv2.cvtColor(frame, cv2.COLOR_BGR2GRAY) if gray else frame))
        finally:
            cap.release()
        if not frames:
            raise ValueError(f"no frame could be decoded from {path}")
        return "video", frames
    return "image", [(path.stem, load(path))]


@dataclass(frozen=True)
class PixelizedFiles:
    """What ``pixelize_files`` released: the input's kind ("image", "dir" or "video"), its frames, and the privacy
    statement of the release."""

    kind: str
    frames: int
    claim: str


def pixelize_files(src: Path, out: Path, spec: PixelizeSpec, *, gray: bool = False, store: str = "png",
                   mask: str | None = None, model: str | None = None, backend: str | None = None,
                   seed: int | None = None) -> PixelizedFiles:
    """Pixelize every image of ``src`` under ``spec`` into ``out`` (a file for one image, else a folder), stored as
    ``store`` ("png" or "npz": the noisy means only); ``mask``: a mask image, "pose" (the body region from
    ``model`` run on ``backend``), or None (a uniform grid); ``seed``: reproducible noise, NOT for production."""
    import cv2
    import numpy as np

    from fedpose.shared.pixelization.claim import pixelize_claim
    from fedpose.shared.pixelization.masks import load_mask
    from fedpose.shared.pixelization.mechanism import pixelize
    from fedpose.shared.pixelization.storage import save_npz

    kind, items = read_inputs(src, gray)
    single = kind == "image"
    if single:
        want = ".npz" if store == "npz" else None
        if want and out.suffix != want:
            raise ValueError(f"--store npz writes one NPZ file: --out must end in .npz, got {out}")
        if not want and out.suffix.lower() not in IMAGE_SUFFIXES:
            raise ValueError(f"--out must be an image file ({', '.join(IMAGE_SUFFIXES)}) for a single image, got {out}")
        out.parent.mkdir(parents=True, exist_ok=True)
    else:
        out.mkdir(parents=True, exist_ok=True)

    mask_source, fixed_mask, runtime = "none", None, None
    if mask == "pose":
        if not model:
            raise ValueError("--mask pose estimates the body region with a pose model: pass --model model.onnx|.pt")
        from fedpose.edge.runtime import make_runtime

        runtime = make_runtime(model, backend)
        mask_source = "keypoints"
    elif mask:
        fixed_mask = load_mask(mask)
        mask_source = "file"
    if seed is not None:
        log.warning("pixelization noise seeded with %d: reproducible, NOT for production", seed)
    rng = np.random.default_rng(seed)
    try:
        for name, image in items:
            cells = fixed_mask
            if runtime is not None:
                cells = _pose_mask(runtime, image)
            if cells is not None and cells.shape != image.shape[:2]:
                raise ValueError(f"mask {mask} is {cells.shape[0]}x{cells.shape[1]} (HxW), image {name} is "
                                 f"{image.shape[0]}x{image.shape[1]} (HxW): they must match")
            frame = pixelize(image, spec, mask=cells, rng=rng)
            if store == "npz":
                save_npz(frame, out if single else out / f"{name}.npz")
            else:
                target = out if single else out / f"{name}.png"
                if not cv2.imwrite(str(target), frame.render()):
                    raise ValueError(f"OpenCV cannot write {target}")
    finally:
        if runtime is not None:
            runtime.close()
    claim = pixelize_claim(spec, mask_source=mask_source, frames=len(items),
                           kind={"dir": "images", "image": "image", "video": "video"}[kind])
    return PixelizedFiles(kind=kind, frames=len(items), claim=claim)


def _pose_mask(runtime: Any, image: Any) -> Any:
    """Body mask of the (single) person in an image from a full-frame pose estimate."""
    import cv2
    import numpy as np

    from fedpose.shared.pixelization.masks import body_mask_from_keypoints
    from fedpose.edge.runtime.prepost import postprocess, preprocess

    bgr = image if image.ndim == 3 else cv2.cvtColor(image, cv2.COLOR_GRAY2BGR)
    h, w = image.shape[:2]
    batch, mats = preprocess(bgr, np.array([[0.0, 0.0, w, h]]), runtime.input_size)
    sx, sy = runtime.infer(batch)
    kps, scores = postprocess(sx, sy, mats, runtime.input_size)
    return body_mask_from_keypoints((h, w), kps[0], scores[0], score_threshold=0.05)


def restore_image(src: Path, out: Path) -> Any:
    """Rebuild the pixelized frame stored in the NPZ ``src`` and write it to the image file ``out`` (bit-identical
    to the release); returns the image."""
    import cv2

    from fedpose.shared.pixelization.storage import restore

    if not src.is_file():
        raise FileNotFoundError(f"--in {src} does not exist")
    image = restore(src)
    if out.suffix.lower() not in IMAGE_SUFFIXES:
        raise ValueError(f"--out must be an image file ({', '.join(IMAGE_SUFFIXES)}), got {out}")
    out.parent.mkdir(parents=True, exist_ok=True)
    if not cv2.imwrite(str(out), image):
        raise ValueError(f"OpenCV cannot write {out}")
    return image
