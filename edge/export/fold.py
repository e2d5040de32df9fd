"""Constant folding of shape arithmetic: the tracer's Shape -> Gather -> ... -> Pad chains depend only on
H and W, so every shape-derived value that does not depend on the batch size becomes an initializer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedpose.edge.export.spec import OPSET, ExportError

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
