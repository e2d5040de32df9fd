"""onnxruntime backend (``.onnx``, CPU or CUDA with onnxruntime-gpu); imported in the constructor."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedpose.edge.runtime.base import Runtime
from fedpose.shared.model.face_decode import FACE_OUTPUTS


# What ``fedpose edge run --device`` asks onnxruntime for, in order of preference (onnxruntime falls back along
# the list node by node; the CPU provider is always last so every operator has a home).
DEVICE_PROVIDERS: dict[str, list[str]] = {
    "cpu": ["CPUExecutionProvider"],
    "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"],
    "tensorrt": ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"],
}


def providers_for(device: str) -> list[str]:
    """onnxruntime execution providers for a device name (``cpu``, ``cuda``, ``tensorrt``)."""
    try:
        return list(DEVICE_PROVIDERS[device])
    except KeyError as err:
        raise ValueError(f"--device {device!r} is not one of {', '.join(DEVICE_PROVIDERS)}") from err


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
            raise ImportError("onnxruntime is not installed: pip install 'fedpose[edge]' (CPU) or "
                              "'fedpose[edge-gpu]' (NVIDIA GPU), not both") from err

        self.model_path = Path(model_path)
        if not self.model_path.is_file():
            raise FileNotFoundError(f"ONNX model {self.model_path} does not exist")
        available = ort.get_available_providers()
        wanted = providers or ["CPUExecutionProvider"]
        if wanted[0] not in available:  # the one asked for; the ones after it are fallbacks
            raise ValueError(
                f"onnxruntime's {wanted[0]} is not available here (this onnxruntime has {', '.join(available)}): the "
                "CUDA and TensorRT providers need the GPU build, pip install 'fedpose[edge-gpu]' in place of "
                "fedpose[edge] (the two onnxruntime wheels cannot be installed together), and an NVIDIA GPU"
            )
        wanted = [p for p in wanted if p in available]
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
        self.face_outputs = tuple(n for n in FACE_OUTPUTS.values() if n in names)

    def _run(self, x: np.ndarray, names: tuple[str, ...]) -> dict[str, np.ndarray]:
        feed = x.astype(np.float16) if self._half else x
        return dict(zip(names, self._session.run(list(names), {self._input_name: feed})))

    def close(self) -> None:
        self._session = None
