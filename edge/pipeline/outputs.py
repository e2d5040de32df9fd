"""What a run writes: keypoints.jsonl records, the annotated video (skeleton drawing), the pixelized
NPZ frames, and the claim naming every released output (DESIGN 4b).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from fedpose.edge.pipeline.options import PipelineOptions
from fedpose.shared.data.joints import NUM_JOINTS, SKELETON

KEYPOINTS_FILE = "keypoints.jsonl"
VIDEO_FILE = "annotated.mp4"
PIXELIZED_DIR = "pixelized"


def draw_skeleton(
    image: np.ndarray, keypoints: np.ndarray, scores: np.ndarray, *, threshold: float, box: np.ndarray | None = None
) -> np.ndarray:
    """Bones (``SKELETON``) and joints over a copy of a BGR image; joints below threshold are skipped."""
    out = image.copy() if image.ndim == 3 else cv2.cvtColor(image, cv2.COLOR_GRAY2BGR)
    kp = np.asarray(keypoints, dtype=np.float64)
    ok = np.asarray(scores) >= threshold
    for a, b in SKELETON:
        if ok[a] and ok[b]:
            cv2.line(out, _int_pt(kp[a]), _int_pt(kp[b]), (0, 255, 0), 2, cv2.LINE_AA)
    for j in range(NUM_JOINTS):
        if ok[j]:
            cv2.circle(out, _int_pt(kp[j]), 3, (0, 0, 255), -1, cv2.LINE_AA)
    if box is not None:
        x, y, w, h = box
        cv2.rectangle(out, _int_pt((x, y)), _int_pt((x + w, y + h)), (255, 128, 0), 1)
    return out


def _int_pt(p: Any) -> tuple[int, int]:
    x, y = float(p[0]), float(p[1])
    big = 1 << 20
    return int(round(min(max(x, -big), big))), int(round(min(max(y, -big), big)))


def release_claim(
    spec: Any,
    *,
    frames: int,
    keypoints_file: str | None,
    video_file: str | None,
    shown: bool = False,
    overlay: bool = False,
    store: str = "npz",
    face_outputs: tuple[str, ...] = (),
) -> str:
    """The printed edge claim of a pixelized run: the DP statement, then every output the run released.

    DESIGN 4b: the camera viewer may learn only what this lists. The pixelized
    frames are covered by ``pixelize_claim`` (eps per frame, F*eps over the
    clip, the region mask NOT protected); everything else written is computed
    from the raw frames and is named here as NOT protected by that guarantee.
    """
    from fedpose.shared.pixelization.claim import pixelize_claim

    lines = [
        pixelize_claim(spec, mask_source="keypoints", frames=frames),
        "Released by this run (a viewer of these outputs may learn all of it):",
        f"- {PIXELIZED_DIR}/frame_*.{ {'npz': 'npz', 'png': 'png', 'jpeg': 'jpg'}[store]}: the DP-pixelized frames "
        f"({'noisy cell means' if store == 'npz' else 'rendered images of the noisy cell means'}, "
        f"{spec.eps:g}-DP per frame, "
        f"{frames * spec.eps:g} over F={frames} frames) and the cell layout, i.e. the region mask, which is "
        "derived from the raw frame's keypoints and NOT protected.",
    ]
    if keypoints_file:
        lines.append(
            f"- {keypoints_file}: per frame the 16 keypoints (x, y, score), the person box and its source, "
            + (f"the face outputs ({', '.join(face_outputs)}: face box, landmarks, head pose or attribute as the "
               "model has them), " if face_outputs else "")
            + "timestamps and latency, computed from the raw frames: NOT protected by the pixelization guarantee "
            "(no DP at all)."
        )
    for what, name in (("video", video_file), ("display (--show)", "window" if shown else None)):
        if not name:
            continue
        label = name if what == "video" else "the --show window"
        if overlay:
            lines.append(
                f"- {label}: the pixelized frames with the skeleton and person box from the raw frames drawn over "
                "them (--overlay): the overlay is NOT protected by the pixelization guarantee."
            )
        else:
            lines.append(f"- {label}: the pixelized frames only, no overlay (same guarantee as the frames).")
    return "\n".join(lines)


def frame_record(
    index: int, pos_ms: float, box: np.ndarray, box_source: str, kps: np.ndarray, scores: np.ndarray, latency: float,
    face: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One frame's keypoints.jsonl object (``run_pipeline`` lists its keys)."""
    joints = [[round(float(x), 2), round(float(y), 2), round(float(s), 4)] for (x, y), s in zip(kps, scores)]
    record = {
        "frame": index,
        "timestamp": round(time.time(), 4),
        "pos_ms": round(pos_ms, 2),
        "box": [round(float(v), 2) for v in box],
        "box_source": box_source,
        "keypoints": joints,
        "latency_ms": round(latency, 3),
    }
    if face is not None:
        record["face"] = face
    return record


def pixelize_frame(
    frame: np.ndarray, kps: np.ndarray, scores: np.ndarray, options: PipelineOptions, rng: Any, out: Path, index: int
) -> tuple[np.ndarray, bool]:
    """DP-pixelize the frame with a body mask from this frame's keypoints.

    Returns the BGR image to publish and whether the body mask was empty.
    """
    from fedpose.shared.pixelization.masks import body_mask_from_keypoints
    from fedpose.shared.pixelization.mechanism import pixelize
    from fedpose.shared.pixelization.storage import save_npz

    image = frame if options.pixelize_color else cv2.cvtColor(frame, cv2.COLOR_BGR2GRAY)
    mask = body_mask_from_keypoints(frame.shape[:2], kps, scores, score_threshold=options.score_threshold)
    released = pixelize(image, options.pixelize, mask=mask, rng=rng)
    rendered = released.render()
    if options.store == "npz":
        save_npz(released, out / f"frame_{index:06d}.npz")
    elif not cv2.imwrite(str(out / f"frame_{index:06d}.{'jpg' if options.store == 'jpeg' else 'png'}"), rendered):
        raise OSError(f"cannot write a {options.store} frame in {out}")  # JPEG's loss is post-processing of the release
    bgr = rendered if rendered.ndim == 3 else cv2.cvtColor(rendered, cv2.COLOR_GRAY2BGR)
    return bgr, not mask.any()


def open_writer(path: Path, fps: float, size: tuple[int, int]) -> Any:
    """The annotated video's OpenCV writer (mp4v) for frames of ``size`` = (H, W)."""
    h, w = size
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), float(fps), (int(w), int(h)))
    if not writer.isOpened():
        raise RuntimeError(f"OpenCV cannot write {path} with the mp4v codec")
    return writer


def check_gui() -> None:
    """Refuse ``--show`` before the run starts when this OpenCV cannot open a window."""
    try:
        cv2.namedWindow("fedpose edge", cv2.WINDOW_NORMAL)
    except cv2.error as err:
        raise ValueError(
            "--show needs OpenCV with GUI support; opencv-python-headless has none "
            "(pip install opencv-python on a machine with a display) or drop --show"
        ) from err
