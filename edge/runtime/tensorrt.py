"""TensorRT runtime: deserialize an engine, own its device buffers and stream, run it (TensorRT 10 / 11 API).

No torch: device memory and the CUDA stream come from NVIDIA's cuda-python runtime bindings
(``cuda.bindings.runtime``, ``cuda.cudart`` in older releases), so a camera needs only TensorRT,
cuda-python, numpy and OpenCV. ``DeviceBuffers`` owns the allocations (a context manager that frees
them), ``TensorRTRuntime`` owns the execution context, the engine, the stream and the buffers and
releases them in reverse order. One inference, with explicit I/O tensors:

    context.set_input_shape("image", (N, 3, H, W))   # dynamic batch
    context.set_tensor_address(name, device_ptr)     # every I/O tensor
    cudaMemcpyAsync(input, host, H2D, stream)
    context.execute_async_v3(stream)                 # enqueue
    cudaMemcpyAsync(host, output, D2H, stream); cudaStreamSynchronize(stream)

``tensorrt`` and cuda-python are imported when a runtime is constructed, never at module import, so this
module imports on a CPU-only machine.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from fedpose.edge.runtime.base import Runtime
from fedpose.edge.export.trt_build import import_tensorrt
from fedpose.shared.model.face_decode import FACE_OUTPUTS

log = logging.getLogger(__name__)

__all__ = [
    "DeviceBuffers",
    "TensorRTRuntime",
    "import_cudart",
]

CUDA_INSTALL_HINT = ("the TensorRT runtime needs NVIDIA's cuda-python for device memory and streams: "
                     "pip install 'fedpose[tensorrt]' (or pip install cuda-python matching the CUDA of this machine)")


def import_cudart() -> Any:
    """cuda-python's runtime module (``cuda.bindings.runtime``; ``cuda.cudart`` before cuda-python 12.6)."""
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        try:
            from cuda import cudart  # type: ignore[no-redef]
        except ImportError as err:
            raise ImportError(CUDA_INSTALL_HINT) from err
    return cudart


