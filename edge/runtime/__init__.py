"""One inference interface, three backends chosen once at construction.

``make_runtime(path)`` picks the backend from the file suffix (``.pt`` ->
PyTorch, ``.onnx`` -> onnxruntime, ``.plan``/``.engine`` -> TensorRT) unless
``backend`` says otherwise. Every runtime has

    input_size -> (H, W)
    infer(batch float32 (N, 3, H, W) RGB in [0, 1]) -> (simcc_x (N, K, W*s), simcc_y (N, K, H*s))

and is a context manager (``close`` frees sessions / device memory), so the
camera pipeline never needs to know which one it holds. Heavy backends are
imported inside their constructors, and this factory imports each backend module only
when it is picked, so a camera without torch or TensorRT imports the package.

The package: base (``Runtime``, the interface), one module per backend (pytorch, onnx,
tensorrt), prepost (the numpy crop before and keypoint mapping after every backend).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from fedpose.edge.runtime.base import Runtime

Backend = Literal["torch", "onnxruntime", "tensorrt"]
BACKENDS: tuple[str, ...] = ("torch", "onnxruntime", "tensorrt")
SUFFIXES: dict[str, str] = {".pt": "torch", ".onnx": "onnxruntime", ".plan": "tensorrt", ".engine": "tensorrt"}


def backend_for(model_path: str | Path, backend: str | None = None) -> str:
    """The backend ``make_runtime`` would use for this file."""
    path = Path(model_path)
    if backend is not None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r} (--backend): choose one of {', '.join(BACKENDS)}")
        return backend
    try:
        return SUFFIXES[path.suffix.lower()]
    except KeyError as err:
        raise ValueError(
            f"cannot tell the backend of {path} from its suffix {path.suffix!r}: use .pt (PyTorch checkpoint), "
            ".onnx (onnxruntime) or .plan/.engine (TensorRT), or name it with --backend "
            f"{'|'.join(BACKENDS)}"
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
        from fedpose.edge.runtime.pytorch import TorchRuntime

        return TorchRuntime(path, device="cpu" if device == "cpu" else "cuda", threads=threads)
    if kind == "onnxruntime":
        from fedpose.edge.runtime.onnx import OnnxRuntime, providers_for

        return OnnxRuntime(path, providers=providers or providers_for(device), threads=threads)
    from fedpose.edge.runtime.tensorrt import TensorRTRuntime

    return TensorRTRuntime(path)
