"""ONNX export: parity with PyTorch, a TensorRT-parsable graph, INT8 Q/DQ, TensorRT build requests.

Models here have random weights (parity and graph structure do not depend on
training); the trained-model checks (pipeline accuracy, INT8 PCKh drop on a
trained model) live in test_edge_pipeline.py.
"""

from __future__ import annotations

import importlib.util
import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from fedpose.edge.export.spec import (INPUT_NAME, OUTPUT_NAMES, ExportError, ExportOptions, parse_batch,
                                      parse_input_size)
from fedpose.edge.export.trt_ops import TRT10_ONNX_OPS, nonconstant_restricted_inputs, unsupported_ops
from fedpose.edge.export.exporter import export_onnx
from fedpose.edge.export.fold import fold_constants
from fedpose.edge.export.parity import verify_onnx
from fedpose.edge.export.quantize import compare_precisions, quantize_int8, record_crops
from fedpose.edge.export.trt_build import (
    TRT_INSTALL_HINT,
    build_engine,
    check_build_request,
    parse_profile,
    read_onnx_info,
    trtexec_command,
)
from fedpose.shared.configuration.schema import ModelConfig
from fedpose.shared.model.posenet import build_model

INPUT = (64, 48)
HAS_TRT = importlib.util.find_spec("tensorrt") is not None and importlib.util.find_spec("cuda") is not None
TRT_SKIP = (
    "TensorRT and cuda-python are not installed here (pip install 'fedpose[tensorrt]' on an NVIDIA machine; Jetson: "
    "python3-libnvinfer and cuda-python)"
)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model(ModelConfig(variant="tinyvit-small"), INPUT).eval()


@pytest.fixture(scope="module")
def exported(model, tmp_path_factory):
    """batch -> (path, report) for a fixed batch of 1 and a dynamic batch."""
    root = tmp_path_factory.mktemp("export")
    out = {}
    for batch in (1, "dynamic"):
        path = root / f"pose_{batch}.onnx"
        out[batch] = (path, export_onnx(model, path, ExportOptions(batch=batch)))
    return out


def _ort_vs_torch(model, path, n, seed=1):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(seed).random((n, 3, *INPUT), dtype=np.float32)
    with torch.no_grad():
        ref = [t.numpy() for t in model(torch.from_numpy(x))]
    got = session.run(list(OUTPUT_NAMES), {INPUT_NAME: x})
    return max(float(np.abs(r - g).max()) for r, g in zip(ref, got)), got


@pytest.mark.parametrize("batch,run_sizes", [(1, (1,)), ("dynamic", (1, 4))])
def test_onnx_matches_pytorch(model, exported, batch, run_sizes):
    path, report = exported[batch]
    assert report.max_abs_diff <= 1e-4
    for n in run_sizes:
        diff, got = _ort_vs_torch(model, path, n)
        assert diff <= 1e-4, f"batch {n}: max abs diff {diff}"
        assert got[0].shape == (n, 16, INPUT[1] * 2) and got[1].shape == (n, 16, INPUT[0] * 2)
        assert got[2].shape == (n, 16)


def test_io_names_and_batch_dimension(exported):
    fixed = onnx.load(str(exported[1][0]))
    dynamic = onnx.load(str(exported["dynamic"][0]))
    for m in (fixed, dynamic):
        assert [i.name for i in m.graph.input] == [INPUT_NAME]
        assert [o.name for o in m.graph.output] == list(OUTPUT_NAMES)
        assert m.opset_import[0].version == 17
    dims = lambda m: m.graph.input[0].type.tensor_type.shape.dim  # noqa: E731
    assert [d.dim_value for d in dims(fixed)] == [1, 3, *INPUT]
    assert dims(dynamic)[0].dim_param == "batch" and [d.dim_value for d in dims(dynamic)[1:]] == [3, *INPUT]


def test_the_model_contract_holds_in_a_second_consumer(model, exported):
    """docs/reference/model-contract.md: the metadata keys, and the same outputs from OpenCV's DNN module (what
    an integrator's C++ pipeline loads) as from onnxruntime, on the same input."""
    import cv2

    path = exported[1][0]
    meta = {p.key: p.value for p in onnx.load(str(path)).metadata_props}
    assert meta == {"fedpose.input_size": f"{INPUT[0]}x{INPUT[1]}", "fedpose.split_ratio": "2.0",
                    "fedpose.variant": "tinyvit-small"}
    x = np.random.default_rng(3).random((1, 3, *INPUT), dtype=np.float32)  # RGB in [0, 1], NCHW
    ref = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(list(OUTPUT_NAMES), {INPUT_NAME: x})
    net = cv2.dnn.readNetFromONNX(str(path))
    net.setInput(x, INPUT_NAME)
    got = net.forward(list(OUTPUT_NAMES))
    for name, r, g in zip(OUTPUT_NAMES, ref, got):
        assert g.shape == r.shape, name
        assert float(np.abs(g - r).max()) <= 1e-4, name


