"""ONNX export of a fedpose checkpoint for onnxruntime and TensorRT.

The model that leaves the training side is a BatchNorm-folded ``PoseNet``
(``load_checkpoint`` always returns one), so the graph has no BatchNorm at
all and its output for one image never depends on the rest of the batch.

Export uses the TorchScript-based exporter (``dynamo=False``) at opset 17:
opset 17 is the newest opset TensorRT 8.6 (JetPack 6.0) parses and is inside
TensorRT 10's range (9-20), so one file serves every JetPack 6 device. The
dynamo exporter of torch 2.13 emits opset >= 18 (its down-conversion to 17
fails on Pad) and, in our tests, failed to export the dynamic batch dimension
of this model; it is the exporter to move to once it handles both, since the
TorchScript one is deprecated.

The tracer records the window-attention padding of ``TinyVitBlock`` (computed
from ``x.shape``) as a chain Shape -> Gather -> Mod -> ... -> Pad. Those
amounts only depend on H and W, which are fixed for a SimCC model (its head
has one bin per input pixel), so ``fold_constants`` evaluates every
shape-derived value that does not depend on the batch size and replaces it by
an initializer. After folding every ``Pad`` has constant pads and every op
is checked against ``TRT10_ONNX_OPS``.

Right after writing, the file is run by onnxruntime on random images and
compared with PyTorch; a difference above ``tolerance`` (1e-4) fails the
export (``ExportError``) and the file is removed.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from shared.model.posenet import PoseNet

log = logging.getLogger(__name__)

OPSET = 17
INPUT_NAME = "image"
OUTPUT_NAMES = ("simcc_x", "simcc_y", "visibility")
DEFAULT_TOLERANCE = 1e-4

# ONNX operators the TensorRT 10.x ONNX parser supports (onnx-tensorrt
# docs/operators.md of the 10.x releases, rows marked "Y"). Data, not code:
# update it when the support matrix changes. Restrictions that matter for
# this model are checked separately (constant pads, zero Q/DQ zero points).
TRT10_ONNX_OPS: frozenset[str] = frozenset(
    """
    Abs Acos Acosh Add And ArgMax ArgMin Asin Asinh Atan Atanh AveragePool BatchNormalization
    Cast CastLike Ceil Celu Clip Concat Constant ConstantOfShape Conv ConvTranspose Cos Cosh CumSum
    DeformConv DepthToSpace DequantizeLinear Div Dropout Einsum Elu Equal Erf Exp Expand EyeLike
    Flatten Floor Gather GatherElements GatherND Gelu Gemm GlobalAveragePool GlobalLpPool
    GlobalMaxPool Greater GreaterOrEqual GridSample GroupNormalization GRU HardSigmoid HardSwish
    Hardmax Identity If ImageScaler InstanceNormalization IsInf IsNaN LayerNormalization LeakyRelu
    Less LessOrEqual Log LogSoftmax Loop LRN LSTM LpNormalization LpPool MatMul Max MaxPool Mean
    MeanVarianceNormalization Min Mish Mod Mul Neg NonMaxSuppression NonZero Not OneHot Or Pad
    ParametricSoftplus Pow PRelu QuantizeLinear RandomNormal RandomNormalLike RandomUniform
    RandomUniformLike Range Reciprocal ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp ReduceMax
    ReduceMean ReduceMin ReduceProd ReduceSum ReduceSumSquare Relu Reshape Resize ReverseSequence
    RNN RoiAlign Round ScaledTanh Scan Scatter ScatterElements ScatterND Selu Shape Shrink Sigmoid
    Sign Sin Sinh Size Slice Softmax Softplus Softsign SpaceToDepth Split Sqrt Squeeze Sub Sum Tan
    Tanh ThresholdedRelu Tile TopK Transpose Trilu Unsqueeze Upsample Where Xor
    """.split()
)
# Operators TensorRT 10 parses only when some inputs are initializers (operators.md "Restrictions").
TRT10_CONSTANT_INPUTS: dict[str, tuple[int, ...]] = {
    "Pad": (1, 3),  # pads (we require it constant too: no shape arithmetic on the device), axes
    "Slice": (3,),  # axes
    "Squeeze": (1,),  # axes
    "Unsqueeze": (1,),  # axes
}

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


# ---------------------------------------------------------------------------
# export
# ---------------------------------------------------------------------------


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
    dynamic_axes = {name: {0: "batch"} for name in (INPUT_NAME, *OUTPUT_NAMES)} if batch == "dynamic" else None
    tmp = out.with_suffix(".tmp.onnx")
    try:
        with warnings.catch_warnings():
            # The TorchScript exporter warns about its own deprecation and about
            # shape-derived Python bools (the pad test in TinyVitBlock); both are
            # expected for a fixed-size model and handled by fold_constants.
            warnings.simplefilter("ignore")
            with torch.no_grad():
                torch.onnx.export(
                    export_model,
                    (example,),
                    str(tmp),
                    input_names=[INPUT_NAME],
                    output_names=list(OUTPUT_NAMES),
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


def verify_onnx(
    model: PoseNet,
    onnx_path: str | Path,
    *,
    batch_sizes: tuple[int, ...] = (1,),
    tolerance: float = DEFAULT_TOLERANCE,
    seed: int = 0,
    relative: bool = False,
) -> float:
    """Max |onnxruntime - PyTorch| over all three outputs on random images; raises above ``tolerance``.

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
            ref = [t.numpy() for t in model.eval()(torch.from_numpy(x))]
        feed = x.astype(np.float16) if "float16" in input_type else x
        got = session.run(list(OUTPUT_NAMES), {INPUT_NAME: feed})
        for name, r, g in zip(OUTPUT_NAMES, ref, got):
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


