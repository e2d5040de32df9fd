"""One inference interface, three backends chosen once at construction.

``make_runtime(path)`` picks the backend from the file suffix (``.pt`` ->
PyTorch, ``.onnx`` -> onnxruntime, ``.plan``/``.engine`` -> TensorRT) unless
``backend`` says otherwise. Every runtime has

    input_size -> (H, W)
    infer(batch float32 (N, 3, H, W) RGB in [0, 1]) -> (simcc_x (N, K, W*s), simcc_y (N, K, H*s))

and is a context manager (``close`` frees sessions / device memory), so the
camera pipeline never needs to know which one it holds. Heavy backends are
imported inside their constructors.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Literal

import numpy as np

log = logging.getLogger(__name__)

Backend = Literal["torch", "onnxruntime", "tensorrt"]
BACKENDS: tuple[str, ...] = ("torch", "onnxruntime", "tensorrt")
SUFFIXES: dict[str, str] = {".pt": "torch", ".onnx": "onnxruntime", ".plan": "tensorrt", ".engine": "tensorrt"}


class Runtime:
    """Base class: input checking and chunking shared by all backends.

    Subclasses set ``model_path``, ``_input_size``, ``_batch`` (fixed batch
    size or None for any) and implement ``_run``.
    """

    backend: str = ""
    model_path: Path
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
        x = self._check(batch)
        n = x.shape[0]
        if n == 0:
            raise ValueError(f"{self.model_path}: empty batch; pass at least one image")
        fixed = self._batch
        if fixed is None or fixed == n:
            sx, sy = self._run(x)
        else:  # fixed-batch model: run in chunks of its batch size, zero-padding the last one
            xs, ys = [], []
            for start in range(0, n, fixed):
                chunk = x[start : start + fixed]
                real = chunk.shape[0]
                if real < fixed:
                    chunk = np.concatenate([chunk, np.zeros((fixed - real, *chunk.shape[1:]), chunk.dtype)])
                cx, cy = self._run(np.ascontiguousarray(chunk))
                xs.append(cx[:real])
                ys.append(cy[:real])
            sx, sy = np.concatenate(xs), np.concatenate(ys)
        return np.asarray(sx, dtype=np.float32), np.asarray(sy, dtype=np.float32)

    def _check(self, batch: np.ndarray) -> np.ndarray:
        x = np.asarray(batch)
        h, w = self._input_size
        if x.ndim != 4 or x.shape[1] != 3 or tuple(x.shape[2:]) != (h, w):
            raise ValueError(
                f"model {self.model_path} expects input (N, 3, {h}, {w}), got {tuple(x.shape)}; "
                f"crop frames to {h}x{w} with edge.prepost.preprocess"
            )
        if x.dtype != np.float32:
            raise ValueError(f"model {self.model_path} expects float32 input, got {x.dtype}")
        return np.ascontiguousarray(x)

    def _run(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # pragma: no cover - abstract
        raise NotImplementedError

    def close(self) -> None:
        """Release backend resources (idempotent)."""

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.model_path)!r}, input_size={self._input_size})"


class TorchRuntime(Runtime):
    """PyTorch eager on a fedpose checkpoint (``.pt``): the reference every export is checked against."""

    backend = "torch"

    def __init__(self, model_path: str | Path, *, device: str = "cpu", threads: int | None = None) -> None:
        import torch

        from shared.model.posenet import load_checkpoint

        self.model_path = Path(model_path)
        if threads is not None:
            torch.set_num_threads(threads)
        try:
            model, _ = load_checkpoint(self.model_path, map_location=device)
        except (ValueError, KeyError, TypeError, RuntimeError) as err:
            raise ValueError(f"{self.model_path} is not a readable fedpose checkpoint: {err}") from err
        self._model = model.to(device).eval()
        self._device = torch.device(device)
        self._input_size = tuple(int(v) for v in model.input_size)
        self.split_ratio = float(model.cfg.split_ratio)

    def _run(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        import torch

        with torch.inference_mode():
            sx, sy, _ = self._model(torch.from_numpy(x).to(self._device))
        return sx.cpu().numpy(), sy.cpu().numpy()

    def close(self) -> None:
        self._model = None


class OnnxRuntime(Runtime):
    """onnxruntime session on an exported ``.onnx`` (CPU, or CUDA with onnxruntime-gpu)."""

    backend = "onnxruntime"

    def __init__(
        self,
        model_path: str | Path,
        *,
        providers: list[str] | None = None,
        threads: int | None = None,
    ) -> None:
        try:
            import onnxruntime as ort
        except ImportError as err:  # pragma: no cover - a core dependency
            raise ImportError("onnxruntime is not installed: pip install onnxruntime (or onnxruntime-gpu)") from err

        self.model_path = Path(model_path)
        if not self.model_path.is_file():
            raise FileNotFoundError(f"ONNX model {self.model_path} does not exist")
        available = ort.get_available_providers()
        wanted = providers or ["CPUExecutionProvider"]
        missing = [p for p in wanted if p not in available]
        if missing:
            raise ValueError(
                f"onnxruntime providers {missing} are not available here (available: {available}); "
                "for CUDAExecutionProvider install onnxruntime-gpu (pip install 'fedpose[gpu]')"
            )
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if threads is not None:
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
        try:
            self._session = ort.InferenceSession(str(self.model_path), sess_options=options, providers=wanted)
        except Exception as err:  # onnxruntime raises its own Fail / InvalidProtobuf / InvalidGraph types
            raise ValueError(f"{self.model_path} is not a loadable ONNX model: {err}") from err
        inputs = self._session.get_inputs()
        names = [o.name for o in self._session.get_outputs()]
        if len(inputs) != 1 or "simcc_x" not in names or "simcc_y" not in names:
            raise ValueError(
                f"{self.model_path} is not a fedpose pose model (inputs {[i.name for i in inputs]}, outputs {names}); "
                "export one with `fedpose edge export`"
            )
        self._input_name = inputs[0].name
        shape = inputs[0].shape  # e.g. ['batch', 3, 128, 96] or [1, 3, 128, 96]
        if len(shape) != 4 or not all(isinstance(d, int) for d in shape[1:]) or shape[1] != 3:
            raise ValueError(f"{self.model_path}: input shape {shape} is not (N, 3, H, W) with fixed H, W")
        self._input_size = (int(shape[2]), int(shape[3]))
        self._batch = int(shape[0]) if isinstance(shape[0], int) else None
        self._half = "float16" in inputs[0].type
        self.providers = self._session.get_providers()

    def _run(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        feed = x.astype(np.float16) if self._half else x
        sx, sy = self._session.run(["simcc_x", "simcc_y"], {self._input_name: feed})
        return sx, sy

    def close(self) -> None:
        self._session = None


def backend_for(model_path: str | Path, backend: str | None = None) -> str:
    """The backend ``make_runtime`` would use for this file."""
    path = Path(model_path)
    if backend is not None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
        return backend
    try:
        return SUFFIXES[path.suffix.lower()]
    except KeyError as err:
        raise ValueError(
            f"cannot tell the backend of {path} from its suffix {path.suffix!r}: use .pt (PyTorch checkpoint), "
            ".onnx (onnxruntime) or .plan/.engine (TensorRT), or pass backend="
        ) from err


def make_runtime(
    model_path: str | Path,
    backend: Backend | None = None,
    *,
    providers: list[str] | None = None,
    threads: int | None = None,
    device: str = "cpu",
) -> Runtime:
    """Open ``model_path`` with the backend its suffix names (or ``backend``).

    Raises FileNotFoundError for a missing file, ValueError naming the file
    for one that is corrupt or not a fedpose model, ImportError with an
    install hint when the backend's package is absent (TensorRT).
    """
    path = Path(model_path)
    kind = backend_for(path, backend)
    if not path.is_file():
        raise FileNotFoundError(f"model file {path} does not exist")
    if kind == "torch":
        return TorchRuntime(path, device=device, threads=threads)
    if kind == "onnxruntime":
        return OnnxRuntime(path, providers=providers, threads=threads)
    from edge.trt_runtime import TensorRTRuntime

    return TensorRTRuntime(path)
