"""ONNX export of a BatchNorm-folded ``PoseNet`` (TorchScript exporter, opset 17), folded and checked
for TensorRT, then verified against PyTorch (see the package docstring for why).

``export_onnx`` runs the phases in order on a temporary file next to the target, which any failure removes:
check the request, trace, fold (shape constants, metadata, ``onnx.checker``), check TensorRT's ops, check
parity with PyTorch, write (rename onto the target).
"""

from __future__ import annotations

import logging
import math
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from fedpose.edge.export.fold import fold_constants
from fedpose.edge.export.outputs import exported_module
from fedpose.edge.export.parity import verify_onnx
from fedpose.edge.export.spec import INPUT_NAME, OPSET, ExportError, ExportOptions, ExportReport, export_outputs
from fedpose.edge.export.trt_ops import nonconstant_restricted_inputs, unsupported_ops
from fedpose.shared.model.face_decode import ordered
from fedpose.shared.model.posenet import PoseNet

log = logging.getLogger(__name__)


def export_onnx(model: PoseNet, out: str | Path, options: ExportOptions = ExportOptions()) -> ExportReport:
    """Export ``model`` (a fused PoseNet; its input size is fixed by the SimCC head) to ONNX at ``out``, fold
    shape constants, check ops, verify with onnxruntime (``ExportOptions`` says how).

    Returns an ``ExportReport`` with the op histogram and the max |onnxruntime - torch|.
    """
    out = Path(out)
    _check_request(model, out, options)
    out.parent.mkdir(parents=True, exist_ok=True)
    model = model.eval()
    tmp = out.with_suffix(".tmp.onnx")
    try:
        _trace(model, tmp, options)
        proto = _fold(model, tmp)
        unsupported, nonconst = _check_trt(proto, out, strict=options.strict_trt)
        diff = _check_parity(model, tmp, options)
    except Exception:
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(out)
    log.info("exported %s (opset %d, batch %s, max |ort - torch| = %.3g)", out, options.opset, options.batch, diff)
    h, w = model.input_size
    return ExportReport(
        path=out,
        input_size=(h, w),
        batch=options.batch,
        opset=options.opset,
        ops=dict(sorted(Counter(n.op_type for n in proto.graph.node).items())),
        max_abs_diff=diff,
        unsupported_ops=tuple(unsupported),
        nonconstant_inputs=tuple(nonconst),
        fp16=options.fp16,
    )


def _check_request(model: PoseNet, out: Path, options: ExportOptions) -> None:
    """Refuse an input size, batch, opset or file name the export cannot honour, before anything is traced."""
    input_size, batch, opset = options.input_size, options.batch, options.opset
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


def _trace(model: PoseNet, tmp: Path, options: ExportOptions) -> None:
    """Trace the exported module (``exported_module``; a half-precision copy for fp16, the caller's model stays
    fp32) with the TorchScript exporter into ``tmp``."""
    h, w = model.input_size
    dtype = torch.float16 if options.fp16 else torch.float32
    if dtype == torch.float32:
        export_model: torch.nn.Module = model
    else:
        import copy

        export_model = copy.deepcopy(model).to(dtype)
    batch = options.batch
    example = torch.rand(1 if batch == "dynamic" else batch, 3, h, w, dtype=dtype)
    outputs = export_outputs(model)
    dynamic_axes = {name: {0: "batch"} for name in (INPUT_NAME, *outputs)} if batch == "dynamic" else None
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
                opset_version=options.opset,
                dynamic_axes=dynamic_axes,
                do_constant_folding=True,
                dynamo=False,
            )


def _fold(model: PoseNet, tmp: Path) -> Any:
    """Fold the shape constants of the traced file, stamp fedpose's metadata, check the model and save it back;
    returns the ModelProto."""
    import onnx

    h, w = model.input_size
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
    return proto


def _check_trt(proto: Any, out: Path, *, strict: bool) -> tuple[list[str], list[str]]:
    """Ops outside the TensorRT 10 parser's list and inputs it needs constant: ``ExportError`` when ``strict``,
    else a warning each. Returns both lists (empty when the graph is TensorRT-ready)."""
    unsupported = unsupported_ops(proto)
    nonconst = nonconstant_restricted_inputs(proto)
    problems = []
    if unsupported:
        problems.append(f"ops not in the TensorRT 10 ONNX parser's support list: {unsupported}")
    if nonconst:
        problems.append(f"inputs TensorRT needs as constants are computed at run time: {nonconst}")
    if problems:
        if strict:
            raise ExportError(f"export of {out} is not TensorRT-ready: " + "; ".join(problems))
        for p in problems:
            log.warning("%s: %s", out, p)
    return unsupported, nonconst


def _check_parity(model: PoseNet, tmp: Path, options: ExportOptions) -> float:
    """Max |onnxruntime - PyTorch| of the file on random images (``verify_onnx``; batches 1 and 3 for a dynamic
    batch); NaN when ``verify`` is off."""
    if not options.verify:
        return math.nan
    tol = options.tolerance if not options.fp16 else max(options.tolerance, 1e-2)
    batches = (1, 3) if options.batch == "dynamic" else (options.batch,)
    return verify_onnx(model, tmp, batch_sizes=batches, tolerance=tol, seed=options.seed, relative=options.fp16)