# ---------------------------------------------------------------------------
# graph checks
# ---------------------------------------------------------------------------


def unsupported_ops(model: Any) -> list[str]:
    """Op types (domain-qualified unless default) that the TensorRT 10 parser does not list."""
    bad = set()
    for node in model.graph.node:
        if node.domain not in ("", "ai.onnx") or node.op_type not in TRT10_ONNX_OPS:
            bad.add(node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}")
    return sorted(bad)


def nonconstant_restricted_inputs(model: Any) -> list[str]:
    """``node(input #i)`` entries of ``TRT10_CONSTANT_INPUTS`` that are not initializers/constants."""
    consts = {i.name for i in model.graph.initializer}
    consts |= {o for n in model.graph.node if n.op_type == "Constant" for o in n.output}
    bad = []
    for node in model.graph.node:
        for idx in TRT10_CONSTANT_INPUTS.get(node.op_type, ()):
            if idx < len(node.input) and node.input[idx] and node.input[idx] not in consts:
                bad.append(f"{node.op_type} {node.name or node.output[0]} (input {idx})")
    return bad


def check_qdq_zero_points(model: Any) -> list[str]:
    """Q/DQ nodes whose zero point is not 0 (TensorRT requires symmetric quantization)."""
    from onnx import numpy_helper

    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    bad = []
    for node in model.graph.node:
        if node.op_type in ("QuantizeLinear", "DequantizeLinear") and len(node.input) > 2 and node.input[2]:
            zp = inits.get(node.input[2])
            if zp is None or np.any(zp != 0):
                bad.append(node.name or node.output[0])
    return bad


# ---------------------------------------------------------------------------
# constant folding of shape arithmetic
# ---------------------------------------------------------------------------

