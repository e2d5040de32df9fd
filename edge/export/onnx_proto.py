"""Read what the TensorRT build needs from an ``.onnx`` file without the ``onnx`` package.

A camera builds its engine in the slim install (docs/how-to/jetson.md: numpy, OpenCV, onnxruntime and
TensorRT; no torch, no train extra), so ``fedpose edge build`` cannot import ``onnx`` just to learn the
input's name, shape and type and whether the graph has Q/DQ nodes. An ONNX file is one protobuf message
(``ModelProto``); this module walks its wire format for those few fields and skips everything else
(weights included) by length, so reading a model costs one pass over its bytes and no copies.

Field numbers, from onnx/onnx.proto3 (stable since IR version 3):

    ModelProto.graph = 7
    GraphProto: node = 1, initializer = 5, input = 11
    NodeProto.op_type = 4          TensorProto.name = 8
    ValueInfoProto: name = 1, type = 2
    TypeProto.tensor_type = 1      TypeProto.Tensor: elem_type = 1, shape = 2
    TensorShapeProto.dim = 1       Dimension: dim_value = 1, dim_param = 2

Only the top-level graph is read (the exporter writes no subgraphs; TensorRT's Q/DQ detection cares
about the top level too). ``tests/test_edge_export.py`` holds the reader to ``onnx.load`` on real
exports (fixed and dynamic batch, FP16, Q/DQ).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

FLOAT16 = 10  # onnx.TensorProto.FLOAT16

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


class ProtoError(ValueError):
    """The bytes are not a well-formed protobuf message."""


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(buf):
            raise ProtoError("truncated varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ProtoError("varint longer than 10 bytes")


def _fields(buf: memoryview) -> Iterator[tuple[int, int, int | memoryview]]:
    """(field number, wire type, value) for each field of one message: ints for varints and fixed-size
    fields, a memoryview of the payload for length-delimited ones."""
    pos, end = 0, len(buf)
    while pos < end:
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise ProtoError("field number 0")
        if wire == _VARINT:
            value, pos = _varint(buf, pos)
            yield number, wire, value
        elif wire == _LEN:
            size, pos = _varint(buf, pos)
            if pos + size > end:
                raise ProtoError(f"field {number} runs past the end ({size} bytes at offset {pos} of {end})")
            yield number, wire, buf[pos : pos + size]
            pos += size
        elif wire in (_I64, _I32):
            size = 8 if wire == _I64 else 4
            if pos + size > end:
                raise ProtoError("truncated fixed-size field")
            yield number, wire, int.from_bytes(buf[pos : pos + size], "little")
            pos += size
        else:  # groups (3, 4) are not used by ONNX; anything else is not protobuf
            raise ProtoError(f"wire type {wire} in field {number}")


def _sub(buf: memoryview, number: int) -> list[memoryview]:
    return [v for n, w, v in _fields(buf) if n == number and w == _LEN]  # type: ignore[misc]


def _text(buf: memoryview, number: int) -> str:
    found = _sub(buf, number)
    return bytes(found[-1]).decode("utf-8", "replace") if found else ""


@dataclass(frozen=True)
class GraphInput:
    """A graph input: name, element type (onnx.TensorProto enum) and dims (None where symbolic or unset)."""

    name: str
    elem_type: int
    dims: tuple[int | None, ...]


@dataclass(frozen=True)
class OnnxGraph:
    """The top-level facts of an ONNX model: its real inputs (initializers excluded) and its node op types."""

    inputs: tuple[GraphInput, ...]
    op_types: frozenset[str]


def _graph_input(value_info: memoryview) -> GraphInput:
    elem_type, dims = 0, []
    for type_proto in _sub(value_info, 2):
        for tensor in _sub(type_proto, 1):
            for n, w, v in _fields(tensor):
                if n == 1 and w == _VARINT:
                    elem_type = int(v)  # type: ignore[arg-type]
                elif n == 2 and w == _LEN:
                    for dim in _sub(v, 1):  # type: ignore[arg-type]
                        values = [int(x) for m, wt, x in _fields(dim) if m == 1 and wt == _VARINT]  # type: ignore[arg-type]
                        dims.append(values[-1] if values else None)
    return GraphInput(name=_text(value_info, 1), elem_type=elem_type, dims=tuple(dims))


def read_graph(data: bytes) -> OnnxGraph:
    """Parse a serialized ModelProto's top-level graph; ``ProtoError`` when the bytes are not one."""
    model = memoryview(data)
    graphs = [v for n, w, v in _fields(model) if n == 7 and w == _LEN]
    if not graphs:
        raise ProtoError("no graph (ModelProto field 7)")
    graph = graphs[-1]
    inits: set[str] = set()
    inputs: list[GraphInput] = []
    ops: set[str] = set()
    for n, w, v in _fields(graph):  # type: ignore[arg-type]
        if w != _LEN:
            continue
        if n == 1:
            ops.add(_text(v, 4))  # type: ignore[arg-type]
        elif n == 5:
            inits.add(_text(v, 8))  # type: ignore[arg-type]
        elif n == 11:
            inputs.append(_graph_input(v))  # type: ignore[arg-type]
    return OnnxGraph(inputs=tuple(i for i in inputs if i.name not in inits), op_types=frozenset(ops))
