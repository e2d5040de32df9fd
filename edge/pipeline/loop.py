"""The camera loop: source -> person box -> preprocess -> runtime.infer -> postprocess -> outputs.

``run_pipeline`` opens the source and the outputs, hands every frame to ``process_frame`` and finalises the
report. ``process_frame`` takes one frame through its phases, in this order: read (grayscale to BGR), infer
(the person box, the crop, the runtime, keypoints in frame pixels), track (the tracker and the run's counts),
record (its keypoints.jsonl line), pixelize (the DP release, within ``max_eps``), write (the annotated video
and the ``show`` window).
"""

from __future__ import annotations

import itertools
import json
import logging
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from fedpose.edge.pipeline.options import PipelineOptions, PipelineReport
from fedpose.edge.pipeline.outputs import (
    KEYPOINTS_FILE,
    PIXELIZED_DIR,
    VIDEO_FILE,
    check_gui,
    draw_skeleton,
    frame_record,
    open_writer,
    pixelize_frame,
    release_claim,
)
from fedpose.edge.pipeline.source import FrameSource
from fedpose.edge.pipeline.tracking import BoxTracker, external_box
from fedpose.edge.runtime.prepost import face_to_frame, postprocess, preprocess
from fedpose.shared.model.face_decode import decode_face

log = logging.getLogger(__name__)


SUMMARY_FILE = "summary.json"


class _StopOnSignal:
    """SIGINT and SIGTERM end the loop after the current frame (the outputs are then finalised as at the end of
    the source); ``restore`` puts the previous handlers back. Only the main thread can take signals."""

    def __init__(self) -> None:
        self.signal: str | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._stop)

    def _stop(self, signum: int, _frame: Any) -> None:
        self.signal = signal.Signals(signum).name
        log.warning("%s: stopping after this frame", self.signal)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


@dataclass
class CameraRun:
    """What the frames of one run share: the runtime, the source and the options, the tracker, the report being
    filled, the pixelization noise and the open outputs."""

    runtime: Any
    source: FrameSource
    options: PipelineOptions
    report: PipelineReport
    tracker: BoxTracker
    rng: np.random.Generator | None = None  # pixelization noise; None without ``pixelize``
    jsonl: Any = None  # the open keypoints.jsonl
    writer: Any = None  # the annotated video, opened with its first frame
    predicted: list[np.ndarray] = field(default_factory=list)  # (16, 2) per frame, when there is ground truth
    low_run: int = 0  # frames in a row with low keypoint confidence


@dataclass(frozen=True)
class FramePose:
    """One frame's inference: the box it was cropped at and where that came from, its keypoints (K, 2) in frame
    pixels and their scores (K,), the face outputs when the model has face tasks, and the latency."""

    box: np.ndarray
    box_source: str
    keypoints: np.ndarray
    scores: np.ndarray
    face: dict[str, Any] | None
    latency_ms: float


def run_pipeline(runtime: Any, source: FrameSource, options: PipelineOptions) -> PipelineReport:
    """Run the camera loop until the source ends, is lost, ``max_frames`` frames are done, or SIGINT/SIGTERM.

    Writes ``keypoints.jsonl`` (one JSON object per frame: frame, timestamp
    (Unix s), pos_ms (source position), box [x, y, w, h], box_source,
    keypoints 16 x [x, y, score], latency_ms, and face when the model has face tasks:
    ``fedpose.edge.runtime.prepost.face_to_frame``), optionally the annotated
    video and the pixelized frames (until ``max_eps`` is reached), and
    ``summary.json``. Returns the run's report.
    """
    out_dir = Path(options.out_dir)
    report = PipelineReport(keypoints_path=out_dir / KEYPOINTS_FILE)
    tracker = BoxTracker(
        options.roi, threshold=options.score_threshold, min_points=options.min_keypoints, smoothing=options.smoothing
    )
    run = CameraRun(runtime, source, options, report, tracker, rng=_noise_rng(options))
    if options.show:
        check_gui()

    t_start = time.perf_counter()
    stop = _StopOnSignal()
    try:
        stop.install()
        source.open()  # before creating any output: an unopenable source leaves nothing behind
        t_start = time.perf_counter()
        frames = source.frames()
        first = next(frames, None)
        if first is not None:  # a wrong ROI is refused before anything is written
            tracker.check_roi(first[1].shape[:2])
        out_dir.mkdir(parents=True, exist_ok=True)
        if options.pixelize is not None:
            report.pixelized_dir = out_dir / PIXELIZED_DIR
            report.pixelized_dir.mkdir(exist_ok=True)
        with open(report.keypoints_path, "w", buffering=1) as jsonl:
            run.jsonl = jsonl
            for index, frame, pos_ms in itertools.chain([first] if first is not None else [], frames):
                if stop.signal is not None:
                    break
                if not process_frame(run, index, frame, pos_ms):
                    break
                if options.max_frames is not None and report.frames >= options.max_frames:
                    break
    finally:
        stop.restore()
        report.stopped_by = stop.signal
        report.seconds = time.perf_counter() - t_start
        if run.writer is not None:
            run.writer.release()
        source.close()
        if options.show:
            cv2.destroyAllWindows()
    _finish(run)
    return report