def _expected_window_pads(model):
    """(bottom, right) pad of every attention block that pads, from TinyVitBlock's rule; a map that fits in one
    window folds its padding instead (no Pad node)."""
    h, w = math.ceil(INPUT[0] / 4), math.ceil(INPUT[1] / 4)  # after the patch embedding
    out = []
    for stage in list(model.stages)[1:]:
        h, w = math.ceil(h / 2), math.ceil(w / 2)  # PatchMerging
        for block in stage.blocks:
            ws = block.window
            pad = ((ws - h % ws) % ws, (ws - w % ws) % ws)
            if any(pad) and (h > ws or w > ws):
                out.append(pad)
    return sorted(out)


@pytest.mark.parametrize("batch", [1, "dynamic"])
def test_graph_is_tensorrt_ready(model, exported, batch):
    path, report = exported[batch]
    m = onnx.load(str(path))
    ops = {n.op_type for n in m.graph.node}
    assert ops <= TRT10_ONNX_OPS, sorted(ops - TRT10_ONNX_OPS)
    assert report.unsupported_ops == () and report.nonconstant_inputs == ()
    assert "BatchNormalization" not in ops  # folded before export
    inits = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
    pads = [n for n in m.graph.node if n.op_type == "Pad"]
    for node in pads:
        assert node.input[1] in inits, f"{node.name}: pad amounts are computed at run time"
    # NHWC pads [0, 0, 0, 0, 0, bottom, right, 0]: exactly the windows' padding of this input size.
    got = sorted((int(inits[n.input[1]][5]), int(inits[n.input[1]][6])) for n in pads)
    assert got and got == _expected_window_pads(model), got
    if batch == 1:
        # A fixed shape leaves no shape arithmetic at all.
        assert not ops & {"Shape", "Gather", "ConstantOfShape", "Mod"}


def test_op_checks_flag_unsupported_ops():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Unique", ["r"], ["u"]),
        helper.make_node("FusedConv", ["u"], ["y"], domain="com.microsoft"),
    ]
    m = helper.make_model(helper.make_graph(nodes, "g", [x], [y]))
    assert unsupported_ops(m) == ["Unique", "com.microsoft::FusedConv"]


def test_static_shape_arithmetic_is_folded_into_constant_pads():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    p = helper.make_tensor_value_info("p", TensorProto.FLOAT, None)
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Concat", ["s", "s"], ["pads"], axis=0),
             helper.make_node("Pad", ["x", "pads"], ["p"])]
    raw = helper.make_model(helper.make_graph(nodes, "g", [x], [p]))
    assert len(nonconstant_restricted_inputs(raw)) == 1  # computed at run time before folding
    folded = fold_constants(raw)
    assert [n.op_type for n in folded.graph.node] == ["Pad"]
    assert nonconstant_restricted_inputs(folded) == []
    pads = {i.name: numpy_helper.to_array(i) for i in folded.graph.initializer}[folded.graph.node[0].input[1]]
    assert pads.tolist() == [2, 3, 2, 3]


def test_computed_pads_are_reported():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])
    p = helper.make_tensor_value_info("p", TensorProto.FLOAT, None)
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Concat", ["s", "s"], ["pads"], axis=0),
             helper.make_node("Pad", ["x", "pads"], ["p"])]
    m = fold_constants(helper.make_model(helper.make_graph(nodes, "g", [x], [p])))
    # The pads depend on the dynamic dimension n: folding must keep them computed, and the check must say so.
    assert len(nonconstant_restricted_inputs(m)) == 1


def test_verification_catches_a_wrong_graph(model, exported, tmp_path):
    path, _ = exported[1]
    wrong = build_model(ModelConfig(variant="tinyvit-small"), INPUT).eval()  # other random weights
    with pytest.raises(ExportError, match="differs from PyTorch"):
        verify_onnx(wrong, path)
    assert verify_onnx(model, path) <= 1e-4


def test_export_rejects_bad_requests(model, tmp_path):
    with pytest.raises(ValueError, match="tied to the training input size"):
        export_onnx(model, tmp_path / "m.onnx", ExportOptions(input_size=(128, 96)))
    with pytest.raises(ValueError, match="batch"):
        export_onnx(model, tmp_path / "m.onnx", ExportOptions(batch=0))
    with pytest.raises(ValueError, match=r"\.onnx"):
        export_onnx(model, tmp_path / "m.pt")
    assert parse_batch("dynamic") == "dynamic" and parse_batch("4") == 4
    with pytest.raises(ValueError):
        parse_batch("many")
    assert parse_input_size("128x96") == (128, 96)
    with pytest.raises(ValueError):
        parse_input_size("128")
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_fp16_export_runs(model, tmp_path):
    report = export_onnx(model, tmp_path / "m16.onnx", ExportOptions(fp16=True))
    info = read_onnx_info(report.path)
    assert info.fp16 and report.max_abs_diff <= 1e-2


