"""One runtime interface over PyTorch, onnxruntime and TensorRT; pure numpy pre/post-processing.

The interface suite runs for every backend; TensorRT needs an NVIDIA GPU and
the tensorrt package, so its parametrization is skipped here with that reason.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from fedpose.edge.export.exporter import export_onnx
from fedpose.edge.export.spec import ExportOptions
from fedpose.edge.runtime.onnx import OnnxRuntime
from fedpose.edge.pipeline.tracking import BoxTracker
from fedpose.edge.runtime.prepost import box_from_keypoints, box_to_center_scale, clip_box, postprocess, preprocess
from fedpose.edge.runtime import backend_for, make_runtime
from fedpose.edge.runtime.pytorch import TorchRuntime
from fedpose.shared.configuration.schema import ModelConfig
from fedpose.shared.data.transforms import affine_matrix, warp_points
from fedpose.shared.model.posenet import build_model, save_checkpoint

INPUT = (64, 48)
HAS_TRT = importlib.util.find_spec("tensorrt") is not None and importlib.util.find_spec("cuda") is not None
TRT_SKIP = (
    "TensorRT engines need the tensorrt package and an NVIDIA GPU "
    "(pip install 'fedpose[tensorrt]'; Jetson: python3-libnvinfer); neither is present here"
)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A random-weight checkpoint and its ONNX exports (dynamic batch and fixed batch 2)."""
    root = tmp_path_factory.mktemp("runtime")
    torch.manual_seed(1)
    model = build_model(ModelConfig(variant="tinyvit-small"), INPUT).eval()
    save_checkpoint(root / "model.pt", model)
    export_onnx(model, root / "model.onnx", ExportOptions(batch="dynamic"))
    export_onnx(model, root / "model_b2.onnx", ExportOptions(batch=2))
    return {"model": model, "pt": root / "model.pt", "onnx": root / "model.onnx", "onnx_b2": root / "model_b2.onnx",
            "root": root}


def _model_file(files, backend):
    if backend == "tensorrt":
        if not HAS_TRT or not torch.cuda.is_available():
            pytest.skip(TRT_SKIP)
        from fedpose.edge.export.trt_build import build_engine  # pragma: no cover - GPU only

        plan = files["root"] / "model.plan"  # pragma: no cover
        if not plan.exists():  # pragma: no cover
            build_engine(files["onnx"], plan, precision="fp32", batch=(1, 2, 4))
        return plan  # pragma: no cover
    return files["pt"] if backend == "torch" else files["onnx"]


BACKENDS = ["torch", "onnxruntime", "tensorrt"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_interface_shapes_and_values(files, backend):
    path = _model_file(files, backend)
    x = np.random.default_rng(0).random((3, 3, *INPUT), dtype=np.float32)
    with torch.no_grad():
        ref_x, ref_y, _ = (t.numpy() for t in files["model"](torch.from_numpy(x)))
    with make_runtime(path) as rt:
        assert rt.backend == backend
        assert rt.input_size == INPUT
        sx, sy = rt.infer(x)
        again = rt.infer(x)
    assert sx.dtype == np.float32 and sy.dtype == np.float32
    assert sx.shape == (3, 16, INPUT[1] * 2) and sy.shape == (3, 16, INPUT[0] * 2)
    tol = 1e-4 if backend != "tensorrt" else 1e-3
    assert np.abs(sx - ref_x).max() <= tol and np.abs(sy - ref_y).max() <= tol
    assert np.array_equal(sx, again[0])  # deterministic
    # The same image alone gives the same answer as inside a batch (no cross-sample coupling).
    with make_runtime(path) as rt:
        single = rt.infer(x[1:2])
    assert np.abs(single[0][0] - sx[1]).max() <= tol


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "shape,dtype,match",
    [
        ((1, 3, 32, 48), np.float32, r"expects input \(N, 3, 64, 48\)"),
        ((1, 3, 48, 64), np.float32, r"expects input \(N, 3, 64, 48\)"),
        ((3, 64, 48), np.float32, r"expects input"),
        ((1, 1, 64, 48), np.float32, r"expects input"),
        ((1, 3, 64, 48), np.float64, r"expects float32"),
        ((0, 3, 64, 48), np.float32, r"empty batch"),
    ],
)
def test_bad_input_names_the_model_file(files, backend, shape, dtype, match):
    path = _model_file(files, backend)
    with make_runtime(path) as rt:
        with pytest.raises(ValueError, match=match) as err:
            rt.infer(np.zeros(shape, dtype=dtype))
    assert str(path) in str(err.value)