def _noise_rng(options: PipelineOptions) -> np.random.Generator | None:
    """The pixelization noise: OS entropy unless seeded (DESIGN P7); None without ``pixelize``."""
    if options.pixelize is None:
        return None
    rng = np.random.default_rng(options.seed)
    if options.seed is not None:
        log.warning("pixelization noise seeded with %d: reproducible, NOT for production", options.seed)
    return rng


def process_frame(run: CameraRun, index: int, frame: np.ndarray, pos_ms: float) -> bool:
    """Take one frame of the source through every phase; False when the viewer pressed q (the run stops)."""
    frame = _read(frame)
    size = (frame.shape[0], frame.shape[1])
    pose = _infer(run, index, frame, size)
    _track(run, pose, size)
    _record(run, index, pos_ms, pose)
    published = _pixelize(run, index, frame, pose)
    if not _write(run, published, pose, size):
        return False
    run.report.frames += 1
    return True


def _read(frame: np.ndarray) -> np.ndarray:
    """The source's frame as BGR (a grayscale camera's frames are replicated to 3 channels)."""
    return cv2.cvtColor(frame, cv2.COLOR_GRAY2BGR) if frame.ndim == 2 else frame


def _infer(run: CameraRun, index: int, frame: np.ndarray, size: tuple[int, int]) -> FramePose:
    """The person box (the caller's, else the tracker's), the crop, the runtime and the keypoints in frame
    pixels; the latency is the time all of that took."""
    runtime, tracker = run.runtime, run.tracker
    t0 = time.perf_counter()
    tracker.see(frame)
    box, box_source = external_box(run.options.boxes, index, size) or tracker.box(size)
    batch, mats = preprocess(frame, box[None], runtime.input_size)
    face = None
    if runtime.face_outputs:
        outs = runtime.infer_all(batch)
        sx, sy = outs["simcc_x"], outs["simcc_y"]
        face = face_to_frame(decode_face(outs, input_size=runtime.input_size), mats)[0]
    else:
        sx, sy = runtime.infer(batch)
    kps, scores = postprocess(sx, sy, mats, runtime.input_size)
    latency = (time.perf_counter() - t0) * 1000.0
    return FramePose(box, box_source, kps[0], scores[0], face, latency)


def _track(run: CameraRun, pose: FramePose, size: tuple[int, int]) -> None:
    """Feed the keypoints to the tracker and count the frame: its box source, its latency, and low confidence
    (warned about once a run of such frames reaches ``low_confidence_warn``)."""
    options, report = run.options, run.report
    run.tracker.update(pose.keypoints, pose.scores, size)
    report.box_sources[pose.box_source] = report.box_sources.get(pose.box_source, 0) + 1
    if options.truth is not None:
        run.predicted.append(pose.keypoints)
    if int((pose.scores >= options.score_threshold).sum()) * 2 < len(pose.scores):
        report.low_confidence += 1
        run.low_run += 1
        if run.low_run == options.low_confidence_warn:
            log.warning("keypoint confidence has stayed low for %d frames (fewer than half the joints "
                        ">= %.3f): the keypoints are unreliable", run.low_run, options.score_threshold)
    else:
        run.low_run = 0
    report.latencies_ms.append(pose.latency_ms)