# Ops evaluated element-wise on partially known 1-D shape vectors.
_PARTIAL_BINARY = {"Add", "Sub", "Mul", "Div", "Mod"}
_PARTIAL_OPS = {"Shape", "Gather", "Unsqueeze", "Squeeze", "Concat", "Cast", "Identity", "Slice"} | _PARTIAL_BINARY
# Never fold: random ops would freeze one draw.
_NO_FOLD = {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial", "Bernoulli"}


@dataclass
class _Partial:
    """A small integer tensor of which some elements are unknown (None) until run time."""

    values: np.ndarray  # object array, None where unknown
    dtype: np.dtype

    def __post_init__(self) -> None:
        if not isinstance(self.values, np.ndarray):  # numpy returns scalars from 0-d selections
            scalar = np.empty((), dtype=object)
            scalar[()] = self.values
            self.values = scalar

    def known(self) -> np.ndarray | None:
        if any(v is None for v in self.values.flat):
            return None
        return np.array(self.values.tolist(), dtype=self.dtype).reshape(self.values.shape)


def fold_constants(model: Any) -> Any:
    """Replace every value computable without the image by an initializer; returns a new ModelProto.

    Two passes in one topological sweep:
    - a node whose inputs are all known (initializers, Constants, folded
      values) is evaluated with ``onnx.reference`` and dropped;
    - Shape / Gather / Concat / arithmetic on shape vectors are tracked
      element by element (the batch dimension unknown, H/W/C known), so a
      value that depends only on H and W (the attention pads) becomes known
      even with a dynamic batch.
    Unused initializers are removed at the end and shapes re-inferred; the
    sweep repeats until nothing changes, since a folded Reshape target lets
    shape inference find the shapes that the next sweep's Shape nodes need.
    """
    for _ in range(20):
        before = len(model.graph.node)
        model = _fold_once(model)
        if len(model.graph.node) == before:
            return model
    return model


def _fold_once(model: Any) -> Any:
    import onnx
    from onnx import helper, numpy_helper, shape_inference

    model = shape_inference.infer_shapes(model, data_prop=True)
    graph = model.graph
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), OPSET)
    shapes: dict[str, list[int | None]] = {}
    for vi in list(graph.input) + list(graph.value_info) + list(graph.output):
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape"):
            shapes[vi.name] = [d.dim_value if d.HasField("dim_value") else None for d in vi.type.tensor_type.shape.dim]
    known: dict[str, np.ndarray] = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    partial: dict[str, _Partial] = {}
    kept = []
    for node in graph.node:
        if node.op_type == "Constant":
            known[node.output[0]] = _constant_value(node)
            continue
        inputs = [i for i in node.input if i]
        if node.op_type not in _NO_FOLD and node.domain in ("", "ai.onnx") and all(i in known for i in inputs):
            values = _run_node(node, [known[i] if i else None for i in node.input], opset)
            known.update(zip(node.output, values))
            continue
        if node.op_type in _PARTIAL_OPS and node.domain in ("", "ai.onnx"):
            result = _partial_eval(node, known, partial, shapes)
            if result is not None:
                value = result.known()
                if value is not None:
                    known[node.output[0]] = value
                    continue
                partial[node.output[0]] = result
        kept.append(node)

    used = {i for n in kept for i in n.input if i} | {o.name for o in graph.output}
    new_inits = [numpy_helper.from_array(np.asarray(v), name) for name, v in known.items() if name in used]
    for out in graph.output:  # an output that folded entirely (never the case here) still needs a producer
        if out.name in known and not any(out.name in n.output for n in kept):
            kept.append(helper.make_node("Identity", [out.name + "_const"], [out.name]))
            new_inits.append(numpy_helper.from_array(np.asarray(known[out.name]), out.name + "_const"))
    new_graph = helper.make_graph(
        kept, graph.name, list(graph.input), list(graph.output), initializer=new_inits
    )
    new_model = helper.make_model(new_graph, opset_imports=list(model.opset_import))
    new_model.ir_version = model.ir_version
    new_model.producer_name = model.producer_name
    new_model.producer_version = model.producer_version
    return onnx.shape_inference.infer_shapes(new_model)


def _constant_value(node: Any) -> np.ndarray:
    from onnx import helper, numpy_helper

    attr = node.attribute[0]
    if attr.name == "value":
        return numpy_helper.to_array(attr.t)
    value = helper.get_attribute_value(attr)
    dtypes = {"value_int": np.int64, "value_ints": np.int64, "value_float": np.float32, "value_floats": np.float32}
    if attr.name not in dtypes:
        raise ExportError(f"unsupported Constant attribute {attr.name} in node {node.name}")
    return np.array(value, dtype=dtypes[attr.name])


def _run_node(node: Any, inputs: list[np.ndarray | None], opset: int) -> list[np.ndarray]:
    """Evaluate one node on constant inputs with ONNX's reference implementation."""
    from onnx import helper
    from onnx.reference import ReferenceEvaluator

    names = [f"in{i}" if name else "" for i, name in enumerate(node.input)]
    single = helper.make_node(node.op_type, names, [f"out{i}" for i in range(len(node.output))], domain=node.domain)
    single.attribute.extend(node.attribute)
    feeds = {n: v for n, v in zip(names, inputs) if n}
    graph = helper.make_graph(
        [single],
        "fold",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape) for n, v in feeds.items()],
        [helper.make_tensor_value_info(o, 0, None) for o in single.output],
    )
    evaluator = ReferenceEvaluator(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]))
    return [np.asarray(v) for v in evaluator.run(None, feeds)]