def test_fixed_batch_model_takes_any_batch(files):
    x = np.random.default_rng(2).random((5, 3, *INPUT), dtype=np.float32)
    with make_runtime(files["onnx_b2"]) as fixed, make_runtime(files["onnx"]) as dynamic:
        assert fixed.fixed_batch == 2 and dynamic.fixed_batch is None
        a, b = fixed.infer(x), dynamic.infer(x)
    assert a[0].shape == (5, 16, 96)
    assert np.abs(a[0] - b[0]).max() <= 1e-4 and np.abs(a[1] - b[1]).max() <= 1e-4


def test_backend_is_chosen_by_suffix(files, tmp_path):
    assert backend_for("m.pt") == "torch" and backend_for("m.onnx") == "onnxruntime"
    assert backend_for("m.plan") == "tensorrt" and backend_for("m.engine") == "tensorrt"
    assert backend_for("weights.bin", "onnxruntime") == "onnxruntime"
    with pytest.raises(ValueError, match="suffix"):
        backend_for("m.tflite")
    with pytest.raises(ValueError, match="unknown backend"):
        backend_for("m.onnx", "tflite")
    assert isinstance(make_runtime(files["pt"]), TorchRuntime)
    assert isinstance(make_runtime(files["onnx"]), OnnxRuntime)
    with pytest.raises(FileNotFoundError, match="missing.onnx"):
        make_runtime(tmp_path / "missing.onnx")


@pytest.mark.parametrize("suffix", [".onnx", ".pt"])
def test_corrupt_model_file_is_named(tmp_path, suffix):
    bad = tmp_path / f"broken{suffix}"
    bad.write_bytes(b"\x08\x01garbage, not a model" * 20)
    with pytest.raises(ValueError) as err:
        make_runtime(bad)
    assert str(bad) in str(err.value)


def test_truncated_onnx_is_named(files, tmp_path):
    data = files["onnx"].read_bytes()
    bad = tmp_path / "truncated.onnx"
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated.onnx"):
        make_runtime(bad)


def test_onnx_that_is_not_a_pose_model(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 64, 48])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 64, 48])
    m = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y]),
                          opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    path = tmp_path / "relu.onnx"
    onnx.save(m, str(path))
    with pytest.raises(ValueError, match="not a fedpose pose model"):
        make_runtime(path)


@pytest.mark.skipif(HAS_TRT, reason="TensorRT is installed: the install hint path does not apply")
def test_engine_without_tensorrt_gives_install_hint(tmp_path):
    plan = tmp_path / "model.plan"
    plan.write_bytes(b"not an engine")
    with pytest.raises(ImportError, match=r"fedpose\[tensorrt\].*python3-libnvinfer"):
        make_runtime(plan)


@pytest.mark.skipif(not HAS_TRT, reason=TRT_SKIP)
def test_corrupt_engine_is_named(tmp_path):  # pragma: no cover - GPU only
    if not torch.cuda.is_available():
        pytest.skip(TRT_SKIP)
    plan = tmp_path / "broken.plan"
    plan.write_bytes(b"not an engine" * 100)
    with pytest.raises(ValueError, match="broken.plan"):
        make_runtime(plan)


# ---------------------------------------------------------------------------
# pre / post processing
# ---------------------------------------------------------------------------


def test_crop_contains_the_box():
    for box in ([10, 20, 100, 50], [5, 5, 30, 120], [0, 0, 48, 64]):
        center, scale = box_to_center_scale(box, INPUT)
        m = affine_matrix(center, scale, INPUT)
        x, y, w, h = box
        corners = warp_points(np.array([[x, y], [x + w, y], [x, y + h], [x + w, y + h]], float), m)
        assert corners.min() >= -1e-6
        assert corners[:, 0].max() <= INPUT[1] + 1e-6 and corners[:, 1].max() <= INPUT[0] + 1e-6
        # ... and tightly: the box touches the crop border along one axis.
        span = corners.max(axis=0) - corners.min(axis=0)
        assert np.isclose(span[0], INPUT[1]) or np.isclose(span[1], INPUT[0])
    with pytest.raises(ValueError, match="w, h > 0"):
        box_to_center_scale([0, 0, 0, 10], INPUT)