def _record(run: CameraRun, index: int, pos_ms: float, pose: FramePose) -> None:
    """The frame's line of keypoints.jsonl."""
    record = frame_record(index, pos_ms, pose.box, pose.box_source, pose.keypoints, pose.scores, pose.latency_ms,
                          pose.face)
    run.jsonl.write(json.dumps(record) + "\n")


def _pixelize(run: CameraRun, index: int, frame: np.ndarray, pose: FramePose) -> np.ndarray | None:
    """The frame to publish: the raw frame without ``pixelize``, else its DP release (written to the pixelized
    folder), or None once ``max_eps`` is spent."""
    options, report = run.options, run.report
    spec = options.pixelize
    if spec is None:
        return frame
    if options.max_eps is not None and (report.released + 1) * spec.eps > options.max_eps * (1 + 1e-9):
        if report.budget_stop is None:
            report.budget_stop = index
            log.warning("--max-eps %g reached after %d released frames: no more pixelized frames "
                        "(keypoints go on)", options.max_eps, report.released)
        return None  # nothing of this frame may be shown: its release is not paid for
    published, empty = pixelize_frame(frame, pose.keypoints, pose.scores, options, run.rng, report.pixelized_dir,
                                      index)
    report.empty_masks += int(empty)
    report.released += 1
    return published


def _write(run: CameraRun, published: np.ndarray | None, pose: FramePose, size: tuple[int, int]) -> bool:
    """The published frame to the annotated video and the ``show`` window; False when the viewer pressed q."""
    options, report = run.options, run.report
    if published is None or not (options.write_video or options.show):
        return True
    if options.pixelize is None or options.overlay:
        annotated = draw_skeleton(published, pose.keypoints, pose.scores, threshold=options.score_threshold,
                                  box=pose.box)
    else:
        annotated = published  # the DP release alone: nothing from the raw frame drawn on it
    if options.write_video:
        if run.writer is None:
            report.video_path = Path(options.out_dir) / VIDEO_FILE
            run.writer = open_writer(report.video_path, run.source.fps or 25.0, size)
        run.writer.write(annotated)
    if options.show:
        cv2.imshow("fedpose edge", annotated)
        if cv2.waitKey(1) & 0xFF == ord("q"):
            return False
    return True


def _finish(run: CameraRun) -> None:
    """The report's counts from the source and the tracker, the accuracy against the ground truth, the release
    claim, and summary.json."""
    runtime, source, options, report, tracker = run.runtime, run.source, run.options, run.report, run.tracker
    report.bad_frames = source.bad_frames
    report.reconnects = source.reconnects
    report.source_lost = source.lost
    report.track_lost = tracker.lost_count
    report.reacquired = tracker.reacquired
    if options.truth is not None and run.predicted:
        from fedpose.edge.pipeline.accuracy import pck_against_truth

        report.accuracy = {"truth": str(options.truth.get("path", "")),
                           **pck_against_truth(np.array(run.predicted), options.truth["joints"],
                                               options.truth["visible"])}
    report.overlay = options.overlay and options.pixelize is not None
    if options.pixelize is not None:
        report.claim = release_claim(
            options.pixelize,
            frames=max(1, report.released),
            keypoints_file=report.keypoints_path.name if report.keypoints_path else None,
            video_file=report.video_path.name if report.video_path else None,
            shown=options.show,
            overlay=options.overlay,
            store=options.store,
            face_outputs=tuple(runtime.face_outputs),
        )
    out_dir = Path(options.out_dir)
    if out_dir.is_dir():
        (out_dir / SUMMARY_FILE).write_text(json.dumps(report.to_dict(), indent=1) + "\n")
    log.info("pipeline done: %d frames, %.1f FPS", report.frames, report.fps)
