"""What an export takes and gives: opset, tensor names, tolerance, batch and input-size parsing,
``ExportOptions``, ``ExportReport`` and ``ExportError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

OPSET = 17
INPUT_NAME = "image"
OUTPUT_NAMES = ("simcc_x", "simcc_y", "visibility")  # then a model's face outputs (``export_outputs``)
DEFAULT_TOLERANCE = 1e-4

Batch = int | Literal["dynamic"]


class ExportError(RuntimeError):
    """The exported graph does not match PyTorch or is not one TensorRT can take."""


@dataclass(frozen=True)
class ExportOptions:
    """How ``export_onnx`` traces, checks and verifies a model.

    batch: fixed batch size, or "dynamic" (axis 0 named ``batch``).
    opset: the ONNX opset (13..20; 17 serves TensorRT 8.6 and 10).
    input_size: (H, W); must equal the model's input size when given (the head has one SimCC bin per input
        pixel, so another size is another model).
    fp16: export in half precision (for TensorRT 11's strongly typed FP16 builds); verified with a looser
        tolerance (1e-2 relative to the logit range).
    verify, tolerance, seed: run the file with onnxruntime on random images (seeded) and fail above the
        tolerance.
    strict_trt: raise ``ExportError`` on ops outside ``TRT10_ONNX_OPS`` or non-constant pads; otherwise only warn.
    """

    batch: Batch = 1
    opset: int = OPSET
    input_size: tuple[int, int] | None = None
    fp16: bool = False
    verify: bool = True
    tolerance: float = DEFAULT_TOLERANCE
    strict_trt: bool = True
    seed: int = 0


@dataclass(frozen=True)
class ExportReport:
    """What ``export_onnx`` wrote and checked."""

    path: Path
    input_size: tuple[int, int]
    batch: Batch
    opset: int
    ops: dict[str, int]
    max_abs_diff: float
    unsupported_ops: tuple[str, ...] = ()
    nonconstant_inputs: tuple[str, ...] = ()
    fp16: bool = False


def parse_batch(value: str | int) -> Batch:
    """``"dynamic"`` or a positive integer (the ``--batch`` flag)."""
    if isinstance(value, str) and value.strip().lower() == "dynamic":
        return "dynamic"
    try:
        batch = int(value)
    except (TypeError, ValueError) as err:
        raise ValueError(f"--batch must be a positive integer or 'dynamic', got {value!r}") from err
    if batch < 1:
        raise ValueError(f"--batch must be >= 1 (or 'dynamic'), got {batch}")
    return batch


def parse_input_size(value: str) -> tuple[int, int]:
    """``"HxW"`` -> (H, W)."""
    try:
        h, w = (int(v) for v in value.lower().split("x"))
    except ValueError as err:
        raise ValueError(f"--input must look like HxW (e.g. 128x96), got {value!r}") from err
    if h < 32 or w < 32:
        raise ValueError(f"--input must be at least 32x32, got {value!r}")
    return h, w


def export_outputs(model: object) -> tuple[str, ...]:
    """The output names of ``model``'s export: the pose outputs, then one per face task it has."""
    from fedpose.shared.model.face_decode import FACE_OUTPUTS, ordered

    cfg = getattr(model, "cfg", None)
    return OUTPUT_NAMES + tuple(FACE_OUTPUTS[t] for t in ordered(getattr(cfg, "face_tasks", ())))
