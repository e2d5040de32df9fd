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

What happens to the file after export is here too, since it is build time, not the camera's run time:
INT8 Q/DQ quantization and its PCKh against FP32, and the TensorRT engine build (on the device, in the
camera's slim install: no torch, no ``onnx`` package).

The package: spec (names, parsing, options, report, error), outputs (the traced module: pose outputs, then face
ones), trt_ops (TensorRT 10 operator check), fold (constant folding of shape arithmetic), parity (onnxruntime vs
PyTorch), exporter (``export_onnx``), quantize (INT8 Q/DQ models), onnx_proto (the few fields of an ``.onnx``
read without the ``onnx`` package), trt_build (``.onnx`` -> TensorRT ``.plan``).
"""
