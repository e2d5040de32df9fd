"""TensorRT runtime: deserialize an engine, own its device buffers, run it (TensorRT 8.6 / 10.x / 11.x API).

Device memory is held by torch CUDA tensors (torch is already a dependency
and its caching allocator handles growth), owned by ``DeviceBuffers``, a
context manager that frees them on exit; ``TensorRTRuntime`` is a context
manager that owns the execution context, the engine, the CUDA stream and
the buffers, released in that order. One inference:

    context.set_input_shape("image", (N, 3, H, W))   # dynamic batch
    context.set_tensor_address(name, ptr)            # every I/O tensor
    context.execute_async_v3(stream)                 # enqueue
    stream.synchronize()

``tensorrt`` and CUDA are imported when a runtime is constructed, never at
module import, so this module imports on a CPU-only machine.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from edge.runtime_base import Runtime
from edge.trt_build import TRT_INSTALL_HINT, import_tensorrt

log = logging.getLogger(__name__)

__all__ = ["DeviceBuffers", "TensorRTRuntime", "TRT_INSTALL_HINT"]


class DeviceBuffers:
    """Named CUDA buffers (torch tensors), re-allocated only when a shape or dtype changes.

    Use as a context manager (or call ``close``): leaving it drops every
    tensor, so the memory goes back to torch's allocator.
    """

    def __init__(self, device: Any) -> None:
        self._device = device
        self._tensors: dict[str, Any] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: Any) -> Any:
        import torch

        t = self._tensors.get(name)
        if t is None or tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            t = torch.empty(tuple(shape), dtype=dtype, device=self._device)
            self._tensors[name] = t
        return t

    def __getitem__(self, name: str) -> Any:
        return self._tensors[name]

    def close(self) -> None:
        self._tensors.clear()

    def __enter__(self) -> DeviceBuffers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _torch_dtype(trt: Any, dtype: Any) -> Any:
    import torch

    table = {
        trt.DataType.FLOAT: torch.float32,
        trt.DataType.HALF: torch.float16,
        trt.DataType.INT32: torch.int32,
        trt.DataType.INT8: torch.int8,
        trt.DataType.BOOL: torch.bool,
    }
    for name, tdt in (("INT64", torch.int64), ("UINT8", torch.uint8), ("BF16", torch.bfloat16)):
        if hasattr(trt.DataType, name):
            table[getattr(trt.DataType, name)] = tdt
    if dtype not in table:
        raise ValueError(f"unsupported TensorRT tensor type {dtype}")
    return table[dtype]


class TensorRTRuntime(Runtime):
    """A deserialized ``.plan`` on one GPU; same ``infer`` contract as the other backends."""

    backend = "tensorrt"

    def __init__(self, model_path: str | Path, *, device: int = 0) -> None:
        self.model_path = Path(model_path)
        trt = import_tensorrt()
        try:
            import torch
        except ImportError as err:  # pragma: no cover - torch is a core dependency
            raise ImportError("the TensorRT runtime keeps device buffers in torch CUDA tensors: install torch") from err
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"cannot run {self.model_path}: no CUDA device visible to torch (TensorRT needs an NVIDIA GPU and a "
                "CUDA build of torch; on Jetson use NVIDIA's torch wheel for JetPack)"
            )
        if not self.model_path.is_file():
            raise FileNotFoundError(f"TensorRT engine {self.model_path} does not exist")
        self._trt = trt
        self._device = torch.device("cuda", device)
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
        self._dtypes = {n: _torch_dtype(trt, engine.get_tensor_dtype(n)) for n in names}
        self._stream = torch.cuda.Stream(device=self._device)
        self._buffers = DeviceBuffers(self._device)

    def _run(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self._batch is None and x.shape[0] > self._max_batch:  # beyond the profile: chunk
            parts = [self._run(x[i : i + self._max_batch]) for i in range(0, x.shape[0], self._max_batch)]
            return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
        import torch

        ctx = self._context
        n = x.shape[0]
        in_shape = (n, 3, *self._input_size)
        if not ctx.set_input_shape(self._input, in_shape):
            raise ValueError(f"{self.model_path}: TensorRT rejected input shape {in_shape} (outside the profile?)")
        with torch.cuda.stream(self._stream):
            inp = self._buffers.get(self._input, in_shape, self._dtypes[self._input])
            inp.copy_(torch.from_numpy(x).to(self._device, non_blocking=True).to(inp.dtype))
            ctx.set_tensor_address(self._input, inp.data_ptr())
            for name in self._outputs:
                out_shape = tuple(ctx.get_tensor_shape(name))
                buf = self._buffers.get(name, out_shape, self._dtypes[name])
                ctx.set_tensor_address(name, buf.data_ptr())
            if not ctx.execute_async_v3(self._stream.cuda_stream):
                raise RuntimeError(f"TensorRT failed to enqueue {self.model_path}")
        self._stream.synchronize()
        sx = self._buffers["simcc_x"].float().cpu().numpy()
        sy = self._buffers["simcc_y"].float().cpu().numpy()
        return sx, sy

    def close(self) -> None:
        buffers = getattr(self, "_buffers", None)
        if buffers is not None:
            buffers.close()
        # Context before engine before runtime: TensorRT objects must die in reverse creation order.
        for attr in ("_context", "_engine", "_runtime"):
            if hasattr(self, attr):
                setattr(self, attr, None)
