"""``fedpose edge pixelize | restore``: DP pixelization of images, folders and videos, and restoring a frame
from its compact NPZ. Registered with the other edge commands by ``fedpose.cli.edge``; handlers import what they need
inside, so a camera without torch runs them.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("fedpose.edge")

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff")
VIDEO_SUFFIXES = (".mp4", ".avi", ".mkv", ".mov")


def _read_inputs(path: Path, gray: bool) -> tuple[str, list[tuple[str, Any]]]:
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


def cmd_pixelize(args: argparse.Namespace) -> int:
    import cv2
    import numpy as np

    from fedpose.shared.pixelization.spec import PixelizeSpec
    from fedpose.edge.pixelize.masks import load_mask
    from fedpose.shared.pixelization.mechanism import pixelize
    from fedpose.edge.pixelize.claim import pixelize_claim
    from fedpose.edge.pixelize.storage import save_npz

    spec = PixelizeSpec(eps=args.eps, b=args.b, m=args.m, n=args.n, noise=args.noise)
    kind, items = _read_inputs(Path(args.input), args.gray)
    out = Path(args.out)
    single = kind == "image"
    if single:
        want = ".npz" if args.store == "npz" else None
        if want and out.suffix != want:
            raise ValueError(f"--store npz writes one NPZ file: --out must end in .npz, got {out}")
        if not want and out.suffix.lower() not in IMAGE_SUFFIXES:
            raise ValueError(f"--out must be an image file ({', '.join(IMAGE_SUFFIXES)}) for a single image, got {out}")
        out.parent.mkdir(parents=True, exist_ok=True)
    else:
        out.mkdir(parents=True, exist_ok=True)

    mask_source, fixed_mask, runtime = "none", None, None
    if args.mask == "pose":
        if not args.model:
            raise ValueError("--mask pose estimates the body region with a pose model: pass --model model.onnx|.pt")
        from fedpose.edge.runtime import make_runtime

        runtime = make_runtime(args.model, args.backend)
        mask_source = "keypoints"
    elif args.mask:
        fixed_mask = load_mask(args.mask)
        mask_source = "file"
    if args.seed is not None:
        log.warning("pixelization noise seeded with %d: reproducible, NOT for production", args.seed)
    rng = np.random.default_rng(args.seed)
    try:
        for name, image in items:
            mask = fixed_mask
            if runtime is not None:
                mask = _pose_mask(runtime, image)
            if mask is not None and mask.shape != image.shape[:2]:
                raise ValueError(f"mask {args.mask} is {mask.shape[0]}x{mask.shape[1]} (HxW), image {name} is "
                                 f"{image.shape[0]}x{image.shape[1]} (HxW): they must match")
            frame = pixelize(image, spec, mask=mask, rng=rng)
            if args.store == "npz":
                save_npz(frame, out if single else out / f"{name}.npz")
            else:
                target = out if single else out / f"{name}.png"
                if not cv2.imwrite(str(target), frame.render()):
                    raise ValueError(f"OpenCV cannot write {target}")
    finally:
        if runtime is not None:
            runtime.close()
    print(f"pixelized {len(items)} {'frame' if len(items) == 1 else 'frames'} -> {out}"
          + (" (NPZ: noisy means only; rebuild with `fedpose edge restore`)" if args.store == "npz" else ""))
    print(pixelize_claim(spec, mask_source=mask_source, frames=len(items),
                         kind={"dir": "images", "image": "image", "video": "video"}[kind]))
    return 0


def _pose_mask(runtime: Any, image: Any) -> Any:
    """Body mask of the (single) person in an image from a full-frame pose estimate."""
    import cv2
    import numpy as np

    from fedpose.edge.pixelize.masks import body_mask_from_keypoints
    from fedpose.edge.prepost import postprocess, preprocess

    bgr = image if image.ndim == 3 else cv2.cvtColor(image, cv2.COLOR_GRAY2BGR)
    h, w = image.shape[:2]
    batch, mats = preprocess(bgr, np.array([[0.0, 0.0, w, h]]), runtime.input_size)
    sx, sy = runtime.infer(batch)
    kps, scores = postprocess(sx, sy, mats, runtime.input_size)
    return body_mask_from_keypoints((h, w), kps[0], scores[0], score_threshold=0.05)


def cmd_restore(args: argparse.Namespace) -> int:
    import cv2

    from fedpose.edge.pixelize.storage import restore

    src = Path(args.input)
    if not src.is_file():
        raise FileNotFoundError(f"--in {src} does not exist")
    image = restore(src)
    out = Path(args.out)
    if out.suffix.lower() not in IMAGE_SUFFIXES:
        raise ValueError(f"--out must be an image file ({', '.join(IMAGE_SUFFIXES)}), got {out}")
    out.parent.mkdir(parents=True, exist_ok=True)
    if not cv2.imwrite(str(out), image):
        raise ValueError(f"OpenCV cannot write {out}")
    print(f"restored {src} -> {out} ({image.shape[0]}x{image.shape[1]} (HxW), "
          f"{'grayscale' if image.ndim == 2 else 'colour'}; identical to the released frame)")
    return 0
