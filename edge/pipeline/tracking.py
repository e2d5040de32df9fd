"""The person box without a detector (rtmlib's PoseTracker idea, plus a fixed camera's motion cue): the
padded, smoothed box around the previous frame's confident keypoints; what moves (``MotionFinder``) when
tracking is lost, collapsed or has left the moving person; the ROI or the full frame when nothing is known.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from fedpose.edge.runtime.prepost import BOX_PADDING, box_from_keypoints, clip_box

log = logging.getLogger(__name__)



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


class MotionFinder:
    """Where something moves in a fixed camera's view: OpenCV's MOG2 background model on a downscaled frame.

    A weak pose model cannot find the person by itself: on a crop that misses the person its keypoints
    cluster near the crop's middle, the next box from them is smaller, and the tracker collapses (issue 42:
    a 15 px box on a 320x240 clip, median error 118 px). A ward camera does not move, so the person is
    what differs from the learned background; ``box`` is the square person box around the robust extent
    (2nd to 98th percentile) of the foreground pixels, or None while too little (a still scene, the first
    frame) or too much (the camera moved, the light changed) of the frame differs.
    """

    def __init__(self, *, max_side: int = 160, history: int = 300, min_area: float = 0.01, max_area: float = 0.6,
                 padding: float = 1.15) -> None:
        import cv2

        self._mog = cv2.createBackgroundSubtractorMOG2(history=history, varThreshold=25, detectShadows=False)
        self._kernel = np.ones((3, 3), np.uint8)
        self.max_side = max_side
        self.min_area = min_area
        self.max_area = max_area
        self.padding = padding
        self.frames = 0

    def box(self, frame: np.ndarray) -> np.ndarray | None:
        """Learn this (H, W[, 3]) uint8 frame and return the moving person's (x, y, w, h) box or None."""
        import cv2

        h, w = frame.shape[:2]
        f = min(1.0, self.max_side / max(h, w))
        small = cv2.resize(frame, (max(1, round(w * f)), max(1, round(h * f))), interpolation=cv2.INTER_AREA)
        mask = cv2.morphologyEx(self._mog.apply(small), cv2.MORPH_OPEN, self._kernel)
        self.frames += 1
        if self.frames == 1:
            return None  # the first frame is the background's first guess: nothing can differ yet
        ys, xs = np.nonzero(mask)
        if not self.min_area * mask.size <= len(xs) <= self.max_area * mask.size:
            return None
        lo = np.array([np.percentile(xs, 2), np.percentile(ys, 2)]) / f
        hi = np.array([np.percentile(xs, 98) + 1, np.percentile(ys, 98) + 1]) / f
        side = float((hi - lo).max()) * self.padding
        cx, cy = (lo + hi) / 2.0
        return np.array([cx - side / 2.0, cy - side / 2.0, side, side], dtype=np.float64)


def box_iou(a: np.ndarray, b: np.ndarray) -> float:
    """Intersection over union of two (x, y, w, h) boxes."""
    x0, y0 = max(a[0], b[0]), max(a[1], b[1])
    x1, y1 = min(a[0] + a[2], b[0] + b[2]), min(a[1] + a[3], b[1] + b[3])
    inter = max(0.0, x1 - x0) * max(0.0, y1 - y0)
    union = a[2] * a[3] + b[2] * b[3] - inter
    return float(inter / union) if union > 0 else 0.0


