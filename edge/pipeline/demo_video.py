"""A synthetic ward clip with ground truth, so the pipeline can be tried and tested without a camera.

One person (a fixed identity from ``fedpose.shared.data.synth``) moves through a
sequence of sampled poses (standing, walking, arms raised, bending); the
joints are interpolated with a smooth step between key poses placed at
different spots of the room, and every frame is drawn by ``render_frame``
over the same room (the background rng is re-seeded per frame, so the
room and its clutter stay put while the person moves).

The ground truth goes to a JSON sidecar next to the video
(``clip.mp4`` -> ``clip.mp4.json``): per frame the 16 joints in frame pixels
and their visibility, the person box in the training crops' convention
(``fedpose.shared.data.synth.render.person_box``, as (x, y, w, h)), plus the ROI that contains the whole motion (what an
installer would configure as "the bed area").
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np

from fedpose.shared.data.joints import NUM_JOINTS
from fedpose.shared.data.records import PIXEL_STD

log = logging.getLogger(__name__)

FORMAT = "fedpose-demo-video"
KINDS: tuple[str, ...] = ("standing", "walking", "arms_raised", "bending", "walking", "standing")


@dataclass(frozen=True)
class DemoSpec:
    """What to render: ``frames`` frames of ``size`` = (W, H) at ``fps``; key pose every ``key_every`` frames."""

    frames: int = 120
    size: tuple[int, int] = (320, 240)
    fps: float = 25.0
    seed: int = 0
    key_every: int = 30
    style: str = "public"  # "public" or a site index ("0", "1", ...)

    def __post_init__(self) -> None:
        if self.frames < 1:
            raise ValueError(f"--frames must be >= 1, got {self.frames}")
        w, h = self.size
        if not (64 <= w <= 1920 and 64 <= h <= 1080):
            raise ValueError(f"--size must be between 64x64 and 1080x1920 (HxW), got {h}x{w}")
        if self.fps <= 0 or self.key_every < 2 or self.seed < 0:
            raise ValueError("fps must be > 0, key_every >= 2 and seed >= 0")


def parse_size(value: str) -> tuple[int, int]:
    """``"HxW"`` (height first, as every size fedpose takes) -> (W, H), the frame size ``DemoSpec`` holds."""
    try:
        h, w = (int(v) for v in value.lower().split("x"))
    except ValueError as err:
        raise ValueError(f"--size must look like HxW (e.g. 240x320), got {value!r}") from err
    return w, h


def sidecar_path(video: str | Path) -> Path:
    """Ground-truth file of a demo clip: ``clip.mp4`` -> ``clip.mp4.json``."""
    return Path(str(video) + ".json")


def _smoothstep(t: float) -> float:
    return t * t * (3.0 - 2.0 * t)


def _fit_into(joints: np.ndarray, region: tuple[float, float, float, float], rng: np.random.Generator) -> np.ndarray:
    """Scale (only down) and shift (16, 2) joints so their box lies inside region (x0, y0, x1, y1)."""
    x0, y0, x1, y1 = region
    lo, hi = joints.min(axis=0), joints.max(axis=0)
    extent = np.maximum(hi - lo, 1.0)
    shrink = min(1.0, (x1 - x0) / extent[0], (y1 - y0) / extent[1])
    pts = (joints - lo) * shrink
    extent = extent * shrink
    ox = rng.uniform(x0, max(x0, x1 - extent[0]))
    oy = y1 - extent[1] if rng.random() < 0.7 else rng.uniform(y0, max(y0, y1 - extent[1]))  # mostly on the floor
    return pts + np.array([ox, oy])


def render_demo(spec: DemoSpec) -> tuple[list[np.ndarray], dict]:
    """Frames (H, W, 3) uint8 BGR and the ground-truth dict (without writing anything)."""
    from fedpose.shared.data.synth.styles import PUBLIC_STYLE, site_style
    from fedpose.shared.data.synth.identity import make_identity
    from fedpose.shared.data.synth.render import person_box, render_frame
    from fedpose.shared.data.synth.pose import place_pose, sample_pose_3d

    w, h = spec.size
    side = max(w, h)  # render_frame draws square rooms; the clip is their centre crop
    cx0, cy0 = (side - w) // 2, (side - h) // 2
    style = PUBLIC_STYLE if spec.style == "public" else site_style(int(spec.style))
    rng = np.random.default_rng([spec.seed, 1])
    identity = make_identity(np.random.default_rng([spec.seed, 2]))
    n_keys = spec.frames // spec.key_every + 2
    margin = 0.06 * min(w, h)
    region = (cx0 + margin, cy0 + margin, cx0 + w - margin, cy0 + h - margin)
    keys, depths, kinds = [], [], []
    for k in range(n_keys):
        kind = KINDS[k % len(KINDS)]
        pose = sample_pose_3d(kind, rng)
        placed = place_pose(pose, kind=kind, style=style, size=side, rng=rng).astype(np.float64)
        keys.append(_fit_into(placed, region, rng))
        depths.append(pose[:, 2].astype(np.float64))
        kinds.append(kind)
    frames, joints_out = [], []
    bg_seed = [spec.seed, 3]
    for i in range(spec.frames):
        k, r = divmod(i, spec.key_every)
        t = _smoothstep(r / spec.key_every)
        joints = (1 - t) * keys[k] + t * keys[k + 1]  # (16, 2) in room pixels
        depth = (1 - t) * depths[k] + t * depths[k + 1]
        room = render_frame(joints, style=style, identity=identity, size=side, rng=np.random.default_rng(bg_seed),
                            depth=depth)
        frames.append(np.ascontiguousarray(room[cy0 : cy0 + h, cx0 : cx0 + w]))
        joints_out.append(joints - np.array([cx0, cy0]))
    allj = np.concatenate(joints_out)
    lo, hi = allj.min(axis=0), allj.max(axis=0)
    pad = 0.1 * (hi - lo)
    rx0, ry0 = np.maximum(lo - pad, 0.0)
    rx1, ry1 = np.minimum(hi + pad, [w - 1, h - 1])
    boxes = []  # the training crops' person box (square, 1.25 x joints + head): what a perfect detector gives
    for j in joints_out:
        center, scale = person_box(j)
        side = scale * PIXEL_STD
        boxes.append([round(float(v), 2) for v in (center[0] - side / 2, center[1] - side / 2, side, side)])
    visible = [((j[:, 0] >= 0) & (j[:, 0] < w) & (j[:, 1] >= 0) & (j[:, 1] < h)).tolist() for j in joints_out]
    truth = {
        "format": FORMAT,
        "fps": spec.fps,
        "size": [w, h],
        "seed": spec.seed,
        "style": style.name,
        "frames": spec.frames,
        "key_poses": kinds,
        "roi": [round(float(v), 2) for v in (rx0, ry0, rx1 - rx0, ry1 - ry0)],
        "joints": [np.round(j, 3).tolist() for j in joints_out],
        "visible": visible,
        "boxes": boxes,
    }
    return frames, truth


def write_demo_video(out: str | Path, spec: DemoSpec = DemoSpec()) -> Path:
    """Render, write ``out`` (mp4v) and its ground-truth sidecar; checks the file reads back. Returns the sidecar."""
    out = Path(out)
    if out.suffix.lower() not in (".mp4", ".avi", ".mkv"):
        raise ValueError(f"--out must be a video file (.mp4, .avi or .mkv), got {out}")
    out.parent.mkdir(parents=True, exist_ok=True)
    frames, truth = render_demo(spec)
    w, h = spec.size
    writer = cv2.VideoWriter(str(out), cv2.VideoWriter_fourcc(*"mp4v"), float(spec.fps), (w, h))
    if not writer.isOpened():
        raise RuntimeError(f"OpenCV cannot write {out} with the mp4v codec on this machine")
    try:
        for frame in frames:
            writer.write(frame)
    finally:
        writer.release()
    cap = cv2.VideoCapture(str(out))
    try:
        count = 0
        while cap.isOpened():
            ok, _ = cap.read()
            if not ok:
                break
            count += 1
    finally:
        cap.release()
    if count != spec.frames:
        raise RuntimeError(f"{out}: wrote {spec.frames} frames but OpenCV reads back {count}")
    sidecar = sidecar_path(out)
    sidecar.write_text(json.dumps(truth))
    log.info("demo clip %s: %d frames of %dx%d (HxW), ground truth in %s", out, spec.frames, h, w, sidecar)
    return sidecar


def load_truth(video: str | Path) -> dict:
    """The ground-truth sidecar of a demo clip (joints (F, 16, 2) under "joints", person boxes (F, 4) under "boxes")."""
    path = sidecar_path(video)
    if not path.is_file():
        raise FileNotFoundError(
            f"no ground truth {path} next to {video}: render the clip with `fedpose edge demo-video`"
        )
    truth = json.loads(path.read_text())
    if truth.get("format") != FORMAT:
        raise ValueError(f"{path} is not a fedpose demo-video ground truth")
    truth["joints"] = np.asarray(truth["joints"], dtype=np.float64).reshape(-1, NUM_JOINTS, 2)
    truth["visible"] = np.asarray(truth["visible"], dtype=bool)
    if "boxes" in truth:
        truth["boxes"] = np.asarray(truth["boxes"], dtype=np.float64).reshape(-1, 4)
    return truth


def truth_beside(source: str) -> dict | None:
    """The ground truth beside a video file (``clip.mp4.json`` from ``edge demo-video``), or None (a camera, a
    stream URL, or a video without one): what ``fedpose edge run`` scores its keypoints against."""
    path = sidecar_path(source)
    if "://" in source or source.strip().isdigit() or not path.is_file():
        return None
    truth = load_truth(source)
    truth["path"] = path
    return truth