def _check(cudart: Any, result: Any, what: str) -> Any:
    """cuda-python returns (error, value...) tuples: raise on an error, return the value(s)."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != cudart.cudaError_t.cudaSuccess:
        name = cudart.cudaGetErrorName(err)[1]
        raise RuntimeError(f"CUDA {what} failed: {name.decode() if isinstance(name, bytes) else name}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


class DeviceBuffers:
    """Named device allocations, re-allocated only when a tensor needs more bytes than it holds.

    Use as a context manager (or call ``close``): leaving it frees every allocation.
    """

    def __init__(self, cudart: Any) -> None:
        self._cudart = cudart
        self._ptrs: dict[str, tuple[int, int]] = {}  # name -> (device pointer, bytes)

    def get(self, name: str, nbytes: int) -> int:
        """A device pointer to at least ``nbytes`` bytes for tensor ``name``."""
        ptr, size = self._ptrs.get(name, (0, 0))
        if size < nbytes:
            if ptr:
                _check(self._cudart, self._cudart.cudaFree(ptr), f"free of {name}")
            ptr = int(_check(self._cudart, self._cudart.cudaMalloc(nbytes), f"allocation of {nbytes} bytes for {name}"))
            self._ptrs[name] = (ptr, nbytes)
        return ptr

    def close(self) -> None:
        ptrs, self._ptrs = self._ptrs, {}
        for name, (ptr, _) in ptrs.items():
            err = self._cudart.cudaFree(ptr)[0]
            if err != self._cudart.cudaError_t.cudaSuccess:  # freeing must go on for the others
                log.warning("CUDA free of %s failed: %s", name, err)

    def __enter__(self) -> DeviceBuffers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TensorRTRuntime(Runtime):
    """A deserialized ``.plan`` on one GPU; same ``infer`` contract as the other backends."""

    backend = "tensorrt"

    def __init__(self, model_path: str | Path, *, device: int = 0) -> None:
        self.model_path = Path(model_path)
        trt = import_tensorrt()
        cudart = import_cudart()
        if not self.model_path.is_file():
            raise FileNotFoundError(f"TensorRT engine {self.model_path} does not exist")
        err, count = cudart.cudaGetDeviceCount()
        if err != cudart.cudaError_t.cudaSuccess or count <= device:
            raise RuntimeError(f"cannot run {self.model_path}: no CUDA device {device} here (TensorRT needs an "
                               "NVIDIA GPU and its driver)")
        _check(cudart, cudart.cudaSetDevice(device), f"selecting device {device}")
        self._trt, self._cudart = trt, cudart
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        engine = self._runtime.deserialize_cuda_engine(self.model_path.read_bytes())
        if engine is None:
            raise ValueError(
                f"{self.model_path} is not a TensorRT engine TensorRT {trt.__version__} can load: the file is corrupt "
                "or was built with another TensorRT version or GPU (engines are not portable; rebuild it on this "
                "device with `fedpose edge build`)"
            )
        self._engine = engine
        self._context = engine.create_execution_context()
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        self._inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self._outputs = [n for n in names if n not in self._inputs]
        if len(self._inputs) != 1 or not {"simcc_x", "simcc_y"} <= set(self._outputs):
            raise ValueError(
                f"{self.model_path} is not a fedpose pose engine (inputs {self._inputs}, outputs {self._outputs})"
            )
        self._input = self._inputs[0]
        shape = tuple(engine.get_tensor_shape(self._input))  # -1 marks a dynamic dimension
        if len(shape) != 4 or shape[2] < 1 or shape[3] < 1:
            raise ValueError(f"{self.model_path}: input shape {shape} is not (N, 3, H, W) with fixed H, W")
        self._input_size = (int(shape[2]), int(shape[3]))
        self._batch = int(shape[0]) if shape[0] > 0 else None
        self._max_batch = self._batch
        if self._batch is None:
            _, _, hi = engine.get_tensor_profile_shape(self._input, 0)
            self._max_batch = int(hi[0])
        try:
            self._dtypes = {n: np.dtype(trt.nptype(engine.get_tensor_dtype(n))) for n in names}
        except TypeError as err:  # e.g. BF16, which numpy has no type for
            raise ValueError(f"{self.model_path}: an I/O tensor type numpy cannot hold ({err}); export FP32 or FP16 "
                             "I/O") from err
        self.face_outputs = tuple(n for n in FACE_OUTPUTS.values() if n in self._outputs)
        self._stream = _check(cudart, cudart.cudaStreamCreate(), "stream creation")
        self._buffers = DeviceBuffers(cudart)

    def _run(self, x: np.ndarray, names: tuple[str, ...]) -> dict[str, np.ndarray]:
        if self._batch is None and x.shape[0] > self._max_batch:  # beyond the profile: chunk
            parts = [self._run(x[i : i + self._max_batch], names) for i in range(0, x.shape[0], self._max_batch)]
            return {n: np.concatenate([p[n] for p in parts]) for n in names}
        cudart, ctx, stream = self._cudart, self._context, self._stream
        in_shape = (x.shape[0], 3, *self._input_size)
        if not ctx.set_input_shape(self._input, in_shape):
            raise ValueError(f"{self.model_path}: TensorRT rejected input shape {in_shape} (outside the profile?)")
        host_in = np.ascontiguousarray(x, dtype=self._dtypes[self._input])
        ptr = self._buffers.get(self._input, host_in.nbytes)
        _check(cudart, cudart.cudaMemcpyAsync(ptr, host_in.ctypes.data, host_in.nbytes,
                                              cudart.cudaMemcpyKind.cudaMemcpyHostToDevice, stream), "copy to device")
        ctx.set_tensor_address(self._input, ptr)
        host_out: dict[str, np.ndarray] = {}
        for name in self._outputs:
            host_out[name] = np.empty(tuple(ctx.get_tensor_shape(name)), dtype=self._dtypes[name])
            ctx.set_tensor_address(name, self._buffers.get(name, host_out[name].nbytes))
        if not ctx.execute_async_v3(int(stream)):
            raise RuntimeError(f"TensorRT failed to enqueue {self.model_path}")
        for name in names:
            out = host_out[name]
            _check(cudart, cudart.cudaMemcpyAsync(out.ctypes.data, self._buffers.get(name, out.nbytes), out.nbytes,
                                                  cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost, stream),
                   f"copy of {name} to the host")
        _check(cudart, cudart.cudaStreamSynchronize(stream), "stream synchronisation")
        return {name: host_out[name].astype(np.float32) for name in names}

    def close(self) -> None:
        buffers = getattr(self, "_buffers", None)
        if buffers is not None:
            buffers.close()
        # Context before engine before runtime: TensorRT objects die in reverse creation order; then the stream.
        for attr in ("_context", "_engine", "_runtime"):
            if hasattr(self, attr):
                setattr(self, attr, None)
        stream = getattr(self, "_stream", None)
        if stream is not None:
            self._cudart.cudaStreamDestroy(stream)
            self._stream = None
