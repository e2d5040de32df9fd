"""What a pipeline run is asked to do (``PipelineOptions``, ``--pixelize`` parsing) and what it did
(``PipelineReport``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

FRAME_STORES = ("npz", "png", "jpeg")

_COLOR_WORDS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False,
                "off": False}


def parse_pixelize(value: str | None) -> tuple[Any, bool] | None:
    """``"eps=0.5,b=16,m=16,n=4[,noise=laplace][,color=1]"`` -> (PixelizeSpec, color) or None."""
    if value is None:
        return None
    from fedpose.shared.pixelization.spec import PixelizeSpec

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
    pixelize: Any = None  # shared.pixelization.spec.PixelizeSpec or None
    pixelize_color: bool = False
    score_threshold: float = 0.05
    min_keypoints: int = 4
    smoothing: float = 0.3
    seed: int | None = None  # pixelization noise; None = OS entropy (production, DESIGN P7)
    # External person box (x, y, w, h) per frame index, e.g. from a detector or a demo clip's ground truth;
    # it replaces the tracker for that frame (box_source "external"), None falls back to the tracker.
    boxes: Callable[[int], Any] | None = None
    # Stop releasing pixelized frames once their composed epsilon (F x eps over F released frames) would pass
    # this; keypoints go on. None: no limit (the claim states F x eps for whatever was released).
    max_eps: float | None = None
    store: str = "npz"  # how pixelized frames are written: npz (noisy cell means, restorable), png or jpeg
    # Ground truth of the source (a demo clip's sidecar, ``fedpose.edge.pipeline.demo_video.load_truth``): the run is
    # scored against it (PCK@0.2 of the person's height) in the report and summary.json.
    truth: dict[str, Any] | None = None
    # Frames in a row with fewer than half the joints at the score threshold before a warning is logged.
    low_confidence_warn: int = 25

    def __post_init__(self) -> None:
        if self.max_frames is not None and self.max_frames < 1:
            raise ValueError(f"--max-frames must be >= 1, got {self.max_frames}")
        if self.store not in FRAME_STORES:
            raise ValueError(f"--store must be one of {', '.join(FRAME_STORES)}, got {self.store!r}")
        if self.max_eps is not None:
            if self.pixelize is None:
                raise ValueError("--max-eps limits the pixelized frames: it needs --pixelize")
            if not math.isfinite(self.max_eps) or self.max_eps < self.pixelize.eps:
                raise ValueError(f"--max-eps {self.max_eps:g} is below one frame's eps {self.pixelize.eps:g}: no frame "
                                 "could be released")
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
    released: int = 0  # pixelized frames written
    budget_stop: int | None = None  # the frame index from which no frame was released (--max-eps reached)
    stopped_by: str | None = None  # the signal that ended the run (SIGINT, SIGTERM), if one did
    low_confidence: int = 0  # frames with fewer than half the joints at the score threshold
    reacquired: int = 0  # times the tracked box had left what moves and the person was found again
    box_sources: dict[str, int] = field(default_factory=dict)  # frames per box source (track, motion, ...)
    accuracy: dict[str, Any] | None = None  # against the source's ground truth, when it has one

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
        if self.stopped_by:
            lines.append(f"stopped by {self.stopped_by}: outputs finalised")
        if self.box_sources:
            lines.append("person box: " + ", ".join(f"{k} {v}" for k, v in sorted(self.box_sources.items()))
                         + f" frames; {self.reacquired} re-acquisitions")
        if self.frames and self.low_confidence:
            lines.append(f"WARNING: low keypoint confidence on {self.low_confidence} of {self.frames} frames (fewer "
                         "than half the joints at --threshold): keypoints there are unreliable (a weak model, the "
                         "person out of view, or a scene unlike its training data)")
        if self.accuracy:
            a = self.accuracy
            lines.append(f"accuracy vs ground truth {a['truth']}: PCK@0.2 {a['pck@0.2']:.3f} (of the person's height, "
                         f"{a['joints']} joints over {a['frames']} frames), median error {a['median_error_px']:.1f} px "
                         f"(person {a['median_height_px']:.0f} px)")
        if self.pixelized_dir:
            lines.append(f"pixelized frames: {self.released} released in {self.pixelized_dir}")
            if self.budget_stop is not None:
                lines.append(f"--max-eps reached: no frame released from frame {self.budget_stop} on (keypoints go on)")
            if self.empty_masks:
                lines.append(f"body mask empty on {self.empty_masks} of {self.frames} frames (no keypoint above the "
                             "score threshold): those frames are pixelized with the coarse grid everywhere")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """summary.json: what the run did and released."""
        return {"frames": self.frames, "bad_frames": self.bad_frames, "reconnects": self.reconnects,
                "source_lost": self.source_lost, "seconds": round(self.seconds, 3), "fps": round(self.fps, 2),
                "latency_ms": {"p50": self.latency(50), "p95": self.latency(95)} if self.latencies_ms else None,
                "released_frames": self.released, "budget_stop": self.budget_stop, "stopped_by": self.stopped_by,
                "empty_masks": self.empty_masks, "low_confidence_frames": self.low_confidence,
                "reacquired": self.reacquired, "box_sources": self.box_sources, "accuracy": self.accuracy,
                "claim": self.claim}
