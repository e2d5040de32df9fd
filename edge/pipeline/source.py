"""Frame sources: OpenCV captures of files, camera indices and stream URLs; a live source that stops
delivering is reopened with exponential backoff (``ReconnectPolicy``), unusable frames are skipped.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cv2
import numpy as np

log = logging.getLogger(__name__)



class SourceError(OSError):
    """The video source cannot be opened (or reopened): a wrong path, camera index or URL, or a dead stream."""


@dataclass(frozen=True)
class ReconnectPolicy:
    """Reopen attempts after a failure: ``tries`` waits of base * 2^i seconds, capped at ``max_delay``.

    ``first_open_s`` bounds the waits before the *first* frame: a camera that was never there (wrong index,
    unplugged, wrong URL) fails within that, with its message, instead of after the whole backoff (24 s with
    the defaults); a service manager restarts the process if the camera is merely slow to come up. The full
    backoff is for a source that delivered and then dropped.
    """

    tries: int = 6
    base_delay: float = 0.5
    max_delay: float = 8.0
    first_open_s: float = 3.0

    def __post_init__(self) -> None:
        if self.tries < 0 or self.base_delay < 0 or self.max_delay < self.base_delay or self.first_open_s < 0:
            raise ValueError(f"invalid reconnect policy {self}: need tries >= 0, 0 <= base_delay <= max_delay "
                             "and first_open_s >= 0")

    def delays(self) -> list[float]:
        return [min(self.max_delay, self.base_delay * 2**i) for i in range(self.tries)]

    def first_delays(self) -> list[float]:
        """The waits allowed before the first open: ``delays()`` while their sum stays within first_open_s."""
        out, total = [], 0.0
        for d in self.delays():
            if total + d > self.first_open_s + 1e-9:
                break
            out.append(d)
            total += d
        return out


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


def _missing_camera(index: int) -> str | None:
    """Why camera ``index`` cannot exist on this machine (Linux: no /dev/videoN), or None when it may."""
    import sys

    if not sys.platform.startswith("linux"):
        return None
    if Path(f"/dev/video{index}").exists():
        return None
    present = sorted(p.name for p in Path("/dev").glob("video[0-9]*"))
    return (f"no camera at index {index} (--source {index}): /dev/video{index} does not exist; video devices here: "
            + (", ".join(present) if present else "none") + " (check the cable, or `v4l2-ctl --list-devices`)")


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
        if not self._custom_opener and isinstance(self.source, int):
            missing = _missing_camera(self.source)
            if missing:
                raise SourceError(missing)
        if self._try_open():
            return
        delays = self.policy.first_delays()
        if self.live and self._reopen(delays):
            return
        raise SourceError(
            f"cannot open video source {self.source!r}"
            + (f" after {len(delays)} retries over {sum(delays):g} s" if self.live else "")
            + ": check the camera index / file path / URL (and that OpenCV was built with FFmpeg for files and streams)"
        )

    def _reopen(self, delays: list[float] | None = None) -> bool:
        """Backoff loop (the policy's delays unless given); True when the source is back."""
        self.close()
        delays = self.policy.delays() if delays is None else delays
        for attempt, delay in enumerate(delays, start=1):
            log.warning("source %r unavailable: retry %d/%d in %.2f s", self.source, attempt, len(delays), delay)
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