def _as_partial(name: str, known: dict[str, np.ndarray], partial: dict[str, _Partial]) -> _Partial | None:
    if name in partial:
        return partial[name]
    if name in known:
        arr = np.asarray(known[name])
        return _Partial(np.array(arr.tolist(), dtype=object).reshape(arr.shape), arr.dtype)
    return None


def _partial_eval(
    node: Any,
    known: dict[str, np.ndarray],
    partial: dict[str, _Partial],
    shapes: dict[str, list[int | None]],
) -> _Partial | None:
    """Element-wise evaluation of shape arithmetic; None when the node is not shape arithmetic."""
    from onnx import helper

    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    op = node.op_type
    if op == "Shape":
        dims = shapes.get(node.input[0])
        if dims is None:
            return None
        start, end = attrs.get("start", 0), attrs.get("end", len(dims))
        return _Partial(np.array(dims[slice(start, end)], dtype=object), np.dtype(np.int64))
    args = [_as_partial(i, known, partial) if i else None for i in node.input]
    if args and args[0] is None:
        return None
    data = args[0]
    if op in ("Identity", "Cast"):
        dtype = data.dtype
        if op == "Cast":
            dtype = np.dtype(helper.tensor_dtype_to_np_dtype(attrs["to"]))
            if not np.issubdtype(dtype, np.integer):
                return None
        return _Partial(data.values.copy(), dtype)
    if op == "Gather":
        if node.input[1] not in known or attrs.get("axis", 0) != 0:
            return None
        return _Partial(np.take(data.values, known[node.input[1]], axis=0), data.dtype)
    if op == "Unsqueeze":
        if node.input[1] not in known:
            return None
        values = data.values
        for axis in sorted(int(a) for a in np.atleast_1d(known[node.input[1]])):
            values = np.expand_dims(values, axis if axis >= 0 else values.ndim + 1 + axis)
        return _Partial(values, data.dtype)
    if op == "Squeeze":
        if len(node.input) < 2 or node.input[1] not in known:
            return None
        axes = tuple(int(a) for a in np.atleast_1d(known[node.input[1]]))
        return _Partial(np.squeeze(data.values, axis=axes), data.dtype)
    if op == "Concat":
        if any(a is None for a in args):
            return None
        return _Partial(np.concatenate([a.values for a in args], axis=attrs["axis"]), data.dtype)
    if op == "Slice":
        if data.values.ndim != 1 or any(i not in known for i in node.input[1:] if i):
            return None
        starts, ends = int(known[node.input[1]][0]), int(known[node.input[2]][0])
        steps = int(known[node.input[4]][0]) if len(node.input) > 4 and node.input[4] else 1
        n = data.values.shape[0]
        ends = max(min(ends, n), -n - 1)
        return _Partial(data.values[slice(starts, ends, steps)], data.dtype)
    if op in _PARTIAL_BINARY:
        a, b = args[0], args[1] if len(args) > 1 else None
        if b is None or not np.issubdtype(a.dtype, np.integer):
            return None
        fmod = attrs.get("fmod", 0)

        def apply(x: Any, y: Any) -> Any:
            if x is None or y is None:
                return None
            x, y = int(x), int(y)
            if op == "Add":
                return x + y
            if op == "Sub":
                return x - y
            if op == "Mul":
                return x * y
            if op == "Div":
                return int(x / y) if y else None  # integer Div truncates towards zero
            if y == 0:
                return None
            return int(math.fmod(x, y)) if fmod else x % y  # Mod: sign of the divisor unless fmod

        av, bv = np.broadcast_arrays(a.values, b.values)
        out = np.empty(av.shape, dtype=object)
        for idx in np.ndindex(av.shape):
            out[idx] = apply(av[idx], bv[idx])
        return _Partial(out, a.dtype)
    return None
