"""Parity of an exported file with PyTorch: onnxruntime on random images, largest absolute difference.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from fedpose.edge.export.outputs import exported_module
from fedpose.edge.export.spec import DEFAULT_TOLERANCE, INPUT_NAME, ExportError, export_outputs
from fedpose.shared.model.posenet import PoseNet

log = logging.getLogger(__name__)


def verify_onnx(
    model: PoseNet,
    onnx_path: str | Path,
    *,
    batch_sizes: tuple[int, ...] = (1,),
    tolerance: float = DEFAULT_TOLERANCE,
    seed: int = 0,
    relative: bool = False,
) -> float:
    """Max |onnxruntime - PyTorch| over every output (pose, and face when the model has face tasks) on random
    images; raises above ``tolerance``.

    ``relative``: divide by the largest |logit| (used for fp16 files).
    """
    import onnxruntime as ort


    rng = np.random.default_rng(seed)
    h, w = model.input_size
    try:
        session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    except Exception as err:
        raise ExportError(f"onnxruntime cannot load the exported {onnx_path}: {err}") from err
    input_type = session.get_inputs()[0].type
    worst = 0.0
    for n in batch_sizes:
        x = rng.random((n, 3, h, w), dtype=np.float32)
        with torch.no_grad():
            ref = [t.numpy() for t in exported_module(model.eval())(torch.from_numpy(x))]
        feed = x.astype(np.float16) if "float16" in input_type else x
        names = export_outputs(model)
        got = session.run(list(names), {INPUT_NAME: feed})
        for name, r, g in zip(names, ref, got, strict=True):
            if r.shape != g.shape:
                raise ExportError(f"{onnx_path}: output {name} has shape {g.shape}, PyTorch gives {r.shape}")
            d = float(np.abs(r - g.astype(np.float32)).max())
            if relative:
                d /= max(1.0, float(np.abs(r).max()))
            worst = max(worst, d)
    log.info("onnxruntime vs PyTorch on %s: max abs diff %.3g (batches %s)", onnx_path, worst, batch_sizes)
    if not worst <= tolerance:
        raise ExportError(
            f"{onnx_path}: onnxruntime output differs from PyTorch by {worst:.3g} > {tolerance:g}; "
            "the export is wrong (check for ops whose ONNX translation differs)"
        )
    return worst
