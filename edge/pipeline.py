"""The on-camera pipeline: frames in, keypoints (and optionally DP-pixelized frames) out.

    FrameSource (OpenCV, reconnects) -> BoxTracker (ROI, then previous keypoints)
      -> preprocess -> runtime.infer -> postprocess -> keypoints.jsonl
      [-> DP pixelization of the frame, body mask from the keypoints -> pixelized/*.npz]
      [-> annotated video: skeleton over the raw frame; with pixelization the
          pixelized frame alone, or with ``overlay`` the skeleton drawn over it]

Frames never leave the device: what is written is keypoints, and, with
``pixelize``, only the DP-pixelized release (the raw frame is never saved
then, not even in the annotated video). keypoints.jsonl and any overlay are
computed from the raw frames and are not covered by the pixelization
guarantee: ``release_claim`` names every output a run wrote (DESIGN 4b).

The person box follows rtmlib's PoseTracker idea without a detector: the
configured ROI (e.g. the bed) on the first frame, afterwards the padded box
around the previous frame's confident keypoints, smoothed; when too few
keypoints are confident the tracker falls back to the ROI (or the full frame).

Robustness: end of a file ends the run; a live source (camera index,
rtsp/http URL) that stops delivering is reopened with exponential backoff,
a bounded number of times; frames that cannot be decoded are counted and
skipped. A source that cannot be opened at all raises ``SourceError``.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from edge.prepost import BOX_PADDING, box_from_keypoints, clip_box, postprocess, preprocess
from shared.data.joints import NUM_JOINTS, SKELETON

log = logging.getLogger(__name__)

KEYPOINTS_FILE = "keypoints.jsonl"
VIDEO_FILE = "annotated.mp4"
PIXELIZED_DIR = "pixelized"


class SourceError(RuntimeError):
    """The video source cannot be opened (or reopened)."""


# ---------------------------------------------------------------------------
# frame source
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ReconnectPolicy:
    """Reopen attempts after a failure: ``tries`` waits of base * 2^i seconds, capped at ``max_delay``."""

    tries: int = 6
    base_delay: float = 0.5
    max_delay: float = 8.0

    def __post_init__(self) -> None:
        if self.tries < 0 or self.base_delay < 0 or self.max_delay < self.base_delay:
            raise ValueError(f"invalid reconnect policy {self}: need tries >= 0 and 0 <= base_delay <= max_delay")

    def delays(self) -> list[float]:
        return [min(self.max_delay, self.base_delay * 2**i) for i in range(self.tries)]


def parse_source(source: str | int) -> int | str:
    """``"0"`` -> camera index 0; anything else stays a path/URL string."""
    if isinstance(source, int):
        return source
    text = str(source).strip()
    if text.isdigit():
        return int(text)
    if not text:
        raise ValueError("--source is empty: give a camera index (0), a video file or an rtsp:// URL")
    return text


def is_live(source: int | str) -> bool:
    """Cameras and network streams can drop and come back; files end."""
    return isinstance(source, int) or "://" in str(source)


def _open_capture(source: int | str) -> Any:
    if isinstance(source, str) and "://" in source:
        return cv2.VideoCapture(source, cv2.CAP_FFMPEG)
    return cv2.VideoCapture(source)


class FrameSource:
    """OpenCV capture that yields (frame index, BGR frame, position ms) and survives drops.

    Args:
        source: camera index, file path or stream URL (see ``parse_source``).
        live: reconnect when reading fails (default: cameras and URLs).
        policy: backoff for (re)opening.
        opener: returns a ``cv2.VideoCapture``-like object (default
            ``cv2.VideoCapture(source)``); tests and unusual sources plug in here.
        max_bad_frames: consecutive undecodable frames tolerated in a file
            before the rest is treated as lost.
        sleep: the wait function used for backoff.
    """

    def __init__(
        self,
        source: int | str,
        *,
        live: bool | None = None,
        policy: ReconnectPolicy = ReconnectPolicy(),
        opener: Callable[[], Any] | None = None,
        max_bad_frames: int = 25,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.source = parse_source(source)
        self.live = is_live(self.source) if live is None else live
        self.policy = policy
        self._custom_opener = opener is not None
        self._opener = opener or (lambda: _open_capture(self.source))
        self.max_bad_frames = max_bad_frames
        self._sleep = sleep
        self._cap: Any = None
        self.frames_read = 0
        self.bad_frames = 0
        self.reconnects = 0
        self.lost = False
        self.fps = 0.0

    def __enter__(self) -> FrameSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._cap is not None:
            self._cap.release()
            self._cap = None

    def _try_open(self) -> bool:
        cap = self._opener()
        if cap is not None and cap.isOpened():
            self._cap = cap
            fps = float(cap.get(cv2.CAP_PROP_FPS) or 0.0)
            if math.isfinite(fps) and fps > 0:
                self.fps = fps
            return True
        if cap is not None:
            cap.release()
        return False

    def open(self) -> None:
        """Open the source, retrying with backoff for live sources; ``SourceError`` when it never opens."""
        if not self._custom_opener and not self.live and not Path(str(self.source)).exists():
            raise FileNotFoundError(f"video source {self.source} does not exist")
        if self._try_open():
            return
        if self.live and self._reopen():
            return
        raise SourceError(
            f"cannot open video source {self.source!r}"
            + (f" after {self.policy.tries} retries" if self.live else "")
            + ": check the camera index / file path / URL (and that OpenCV was built with FFmpeg for files and streams)"
        )

    def _reopen(self) -> bool:
        """Backoff loop; True when the source is back."""
        self.close()
        for attempt, delay in enumerate(self.policy.delays(), start=1):
            log.warning("source %r unavailable: retry %d/%d in %.2f s", self.source, attempt, self.policy.tries, delay)
            self._sleep(delay)
            if self._try_open():
                return True
        return False

    def frames(self) -> Iterator[tuple[int, np.ndarray, float]]:
        """Yield frames until the end of a file, or until a live source stays away past the policy."""
        if self._cap is None:
            self.open()
        bad_run = 0
        while True:
            ok, frame = self._cap.read()
            if ok and _valid_frame(frame):
                bad_run = 0
                pos_ms = float(self._cap.get(cv2.CAP_PROP_POS_MSEC) or 0.0)
                index = self.frames_read
                self.frames_read += 1
                yield index, frame, pos_ms
                continue
            if ok:  # decoded something unusable
                self.bad_frames += 1
                bad_run += 1
                log.debug("skipping unusable frame (%s)", None if frame is None else getattr(frame, "shape", None))
                if bad_run <= self.max_bad_frames:
                    continue
            if self.live:
                log.warning("source %r stopped delivering frames: reconnecting", self.source)
                if self._reopen():
                    self.reconnects += 1
                    bad_run = 0
                    continue
                self.lost = True
                log.error("source %r did not come back after %d tries; stopping", self.source, self.policy.tries)
                return
            if self._file_has_more() and bad_run < self.max_bad_frames:
                self.bad_frames += 1
                bad_run += 1
                continue
            return  # end of file

    def _file_has_more(self) -> bool:
        total = float(self._cap.get(cv2.CAP_PROP_FRAME_COUNT) or 0.0)
        pos = float(self._cap.get(cv2.CAP_PROP_POS_FRAMES) or 0.0)
        return total > 0 and pos < total - 1


def _valid_frame(frame: Any) -> bool:
    return (
        isinstance(frame, np.ndarray)
        and frame.dtype == np.uint8
        and frame.ndim in (2, 3)
        and frame.shape[0] > 0
        and frame.shape[1] > 0
    )


# ---------------------------------------------------------------------------
# person box
# ---------------------------------------------------------------------------


MAX_ROI_COORD = 1_000_000.0  # px: larger than any camera frame


def parse_roi(value: str | None) -> tuple[float, float, float, float] | None:
    """``"x,y,w,h"`` -> tuple (None passes through)."""
    if value is None:
        return None
    try:
        x, y, w, h = (float(v) for v in value.split(","))
    except ValueError as err:
        raise ValueError(f"--roi must be x,y,w,h in pixels (e.g. 40,60,200,120), got {value!r}") from err
    if not all(math.isfinite(v) and abs(v) <= MAX_ROI_COORD for v in (x, y, w, h)):
        raise ValueError(f"--roi values must be finite pixel coordinates of at most {MAX_ROI_COORD}, got {value!r}")
    if w <= 0 or h <= 0 or x < 0 or y < 0:
        raise ValueError(f"--roi needs x, y >= 0 and w, h > 0, got {value!r}")
    return x, y, w, h


class BoxTracker:
    """Where to crop the next frame: ROI first, then the previous keypoints (smoothed), ROI again when lost.

    smoothing: weight of the previous box in the exponential moving average of
    centre and size (0 = follow the keypoints exactly).
    min_fraction: the box side never drops below this fraction of the frame's
    shorter side (and 16 px), so a model that collapses its keypoints onto one
    spot cannot shrink the crop to nothing.
    """

    def __init__(
        self,
        roi: tuple[float, float, float, float] | None,
        *,
        threshold: float,
        min_points: int = 4,
        smoothing: float = 0.3,
        padding: float = BOX_PADDING,
        min_fraction: float = 0.08,
    ) -> None:
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
        if not 0.0 <= min_fraction < 1.0:
            raise ValueError(f"min_fraction must be in [0, 1), got {min_fraction}")
        self.roi = roi
        self.threshold = threshold
        self.min_points = min_points
        self.smoothing = smoothing
        self.padding = padding
        self.min_fraction = min_fraction
        self._box: np.ndarray | None = None
        self.source = "roi" if roi is not None else "full"
        self.lost_count = 0

    def fallback(self, frame_size: tuple[int, int]) -> tuple[np.ndarray, str]:
        if self.roi is not None:
            x, y, _, _ = self.roi
            h, w = frame_size
            if x >= w or y >= h:
                raise ValueError(f"--roi {','.join(f'{v:g}' for v in self.roi)} lies outside the {w}x{h} frame "
                                 "(x, y must be inside it)")
            return np.array(self.roi, dtype=np.float64), "roi"
        h, w = frame_size
        return np.array([0.0, 0.0, float(w), float(h)]), "full"

    def box(self, frame_size: tuple[int, int]) -> tuple[np.ndarray, str]:
        """(x, y, w, h) to crop this frame and where it came from ("roi", "full" or "track")."""
        if self._box is None:
            return self.fallback(frame_size)
        return clip_box(self._box, frame_size, min_side=self._min_side(frame_size)), "track"

    def _min_side(self, frame_size: tuple[int, int]) -> float:
        return max(16.0, self.min_fraction * min(frame_size))

    def update(self, keypoints: np.ndarray, scores: np.ndarray, frame_size: tuple[int, int]) -> None:
        measured = box_from_keypoints(
            keypoints, scores, threshold=self.threshold, min_points=self.min_points, padding=self.padding
        )
        if measured is None:
            if self._box is not None:
                log.debug("tracking lost (fewer than %d keypoints >= %.3f): back to the ROI", self.min_points,
                          self.threshold)
                self.lost_count += 1
            self._box = None
            return
        measured = clip_box(measured, frame_size, min_side=self._min_side(frame_size))
        if self._box is None or self.smoothing == 0.0:
            self._box = measured
            return
        a = self.smoothing
        prev_c = self._box[:2] + self._box[2:] / 2.0
        new_c = measured[:2] + measured[2:] / 2.0
        center = a * prev_c + (1.0 - a) * new_c
        size = a * self._box[2:] + (1.0 - a) * measured[2:]
        self._box = np.concatenate([center - size / 2.0, size])


# ---------------------------------------------------------------------------
# drawing
# ---------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------
# pipeline
# ---------------------------------------------------------------------------


_COLOR_WORDS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False,
                "off": False}


def parse_pixelize(value: str | None) -> tuple[Any, bool] | None:
    """``"eps=0.5,b=16,m=16,n=4[,noise=laplace][,color=1]"`` -> (PixelizeSpec, color) or None."""
    if value is None:
        return None
    from edge.pixelize import PixelizeSpec

    fields: dict[str, str] = {}
    for part in value.split(","):
        if "=" not in part:
            raise ValueError(f"--pixelize entries must be key=value (eps=..,b=..,m=..,n=..), got {part!r}")
        key, val = (s.strip() for s in part.split("=", 1))
        if key in fields:
            raise ValueError(f"--pixelize {value!r}: {key} is given twice")
        fields[key] = val
    unknown = set(fields) - {"eps", "b", "m", "n", "noise", "color"}
    if unknown:
        raise ValueError(f"--pixelize: unknown keys {sorted(unknown)}; use eps, b, m, n, noise, color")
    missing = {"eps", "b", "m"} - set(fields)
    if missing:
        raise ValueError(f"--pixelize needs {sorted(missing)} (e.g. eps=0.5,b=16,m=16,n=4)")
    try:
        spec = PixelizeSpec(
            eps=float(fields["eps"]),
            b=int(fields["b"]),
            m=int(fields["m"]),
            n=int(fields.get("n", "1")),
            noise=fields.get("noise", "discrete"),
        )
    except ValueError as err:
        raise ValueError(f"--pixelize {value!r}: {err}") from err
    word = fields.get("color", "0").lower()
    if word not in _COLOR_WORDS:
        raise ValueError(f"--pixelize {value!r}: color must be one of {sorted(_COLOR_WORDS)}, got {word!r}")
    color = _COLOR_WORDS[word]
    return spec, color


@dataclass(frozen=True)
class PipelineOptions:
    """What the camera pipeline does besides inference."""

    out_dir: Path
    roi: tuple[float, float, float, float] | None = None
    max_frames: int | None = None
    write_video: bool = False
    show: bool = False
    # With pixelize: draw the raw frame's skeleton and person box over the published (video/--show) frames.
    # Off by default: the overlay releases raw-derived keypoints in the video; the claim names it when on.
    overlay: bool = False
    pixelize: Any = None  # edge.pixelize.PixelizeSpec or None
    pixelize_color: bool = False
    score_threshold: float = 0.05
    min_keypoints: int = 4
    smoothing: float = 0.3
    seed: int | None = None  # pixelization noise; None = OS entropy (production, DESIGN P7)
    # External person box (x, y, w, h) per frame index, e.g. from a detector or a demo clip's ground truth;
    # it replaces the tracker for that frame (box_source "external"), None falls back to the tracker.
    boxes: Callable[[int], Any] | None = None

    def __post_init__(self) -> None:
        if self.max_frames is not None and self.max_frames < 1:
            raise ValueError(f"--max-frames must be >= 1, got {self.max_frames}")
        if not 0.0 <= self.score_threshold <= 1.0:
            raise ValueError(f"score threshold must be in [0, 1], got {self.score_threshold}")


@dataclass
class PipelineReport:
    """What a run did; ``summary()`` is what the CLI prints."""

    frames: int = 0
    bad_frames: int = 0
    reconnects: int = 0
    source_lost: bool = False
    seconds: float = 0.0
    latencies_ms: list[float] = field(default_factory=list)
    track_lost: int = 0
    empty_masks: int = 0  # pixelized frames with no keypoint above the score threshold (coarse grid everywhere)
    keypoints_path: Path | None = None
    video_path: Path | None = None
    pixelized_dir: Path | None = None
    overlay: bool = False
    claim: str | None = None

    @property
    def fps(self) -> float:
        return self.frames / self.seconds if self.seconds > 0 else 0.0

    def latency(self, q: float) -> float:
        return float(np.percentile(self.latencies_ms, q)) if self.latencies_ms else math.nan

    def summary(self) -> str:
        lines = [
            f"frames: {self.frames} ({self.bad_frames} unreadable skipped, {self.reconnects} reconnects"
            + (", source lost" if self.source_lost else "") + ")",
            f"throughput: {self.fps:.1f} FPS end to end over {self.seconds:.2f} s",
            f"latency (preprocess + infer + postprocess): p50 {self.latency(50):.2f} ms, "
            f"p95 {self.latency(95):.2f} ms",
        ]
        if self.keypoints_path:
            lines.append(f"keypoints: {self.keypoints_path}")
        if self.video_path:
            lines.append(f"video: {self.video_path}")
        if self.pixelized_dir:
            lines.append(f"pixelized frames (NPZ, restore with `fedpose edge restore`): {self.pixelized_dir}")
            if self.empty_masks:
                lines.append(f"body mask empty on {self.empty_masks} of {self.frames} frames (no keypoint above the "
                             "score threshold): those frames are pixelized with the coarse grid everywhere")
        return "\n".join(lines)


def run_pipeline(runtime: Any, source: FrameSource, options: PipelineOptions) -> PipelineReport:
    """Run the camera loop until the source ends, is lost, or ``max_frames`` frames are done.

    Writes ``keypoints.jsonl`` (one JSON object per frame: frame, timestamp
    (Unix s), pos_ms (source position), box [x, y, w, h], box_source,
    keypoints 16 x [x, y, score], latency_ms), and optionally the annotated
    video and the pixelized NPZ frames. Returns the run's report.
    """
    out_dir = Path(options.out_dir)
    report = PipelineReport(keypoints_path=out_dir / KEYPOINTS_FILE)
    tracker = BoxTracker(
        options.roi, threshold=options.score_threshold, min_points=options.min_keypoints, smoothing=options.smoothing
    )
    rng = None
    if options.pixelize is not None:
        rng = np.random.default_rng(options.seed)  # OS entropy unless seeded (DESIGN P7)
        if options.seed is not None:
            log.warning("pixelization noise seeded with %d: reproducible, NOT for production", options.seed)
    if options.show:
        _check_gui()

    writer = None
    t_start = time.perf_counter()
    try:
        source.open()  # before creating any output: an unopenable source leaves nothing behind
        t_start = time.perf_counter()
        out_dir.mkdir(parents=True, exist_ok=True)
        if options.pixelize is not None:
            report.pixelized_dir = out_dir / PIXELIZED_DIR
            report.pixelized_dir.mkdir(exist_ok=True)
        with open(report.keypoints_path, "w", buffering=1) as jsonl:
            for index, frame, pos_ms in source.frames():
                if frame.ndim == 2:
                    frame = cv2.cvtColor(frame, cv2.COLOR_GRAY2BGR)
                size = (frame.shape[0], frame.shape[1])
                t0 = time.perf_counter()
                box, box_source = _external_box(options.boxes, index, size) or tracker.box(size)
                batch, mats = preprocess(frame, box[None], runtime.input_size)
                sx, sy = runtime.infer(batch)
                kps, scores = postprocess(sx, sy, mats, runtime.input_size)
                latency = (time.perf_counter() - t0) * 1000.0
                tracker.update(kps[0], scores[0], size)
                report.latencies_ms.append(latency)
                record = _frame_record(index, pos_ms, box, box_source, kps[0], scores[0], latency)
                jsonl.write(json.dumps(record) + "\n")

                published = frame
                if options.pixelize is not None:
                    published, empty = _pixelize_frame(frame, kps[0], scores[0], options, rng, report.pixelized_dir, index)
                    report.empty_masks += int(empty)
                if options.write_video or options.show:
                    if options.pixelize is None or options.overlay:
                        annotated = draw_skeleton(published, kps[0], scores[0], threshold=options.score_threshold,
                                                  box=box)
                    else:
                        annotated = published  # the DP release alone: nothing from the raw frame drawn on it
                    if options.write_video:
                        if writer is None:
                            report.video_path = out_dir / VIDEO_FILE
                            writer = _open_writer(report.video_path, source.fps or 25.0, size)
                        writer.write(annotated)
                    if options.show:
                        cv2.imshow("fedpose edge", annotated)
                        if cv2.waitKey(1) & 0xFF == ord("q"):
                            break
                report.frames += 1
                if options.max_frames is not None and report.frames >= options.max_frames:
                    break
    finally:
        report.seconds = time.perf_counter() - t_start
        if writer is not None:
            writer.release()
        source.close()
        if options.show:
            cv2.destroyAllWindows()
    report.bad_frames = source.bad_frames
    report.reconnects = source.reconnects
    report.source_lost = source.lost
    report.track_lost = tracker.lost_count
    report.overlay = options.overlay and options.pixelize is not None
    if options.pixelize is not None:
        report.claim = release_claim(
            options.pixelize,
            frames=max(1, report.frames),
            keypoints_file=report.keypoints_path.name if report.keypoints_path else None,
            video_file=report.video_path.name if report.video_path else None,
            shown=options.show,
            overlay=options.overlay,
        )
    log.info("pipeline done: %d frames, %.1f FPS", report.frames, report.fps)
    return report


def release_claim(
    spec: Any,
    *,
    frames: int,
    keypoints_file: str | None,
    video_file: str | None,
    shown: bool = False,
    overlay: bool = False,
) -> str:
    """The printed edge claim of a pixelized run: the DP statement, then every output the run released.

    DESIGN 4b: the camera viewer may learn only what this lists. The pixelized
    frames are covered by ``pixelize_claim`` (eps per frame, F*eps over the
    clip, the region mask NOT protected); everything else written is computed
    from the raw frames and is named here as NOT protected by that guarantee.
    """
    from edge.pixelize import pixelize_claim

    lines = [
        pixelize_claim(spec, mask_source="keypoints", frames=frames),
        "Released by this run (a viewer of these outputs may learn all of it):",
        f"- {PIXELIZED_DIR}/frame_*.npz: the DP-pixelized frames (noisy cell means, {spec.eps:g}-DP per frame, "
        f"{frames * spec.eps:g} over F={frames} frames) and the cell layout, i.e. the region mask, which is "
        "derived from the raw frame's keypoints and NOT protected.",
    ]
    if keypoints_file:
        lines.append(
            f"- {keypoints_file}: per frame the 16 keypoints (x, y, score), the person box and its source, "
            "timestamps and latency, computed from the raw frames: NOT protected by the pixelization guarantee "
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


def _external_box(
    boxes: Callable[[int], Any] | None, index: int, frame_size: tuple[int, int]
) -> tuple[np.ndarray, str] | None:
    """The caller's box for this frame (kept inside the frame like a tracked one), or None."""
    if boxes is None:
        return None
    box = boxes(index)
    if box is None:
        return None
    arr = np.asarray(box, dtype=np.float64).reshape(-1)
    if arr.shape != (4,) or not np.isfinite(arr).all() or arr[2] <= 0 or arr[3] <= 0:
        raise ValueError(f"external box for frame {index} must be finite (x, y, w, h) with w, h > 0, got {box!r}")
    return clip_box(arr, frame_size), "external"


