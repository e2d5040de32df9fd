"""ONNX export of a BatchNorm-folded ``PoseNet`` (TorchScript exporter, opset 17), folded and checked
for TensorRT, then verified against PyTorch (see the package docstring for why).
"""

from __future__ import annotations

import logging
import math
import warnings
from collections import Counter
from pathlib import Path

import torch

from fedpose.edge.export.fold import fold_constants
from fedpose.edge.export.outputs import exported_module
from fedpose.edge.export.parity import verify_onnx
from fedpose.edge.export.spec import (DEFAULT_TOLERANCE, INPUT_NAME, OPSET, Batch, ExportError, ExportReport,
                                      export_outputs)
from fedpose.edge.export.trt_ops import nonconstant_restricted_inputs, unsupported_ops
from fedpose.shared.model.face_decode import ordered
from fedpose.shared.model.posenet import PoseNet

log = logging.getLogger(__name__)


def export_onnx(
    model: PoseNet,
    out: str | Path,
    *,
    batch: Batch = 1,
    opset: int = OPSET,
    input_size: tuple[int, int] | None = None,
    fp16: bool = False,
    verify: bool = True,
    tolerance: float = DEFAULT_TOLERANCE,
    strict_trt: bool = True,
    seed: int = 0,
) -> ExportReport:
    """Export ``model`` to ONNX at ``out``, fold shape constants, check ops, verify with onnxruntime.

    Args:
        model: a (fused) PoseNet; its input size is fixed by the SimCC head.
        batch: fixed batch size, or "dynamic" (axis 0 named ``batch``).
        input_size: (H, W); must equal ``model.input_size`` when given (the
            head has one SimCC bin per input pixel, so another size is another model).
        fp16: export in half precision (for TensorRT 11's strongly typed
            FP16 builds); verified with a looser tolerance (1e-2 relative to the logit range).
        strict_trt: raise ``ExportError`` on ops outside ``TRT10_ONNX_OPS``
            or non-constant pads; otherwise only warn.

    Returns an ``ExportReport`` with the op histogram and the max |onnxruntime - torch|.
    """
    import onnx

    out = Path(out)
    if input_size is not None and tuple(input_size) != tuple(model.input_size):
        raise ValueError(
            f"--input {input_size[0]}x{input_size[1]} differs from the checkpoint's input size "
            f"{model.input_size[0]}x{model.input_size[1]}: the SimCC head is tied to the training input size; "
            "omit --input or retrain at that size"
        )
    if batch != "dynamic" and (not isinstance(batch, int) or batch < 1):
        raise ValueError(f"batch must be a positive integer or 'dynamic', got {batch!r}")
    if not 13 <= opset <= 20:
        raise ValueError(
            f"opset must be in 13..20 (TensorRT 10 parses 9..20, TensorRT 8.6 up to 17), got {opset}; use {OPSET}"
        )
    if out.suffix != ".onnx":
        raise ValueError(f"output file {out} must end in .onnx")
    out.parent.mkdir(parents=True, exist_ok=True)

    h, w = model.input_size
    model = model.eval()
    dtype = torch.float16 if fp16 else torch.float32
    export_model = _copy_to(model, dtype)
    example = torch.rand(1 if batch == "dynamic" else batch, 3, h, w, dtype=dtype)
    outputs = export_outputs(model)
    dynamic_axes = {name: {0: "batch"} for name in (INPUT_NAME, *outputs)} if batch == "dynamic" else None
    tmp = out.with_suffix(".tmp.onnx")
    try:
        with warnings.catch_warnings():
            # The TorchScript exporter warns about its own deprecation and about
            # shape-derived Python bools (the pad test in TinyVitBlock); both are
            # expected for a fixed-size model and handled by fold_constants.
            warnings.simplefilter("ignore")
            with torch.no_grad():
                torch.onnx.export(
                    exported_module(export_model),
                    (example,),
                    str(tmp),
                    input_names=[INPUT_NAME],
                    output_names=list(outputs),
                    opset_version=opset,
                    dynamic_axes=dynamic_axes,
                    do_constant_folding=True,
                    dynamo=False,
                )
        proto = fold_constants(onnx.load(str(tmp)))
        proto.producer_name = "fedpose"
        meta = {
            "fedpose.input_size": f"{h}x{w}",
            "fedpose.split_ratio": repr(float(model.cfg.split_ratio)),
            "fedpose.variant": model.cfg.variant,
        }
        if model.face_head is not None:
            meta["fedpose.face_tasks"] = ",".join(ordered(model.cfg.face_tasks))
            meta["fedpose.face_attributes"] = str(model.cfg.face_attributes)
        for key, value in meta.items():
            entry = proto.metadata_props.add()
            entry.key, entry.value = key, value
        onnx.checker.check_model(proto, full_check=True)
        onnx.save(proto, str(tmp))
    except Exception:
        tmp.unlink(missing_ok=True)
        raise

    ops = dict(sorted(Counter(n.op_type for n in proto.graph.node).items()))
    unsupported = unsupported_ops(proto)
    nonconst = nonconstant_restricted_inputs(proto)
    problems = []
    if unsupported:
        problems.append(f"ops not in the TensorRT 10 ONNX parser's support list: {unsupported}")
    if nonconst:
        problems.append(f"inputs TensorRT needs as constants are computed at run time: {nonconst}")
    if problems:
        if strict_trt:
            tmp.unlink(missing_ok=True)
            raise ExportError(f"export of {out} is not TensorRT-ready: " + "; ".join(problems))
        for p in problems:
            log.warning("%s: %s", out, p)

    diff = math.nan
    if verify:
        tol = tolerance if not fp16 else max(tolerance, 1e-2)
        batches = (1, 3) if batch == "dynamic" else (batch,)
        try:
            diff = verify_onnx(model, tmp, batch_sizes=batches, tolerance=tol, seed=seed, relative=fp16)
        except Exception:
            tmp.unlink(missing_ok=True)
            raise
    tmp.replace(out)
    log.info("exported %s (opset %d, batch %s, max |ort - torch| = %.3g)", out, opset, batch, diff)
    return ExportReport(
        path=out,
        input_size=(h, w),
        batch=batch,
        opset=opset,
        ops=ops,
        max_abs_diff=diff,
        unsupported_ops=tuple(unsupported),
        nonconstant_inputs=tuple(nonconst),
        fp16=fp16,
    )


def _copy_to(model: PoseNet, dtype: torch.dtype) -> torch.nn.Module:
    """The model itself for fp32; a half-precision deep copy for fp16 (the caller's model stays fp32)."""
    if dtype == torch.float32:
        return model
    import copy

    return copy.deepcopy(model).to(dtype)
