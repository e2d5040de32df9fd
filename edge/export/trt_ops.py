"""Whether TensorRT 10 can take a graph: the parser's supported operators (data, from onnx-tensorrt's
operators.md), inputs it needs constant, and Q/DQ zero points.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# ONNX operators the TensorRT 10.x ONNX parser supports
# (onnx-tensorrt/docs/operators.md of the 10.x releases, rows marked "Y"). Data, not code:
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