def _frame_record(
    index: int, pos_ms: float, box: np.ndarray, box_source: str, kps: np.ndarray, scores: np.ndarray, latency: float
) -> dict[str, Any]:
    joints = [[round(float(x), 2), round(float(y), 2), round(float(s), 4)] for (x, y), s in zip(kps, scores)]
    return {
        "frame": index,
        "timestamp": round(time.time(), 4),
        "pos_ms": round(pos_ms, 2),
        "box": [round(float(v), 2) for v in box],
        "box_source": box_source,
        "keypoints": joints,
        "latency_ms": round(latency, 3),
    }


def _pixelize_frame(
    frame: np.ndarray, kps: np.ndarray, scores: np.ndarray, options: PipelineOptions, rng: Any, out: Path, index: int
) -> tuple[np.ndarray, bool]:
    """DP-pixelize the frame with a body mask from this frame's keypoints.

    Returns the BGR image to publish and whether the body mask was empty.
    """
    from edge.pixelize import body_mask_from_keypoints, pixelize, save_npz

    image = frame if options.pixelize_color else cv2.cvtColor(frame, cv2.COLOR_BGR2GRAY)
    mask = body_mask_from_keypoints(frame.shape[:2], kps, scores, score_threshold=options.score_threshold)
    released = pixelize(image, options.pixelize, mask=mask, rng=rng)
    save_npz(released, out / f"frame_{index:06d}.npz")
    rendered = released.render()
    bgr = rendered if rendered.ndim == 3 else cv2.cvtColor(rendered, cv2.COLOR_GRAY2BGR)
    return bgr, not mask.any()


def _open_writer(path: Path, fps: float, size: tuple[int, int]) -> Any:
    h, w = size
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), float(fps), (int(w), int(h)))
    if not writer.isOpened():
        raise RuntimeError(f"OpenCV cannot write {path} with the mp4v codec")
    return writer


def _check_gui() -> None:
    try:
        cv2.namedWindow("fedpose edge", cv2.WINDOW_NORMAL)
    except cv2.error as err:
        raise ValueError(
            "--show needs OpenCV with GUI support; opencv-python-headless has none "
            "(pip install opencv-python on a machine with a display) or drop --show"
        ) from err