def test_int8_qdq_runs_and_reports_accuracy(model, exported, tmp_path):
    from fedpose.shared.data.mpii import load_split
    from fedpose.shared.data.synth.ward import WardSpec, generate_ward

    root = generate_ward(tmp_path / "ward", WardSpec(sites=1, per_site=1, public=24, val=8, seed=3), progress=False)
    public, val = load_split(root, "public"), load_split(root, "val")
    calib = record_crops(public, INPUT)
    assert calib.shape == (24, 3, *INPUT) and calib.dtype == np.float32 and 0 <= calib.min() and calib.max() <= 1
    fp32, _ = exported["dynamic"]
    int8 = quantize_int8(fp32, tmp_path / "m.int8.onnx", calib)
    m = onnx.load(str(int8))
    ops = {n.op_type for n in m.graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops and ops <= TRT10_ONNX_OPS
    zero_points = [numpy_helper.to_array(i) for i in m.graph.initializer if i.name.endswith("zero_point")]
    assert zero_points and all(np.all(z == 0) for z in zero_points)  # TensorRT needs symmetric Q/DQ
    # The INT8 model runs and stays close to FP32 (relative to the logit range).
    s32 = ort.InferenceSession(str(fp32), providers=["CPUExecutionProvider"])
    s8 = ort.InferenceSession(str(int8), providers=["CPUExecutionProvider"])
    a = s32.run(["simcc_x"], {INPUT_NAME: calib[:4]})[0]
    b = s8.run(["simcc_x"], {INPUT_NAME: calib[:4]})[0]
    assert np.abs(a - b).max() < 0.25 * (a.max() - a.min())
    report = compare_precisions(fp32, int8, val)
    assert report.records == 8
    for side in (report.fp32, report.int8):
        assert 0.0 <= side["pckh"]["mean"] <= 100.0
    assert math.isfinite(report.drop)
    print(f"\nINT8 vs FP32 (random weights, 8 val people): PCKh {report.fp32['pckh']['mean']:.1f} -> "
          f"{report.int8['pckh']['mean']:.1f}")
    cpu = quantize_int8(fp32, tmp_path / "m.cpu.int8.onnx", calib, target="cpu")  # onnxruntime's fast layout
    c = ort.InferenceSession(str(cpu), providers=["CPUExecutionProvider"]).run(["simcc_x"], {INPUT_NAME: calib[:4]})[0]
    assert np.abs(a - c).max() < 0.25 * (a.max() - a.min())
    assert any(n.op_type == "QuantizeLinear" for n in onnx.load(str(cpu)).graph.node)
    with pytest.raises(ValueError, match="calibration images must be"):
        quantize_int8(fp32, tmp_path / "bad.onnx", calib[:, :, :32])
    with pytest.raises(ValueError, match="already quantized"):
        quantize_int8(int8, tmp_path / "twice.onnx", calib)


# ---------------------------------------------------------------------------
# TensorRT build requests (validated without TensorRT) and the build itself
# ---------------------------------------------------------------------------


def test_build_requests_are_validated(exported, tmp_path):
    fixed, _ = exported[1]
    dynamic, _ = exported["dynamic"]
    req = check_build_request(dynamic, tmp_path / "m.plan", precision="fp16", batch=(1, 4, 8))
    line = trtexec_command(req)
    assert "--fp16" in line and "--memPoolSize=workspace:1024M" in line
    assert f"--minShapes=image:1x3x{INPUT[0]}x{INPUT[1]}" in line and "--maxShapes=image:8x3x64x48" in line
    line11 = trtexec_command(req, trt_major=11)
    assert "--stronglyTyped" in line11 and "--fp16" not in line11
    assert check_build_request(dynamic, tmp_path / "m.plan").profile == (1, 1, 4)
    assert check_build_request(fixed, tmp_path / "m.plan").profile is None
    with pytest.raises(ValueError, match="Q/DQ"):
        check_build_request(fixed, tmp_path / "m.plan", precision="int8")
    with pytest.raises(ValueError, match="fixed batch"):
        check_build_request(fixed, tmp_path / "m.plan", batch=(1, 2, 4))
    with pytest.raises(ValueError, match="strongly typed"):
        check_build_request(fixed, tmp_path / "m.plan", precision="fp16", trt_major=11)
    with pytest.raises(ValueError, match=r"\.plan"):
        check_build_request(fixed, tmp_path / "m.onnx")
    assert parse_profile("2") == (2, 2, 2) and parse_profile("1,4,8") == (1, 4, 8)
    with pytest.raises(ValueError):
        parse_profile("8,4,1")
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\x00not a protobuf" * 10)
    with pytest.raises(ValueError, match="garbage.onnx"):
        check_build_request(garbage, tmp_path / "m.plan")


def test_onnx_info_reads_what_onnx_reads(model, exported, tmp_path):
    """The build reads the file without the onnx package (the camera has none): it must agree with onnx.load."""
    fp16 = export_onnx(model, tmp_path / "m16.onnx", ExportOptions(fp16=True)).path
    calib = np.random.default_rng(0).random((4, 3, *INPUT), dtype=np.float32)
    qdq = quantize_int8(exported["dynamic"][0], tmp_path / "m.int8.onnx", calib)
    for path in (exported[1][0], exported["dynamic"][0], fp16, qdq):
        m = onnx.load(str(path), load_external_data=False)
        inits = {i.name for i in m.graph.initializer}
        (inp,) = [i for i in m.graph.input if i.name not in inits]
        dims = [d.dim_value if d.HasField("dim_value") else None for d in inp.type.tensor_type.shape.dim]
        info = read_onnx_info(path)
        assert (info.input_name, info.batch, info.input_size) == (inp.name, dims[0], (dims[2], dims[3])), path
        assert info.fp16 == (inp.type.tensor_type.elem_type == TensorProto.FLOAT16), path
        assert info.qdq == any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in m.graph.node), path
    assert [read_onnx_info(p).qdq for p in (exported[1][0], qdq)] == [False, True]
    assert read_onnx_info(exported["dynamic"][0]).batch is None and read_onnx_info(fp16).fp16
    truncated = tmp_path / "cut.onnx"
    truncated.write_bytes(exported[1][0].read_bytes()[:5000])
    with pytest.raises(ValueError, match="cut.onnx is not a readable ONNX file"):
        read_onnx_info(truncated)


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None,
                    reason="TensorRT is installed: the install hint path does not apply")
