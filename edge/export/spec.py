"""What an export takes and gives: opset, tensor names, tolerance, batch and input-size parsing,
``ExportReport`` and ``ExportError``.
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