class BoxTracker:
    """Where to crop the next frame: the previous keypoints when they are confident, the moving person when
    they are not (or when they left it), else the ROI (or the full frame).

    Order for each frame (``box``), with ``see(frame)`` called first so the motion cue is current:
    - "track": the padded, smoothed box around the previous frame's confident keypoints, as long as it
      still overlaps what moves (IoU >= ``min_motion_iou`` with the motion box, when there is one);
    - "motion": the box around what moves (``MotionFinder``), when tracking is lost, collapsed or has left
      the moving person (a re-acquisition, counted in ``reacquired``);
    - "hold": the last motion box, for a person who stopped moving;
    - "roi" / "full": nothing else known yet.

    Tracking is lost when fewer than ``min_points`` keypoints reach ``threshold`` or when the box from
    them is smaller than ``min_fraction`` of the frame's shorter side (a model whose keypoints collapse
    onto one spot): the box is dropped, never kept at a minimum size.

    smoothing: weight of the previous box in the exponential moving average of centre and size (0 =
    follow the keypoints exactly).

    min_motion_iou: 0.7. A model whose keypoints shrink onto part of the body makes each next crop smaller;
    at 0.5 such a track stayed on 36 of the demo clip's 120 frames while covering less than half of the
    person. Measured on three demo clips (seeds 0, 1, 2; the choice was made on seed 0): the main command's
    model went from 0.573 / 0.533 / 0.517 to 0.649 / 0.612 / 0.601 PCK@0.2, the public-pretrained one
    moved by +0.002 / +0.001 / -0.014.
    """

    def __init__(
        self,
        roi: tuple[float, float, float, float] | None,
        *,
        threshold: float,
        min_points: int = 4,
        smoothing: float = 0.3,
        padding: float = BOX_PADDING,
        min_fraction: float = 0.1,
        min_motion_iou: float = 0.7,
        motion: bool = True,
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
        self.min_motion_iou = min_motion_iou
        self._motion = MotionFinder() if motion else None
        self._moving: np.ndarray | None = None  # this frame's motion box
        self._held: np.ndarray | None = None  # the last motion box seen
        self._box: np.ndarray | None = None
        self.source = "roi" if roi is not None else "full"
        self.lost_count = 0
        self.reacquired = 0

    def check_roi(self, frame_size: tuple[int, int]) -> None:
        """Refuse an ROI that reaches past the (H, W) frame: it was set for another camera or resolution, and
        the crop would be partly black border (or all of it), which the model reads as no person."""
        if self.roi is None:
            return
        x, y, rw, rh = self.roi
        h, w = frame_size
        if x + rw <= w + 1e-6 and y + rh <= h + 1e-6:
            return
        text = ",".join(f"{v:g}" for v in self.roi)
        inside = (min(x + rw, w) - x, min(y + rh, h) - y)
        overlap = inside[0] > 0 and inside[1] > 0
        hint = f"; the part inside the frame is --roi {x:g},{y:g},{inside[0]:g},{inside[1]:g}" if overlap else ""
        raise ValueError(f"--roi {text} (x,y,w,h) {'reaches past' if overlap else 'lies outside'} the {h}x{w} (HxW) "
                         f"frame: it needs x + w <= {w} and y + h <= {h}{hint}")

    def fallback(self, frame_size: tuple[int, int]) -> tuple[np.ndarray, str]:
        if self._moving is not None:
            return clip_box(self._moving, frame_size, min_side=self._min_side(frame_size)), "motion"
        if self._held is not None:
            return clip_box(self._held, frame_size, min_side=self._min_side(frame_size)), "hold"
        if self.roi is not None:
            self.check_roi(frame_size)
            return np.array(self.roi, dtype=np.float64), "roi"
        h, w = frame_size
        return np.array([0.0, 0.0, float(w), float(h)]), "full"

    def see(self, frame: np.ndarray) -> None:
        """Update the motion cue with this frame (before ``box``)."""
        if self._motion is None:
            return
        self._moving = self._motion.box(frame)
        if self._moving is not None:
            self._held = self._moving

    def box(self, frame_size: tuple[int, int]) -> tuple[np.ndarray, str]:
        """(x, y, w, h) to crop this frame and where it came from ("track", "motion", "hold", "roi", "full")."""
        if self._box is not None and self._moving is not None and \
                box_iou(self._box, self._moving) < self.min_motion_iou:
            log.debug("the tracked box left what moves (IoU %.2f): re-acquiring", box_iou(self._box, self._moving))
            self._box = None
            self.reacquired += 1
        if self._box is None:
            return self.fallback(frame_size)
        return clip_box(self._box, frame_size, min_side=self._min_side(frame_size)), "track"

    def _min_side(self, frame_size: tuple[int, int]) -> float:
        return max(16.0, self.min_fraction * min(frame_size))

    def update(self, keypoints: np.ndarray, scores: np.ndarray, frame_size: tuple[int, int]) -> None:
        measured = box_from_keypoints(
            keypoints, scores, threshold=self.threshold, min_points=self.min_points, padding=self.padding
        )
        if measured is not None and max(measured[2], measured[3]) < self._min_side(frame_size):
            log.debug("the keypoints collapsed onto a %.0f px box: dropping it", max(measured[2], measured[3]))
            measured = None
        if measured is None:
            if self._box is not None:
                log.debug("tracking lost (fewer than %d keypoints >= %.3f, or collapsed)", self.min_points,
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


def external_box(
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