def test_preprocess_layout_range_and_channel_order():
    frame = np.zeros((120, 160, 3), np.uint8)
    frame[..., 0] = 255  # pure blue in BGR
    batch, mats = preprocess(frame, np.array([[40, 20, 60, 80], [0, 0, 160, 120]]), INPUT)
    assert batch.shape == (2, 3, *INPUT) and batch.dtype == np.float32 and mats.shape == (2, 2, 3)
    assert 0.0 <= batch.min() and batch.max() <= 1.0
    centre = batch[:, :, INPUT[0] // 2, INPUT[1] // 2]
    assert np.allclose(centre, [[0, 0, 1], [0, 0, 1]])  # RGB order: blue is the last channel
    gray, _ = preprocess(np.full((50, 50), 128, np.uint8), [[0, 0, 50, 50]], INPUT)
    assert np.allclose(gray[0, :, INPUT[0] // 2, INPUT[1] // 2], 128 / 255)
    with pytest.raises(ValueError, match="uint8"):
        preprocess(frame.astype(np.float32), [[0, 0, 10, 10]], INPUT)


def test_postprocess_maps_back_to_frame_pixels():
    """Logits peaked at known input pixels come back at the frame points they were cropped from."""
    rng = np.random.default_rng(3)
    frame_pts = rng.uniform([50, 40], [110, 110], size=(16, 2))  # inside the box below
    boxes = np.array([[40.0, 30.0, 80.0, 90.0]])
    _, mats = preprocess(np.zeros((150, 200, 3), np.uint8), boxes, INPUT)
    input_pts = warp_points(frame_pts, mats[0])  # (16, 2) in input px
    s = 2.0
    bx, by = np.arange(INPUT[1] * s), np.arange(INPUT[0] * s)
    lx = -((bx[None] - input_pts[:, :1] * s) ** 2) / 8.0  # Gaussian logits, sigma 2 bins
    ly = -((by[None] - input_pts[:, 1:] * s) ** 2) / 8.0
    kps, scores = postprocess(lx[None].astype(np.float32), ly[None].astype(np.float32), mats, INPUT)
    assert kps.shape == (1, 16, 2) and scores.shape == (1, 16)
    assert np.abs(kps[0] - frame_pts).max() < 0.05
    assert np.all(scores > 0.15)
    with pytest.raises(ValueError, match="bins do not match"):
        postprocess(lx[None, :, :50].astype(np.float32), ly[None].astype(np.float32), mats, INPUT)


def test_box_from_keypoints_and_clip():
    kp = np.array([[10, 10], [30, 50], [20, 90], [25, 60]] + [[0, 0]] * 12, float)
    sc = np.array([0.5] * 4 + [0.0] * 12)
    box = box_from_keypoints(kp, sc, threshold=0.1, min_points=4)
    x, y, w, h = box
    assert np.isclose(w, 80 * 1.25) and np.isclose(h, w)  # square, 1.25 x the longer extent
    assert np.isclose(x + w / 2, 20) and np.isclose(y + h / 2, 50)
    assert box_from_keypoints(kp, sc, threshold=0.6) is None  # nothing confident: lost
    assert box_from_keypoints(kp, sc, threshold=0.1, min_points=5) is None
    clipped = clip_box(np.array([-500.0, 10.0, 40.0, 40.0]), (100, 200))
    assert clipped[0] + clipped[2] / 2 == 0.0  # centre pulled back to the frame edge


def test_tracker_follows_keypoints_and_falls_back_to_roi():
    roi = (20.0, 30.0, 100.0, 60.0)
    tracker = BoxTracker(roi, threshold=0.1, min_points=4, smoothing=0.5)
    box, src = tracker.box((240, 320))
    assert src == "roi" and tuple(box) == roi
    kp = np.array([[200, 100], [220, 180], [210, 140], [205, 120]] + [[0, 0]] * 12, float)
    sc = np.array([0.9] * 4 + [0.0] * 12)
    tracker.update(kp, sc, (240, 320))
    box, src = tracker.box((240, 320))
    assert src == "track" and np.allclose(box[:2] + box[2:] / 2, [210, 140])
    tracker.update(kp + [40, 0], sc, (240, 320))  # the person moves right: the box follows, smoothed
    box, _ = tracker.box((240, 320))
    assert np.isclose(box[0] + box[2] / 2, 230.0)  # halfway between 210 and 250
    tracker.update(kp, np.zeros(16), (240, 320))  # lost
    box, src = tracker.box((240, 320))
    assert src == "roi" and tracker.lost_count == 1
    tiny = np.array([[100, 100], [102, 101], [101, 104], [103, 103]] + [[0, 0]] * 12, float)
    tracker.update(kp, sc, (240, 320))
    tracker.update(tiny, sc, (240, 320))  # keypoints collapsed onto one spot: dropped, not kept (issue 42)
    box, src = tracker.box((240, 320))
    assert src == "roi" and tracker.lost_count == 2
    no_roi = BoxTracker(None, threshold=0.1)
    assert no_roi.box((240, 320))[1] == "full" and tuple(no_roi.box((240, 320))[0]) == (0, 0, 320, 240)
