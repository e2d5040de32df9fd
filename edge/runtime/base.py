"""The inference interface every backend implements (``Runtime``): input checking, fixed-batch
chunking and the context-manager protocol. Backends subclass it; ``fedpose.edge.runtime.make_runtime``
picks one.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

POSE_OUTPUTS = ("simcc_x", "simcc_y")


class Runtime:
    """Base class: input checking and chunking shared by all backends.

    Subclasses set ``model_path``, ``_input_size``, ``_batch`` (fixed batch
    size or None for any), ``face_outputs`` when the model has face tasks, and implement ``_run``.
    """

    backend: str = ""
    model_path: Path
    # The model's face outputs (shared.model.face_decode.FACE_OUTPUTS values, in task order); () for pose only.
    face_outputs: tuple[str, ...] = ()
    _input_size: tuple[int, int]
    _batch: int | None = None

    @property
    def input_size(self) -> tuple[int, int]:
        """(H, W) the model was exported/trained for."""
        return self._input_size

    @property
    def fixed_batch(self) -> int | None:
        """The batch size a fixed-shape model needs (None: any batch size)."""
        return self._batch

    def infer(self, batch: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(N, 3, H, W) float32 RGB [0, 1] -> (simcc_x (N, K, Wb), simcc_y (N, K, Hb)) float32."""
        out = self._infer(batch, POSE_OUTPUTS)
        return out["simcc_x"], out["simcc_y"]

    def infer_all(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        """``infer``'s two outputs and the model's face outputs (``face_outputs``), by output name."""
        return self._infer(batch, POSE_OUTPUTS + self.face_outputs)

    def _infer(self, batch: np.ndarray, names: tuple[str, ...]) -> dict[str, np.ndarray]:
        x = self._check(batch)
        n = x.shape[0]
        if n == 0:
            raise ValueError(f"{self.model_path}: empty batch; pass at least one image")
        fixed = self._batch
        if fixed is None or fixed == n:
            out = self._run(x, names)
        else:  # fixed-batch model: run in chunks of its batch size, zero-padding the last one
            parts = []
            for start in range(0, n, fixed):
                chunk = x[start : start + fixed]
                real = chunk.shape[0]
                if real < fixed:
                    chunk = np.concatenate([chunk, np.zeros((fixed - real, *chunk.shape[1:]), chunk.dtype)])
                parts.append({k: v[:real] for k, v in self._run(np.ascontiguousarray(chunk), names).items()})
            out = {k: np.concatenate([p[k] for p in parts]) for k in names}
        return {k: np.asarray(out[k], dtype=np.float32) for k in names}

    def _check(self, batch: np.ndarray) -> np.ndarray:
        x = np.asarray(batch)
        h, w = self._input_size
        if x.ndim != 4 or x.shape[1] != 3 or tuple(x.shape[2:]) != (h, w):
            raise ValueError(
                f"model {self.model_path} expects input (N, 3, {h}, {w}), got {tuple(x.shape)}; "
                f"crop frames to {h}x{w} with edge.runtime.prepost.preprocess"
            )
        if x.dtype != np.float32:
            raise ValueError(f"model {self.model_path} expects float32 input, got {x.dtype}")
        return np.ascontiguousarray(x)

    def _run(self, x: np.ndarray, names: tuple[str, ...]) -> dict[str, np.ndarray]:  # pragma: no cover - abstract
        """The outputs ``names`` of one batch the backend can take at once."""
        raise NotImplementedError

    def close(self) -> None:
        """Release backend resources (idempotent)."""

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.model_path)!r}, input_size={self._input_size})"