def test_build_without_tensorrt_gives_install_hint(exported, tmp_path):
    with pytest.raises(ImportError, match=r"pip install 'fedpose\[tensorrt\]'.*python3-libnvinfer") as err:
        build_engine(exported[1][0], tmp_path / "m.plan")
    assert str(err.value) == TRT_INSTALL_HINT
    assert not (tmp_path / "m.plan").exists()


@pytest.mark.skipif(not HAS_TRT, reason=TRT_SKIP)
def test_tensorrt_engine_matches_onnxruntime(exported, tmp_path):  # pragma: no cover - needs an NVIDIA GPU
    if not torch.cuda.is_available():
        pytest.skip("TensorRT is installed but no CUDA GPU is visible")
    from fedpose.edge.runtime import make_runtime

    plan = build_engine(exported["dynamic"][0], tmp_path / "m.plan", precision="fp32", batch=(1, 2, 4))
    x = np.random.default_rng(0).random((3, 3, *INPUT), dtype=np.float32)
    with make_runtime(plan) as trt_rt, make_runtime(exported["dynamic"][0]) as ort_rt:
        a, b = trt_rt.infer(x), ort_rt.infer(x)
    assert np.abs(a[0] - b[0]).max() < 1e-3


@pytest.mark.skipif(not HAS_TRT, reason=TRT_SKIP)
@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_reduced_precision_engines_agree_with_onnxruntime(model, exported, tmp_path, precision):  # pragma: no cover
    """FP16 and INT8 (Q/DQ) engines against onnxruntime FP32 on the same inputs, through the decode: the bound
    docs/how-to/edge.md states (keypoints within 1 input pixel for 95% of joints at FP16, 2 px at INT8)."""
    if not torch.cuda.is_available():
        pytest.skip("TensorRT is installed but no CUDA GPU is visible")
    from fedpose.edge.runtime import make_runtime
    from fedpose.shared.model.simcc_decode import decode_simcc

    source = exported["dynamic"][0]
    if precision == "int8":
        source = quantize_int8(source, tmp_path / "q.onnx",
                               np.random.default_rng(0).random((16, 3, *INPUT), dtype=np.float32), target="tensorrt")
    plan = build_engine(source, tmp_path / f"m-{precision}.plan", precision=precision, batch=(1, 2, 4))
    x = np.random.default_rng(1).random((4, 3, *INPUT), dtype=np.float32)
    with make_runtime(plan) as trt_rt, make_runtime(exported["dynamic"][0]) as ort_rt:
        got, ref = trt_rt.infer(x), ort_rt.infer(x)
    kp_got, _ = decode_simcc(got[0], got[1], split_ratio=2.0)
    kp_ref, _ = decode_simcc(ref[0], ref[1], split_ratio=2.0)
    within = np.linalg.norm(kp_got - kp_ref, axis=-1) <= (1.0 if precision == "fp16" else 2.0)
    assert within.mean() >= 0.95, float(within.mean())
