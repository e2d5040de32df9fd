"""The camera loop: source -> person box -> preprocess -> runtime.infer -> postprocess -> outputs.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from edge.pipeline.options import PipelineOptions, PipelineReport
from edge.pipeline.outputs import (
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
from edge.pipeline.source import FrameSource
from edge.pipeline.tracking import BoxTracker, _external_box
from edge.prepost import postprocess, preprocess

log = logging.getLogger(__name__)


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
