"""The face head's output layout and its decode in numpy only (a camera runs it without torch).

The head's (B, D) output holds one block per enabled task, in ``FACE_TASKS`` order; an exported model
carries each block as its own named output (``FACE_OUTPUTS``), so a runtime knows the tasks from the
output names alone (a TensorRT engine keeps names, not ONNX metadata).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from fedpose.shared.data.face import FACE_TASKS, NUM_LANDMARKS, wrap_degrees

ANGLE_UNIT = 90.0  # degrees per unit of the head-pose output
FACE_OUTPUTS: dict[str, str] = {"detect": "face_detect", "landmarks": "face_landmarks", "head_pose": "head_pose",
                                "attribute": "face_attribute"}


def ordered(tasks: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """The enabled tasks in ``FACE_TASKS`` order (the layout does not depend on how a config lists them)."""
    return tuple(t for t in FACE_TASKS if t in tasks)


def task_width(task: str, attributes: int) -> int:
    """Width of a task's block: detect 5, landmarks 15, head_pose 3, attribute ``attributes``."""
    return {"detect": 5, "landmarks": 3 * NUM_LANDMARKS, "head_pose": 3, "attribute": attributes}[task]


def face_slices(tasks: tuple[str, ...], attributes: int) -> dict[str, slice]:
    """Where each enabled task's block sits in the head's (B, D) output."""
    out, start = {}, 0
    for task in ordered(tasks):
        width = task_width(task, attributes)
        out[task] = slice(start, start + width)
        start += width
    return out


def split_face(out: np.ndarray, tasks: tuple[str, ...], attributes: int) -> dict[str, np.ndarray]:
    """(B, D) face outputs -> {output name: (B, width)} as an exported model names them."""
    return {FACE_OUTPUTS[t]: out[:, sl] for t, sl in face_slices(tasks, attributes).items()}


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-z))


def decode_face(outputs: Mapping[str, np.ndarray], *, input_size: tuple[int, int]) -> dict[str, np.ndarray]:
    """Named face outputs (``FACE_OUTPUTS`` values present) -> arrays in input pixels and degrees.

    Returns, per task present: presence (B,) probability and box (B, 4) x1, y1, x2, y2; landmarks (B, 5, 2)
    and landmark_visibility (B, 5) probability; head_pose (B, 3) yaw, pitch, roll in [-180, 180); attribute
    (B,) class index and attribute_probability (B, A).
    """
    h, w = input_size
    scale = np.array([w, h], dtype=np.float64)
    res: dict[str, np.ndarray] = {}
    if (block := outputs.get(FACE_OUTPUTS["detect"])) is not None:
        block = np.asarray(block, np.float64)
        res["presence"] = _sigmoid(block[:, 0])
        centre, size = block[:, 1:3] * scale, np.abs(block[:, 3:5]) * scale
        res["box"] = np.concatenate([centre - size / 2, centre + size / 2], axis=1)
    if (block := outputs.get(FACE_OUTPUTS["landmarks"])) is not None:
        block = np.asarray(block, np.float64)
        res["landmarks"] = block[:, : 2 * NUM_LANDMARKS].reshape(-1, NUM_LANDMARKS, 2) * scale
        res["landmark_visibility"] = _sigmoid(block[:, 2 * NUM_LANDMARKS:])
    if (block := outputs.get(FACE_OUTPUTS["head_pose"])) is not None:
        res["head_pose"] = wrap_degrees(np.asarray(block, np.float64) * ANGLE_UNIT)
    if (block := outputs.get(FACE_OUTPUTS["attribute"])) is not None:
        z = np.asarray(block, np.float64)
        z = np.exp(z - z.max(axis=1, keepdims=True))
        p = z / z.sum(axis=1, keepdims=True)
        res["attribute"], res["attribute_probability"] = p.argmax(axis=1), p
    return res
