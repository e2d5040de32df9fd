"""The person box without a detector (rtmlib's PoseTracker idea): the ROI first, then the padded,
smoothed box around the previous frame's confident keypoints; back to the ROI when tracking is lost.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from edge.prepost import BOX_PADDING, box_from_keypoints, clip_box

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
        if self.roi is not None:
            self.check_roi(frame_size)
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
