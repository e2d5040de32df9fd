"""The camera loop: source -> person box -> preprocess -> runtime.infer -> postprocess -> outputs.
"""

from __future__ import annotations

import itertools
import json
import logging
import signal
import threading
import time
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from fedpose.edge.pipeline.options import PipelineOptions, PipelineReport
from fedpose.edge.pipeline.outputs import (
    KEYPOINTS_FILE,
    PIXELIZED_DIR,
    VIDEO_FILE,
    _check_gui,
    _frame_record,
    _open_writer,
    _pixelize_frame,
    draw_skeleton,
    release_claim,
)
from fedpose.edge.pipeline.source import FrameSource
from fedpose.edge.pipeline.tracking import BoxTracker, _external_box
from fedpose.edge.prepost import face_to_frame, postprocess, preprocess
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


def run_pipeline(runtime: Any, source: FrameSource, options: PipelineOptions) -> PipelineReport:
    """Run the camera loop until the source ends, is lost, ``max_frames`` frames are done, or SIGINT/SIGTERM.

    Writes ``keypoints.jsonl`` (one JSON object per frame: frame, timestamp
    (Unix s), pos_ms (source position), box [x, y, w, h], box_source,
    keypoints 16 x [x, y, score], latency_ms, and face when the model has face tasks:
    ``fedpose.edge.prepost.face_to_frame``), optionally the annotated
    video and the pixelized frames (until ``max_eps`` is reached), and
    ``summary.json``. Returns the run's report.
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
    predicted: list[np.ndarray] = []  # (16, 2) per frame, when there is ground truth to score against
    low_run = 0
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
            for index, frame, pos_ms in itertools.chain([first] if first is not None else [], frames):
                if stop.signal is not None:
                    break
                if frame.ndim == 2:
                    frame = cv2.cvtColor(frame, cv2.COLOR_GRAY2BGR)
                size = (frame.shape[0], frame.shape[1])
                t0 = time.perf_counter()
                tracker.see(frame)
                box, box_source = _external_box(options.boxes, index, size) or tracker.box(size)
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
                tracker.update(kps[0], scores[0], size)
                report.box_sources[box_source] = report.box_sources.get(box_source, 0) + 1
                if options.truth is not None:
                    predicted.append(kps[0])
                if int((scores[0] >= options.score_threshold).sum()) * 2 < len(scores[0]):
                    report.low_confidence += 1
                    low_run += 1
                    if low_run == options.low_confidence_warn:
                        log.warning("keypoint confidence has stayed low for %d frames (fewer than half the joints "
                                    ">= %.3f): the keypoints are unreliable", low_run, options.score_threshold)
                else:
                    low_run = 0
                report.latencies_ms.append(latency)
                record = _frame_record(index, pos_ms, box, box_source, kps[0], scores[0], latency, face)
                jsonl.write(json.dumps(record) + "\n")

                published = frame
                if options.pixelize is not None:
                    spec = options.pixelize
                    if options.max_eps is not None and (report.released + 1) * spec.eps > options.max_eps * (1 + 1e-9):
                        if report.budget_stop is None:
                            report.budget_stop = index
                            log.warning("--max-eps %g reached after %d released frames: no more pixelized frames "
                                        "(keypoints go on)", options.max_eps, report.released)
                        published = None  # nothing of this frame may be shown: its release is not paid for
                    else:
                        published, empty = _pixelize_frame(frame, kps[0], scores[0], options, rng,
                                                           report.pixelized_dir, index)
                        report.empty_masks += int(empty)
                        report.released += 1
                if published is not None and (options.write_video or options.show):
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
        stop.restore()
        report.stopped_by = stop.signal
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
    report.reacquired = tracker.reacquired
    if options.truth is not None and predicted:
        from fedpose.edge.pipeline.accuracy import pck_against_truth

        report.accuracy = {"truth": str(options.truth.get("path", "")),
                           **pck_against_truth(np.array(predicted), options.truth["joints"], options.truth["visible"])}
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
    if out_dir.is_dir():
        (out_dir / SUMMARY_FILE).write_text(json.dumps(report.to_dict(), indent=1) + "\n")
    log.info("pipeline done: %d frames, %.1f FPS", report.frames, report.fps)
    return report
