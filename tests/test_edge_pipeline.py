"""Camera pipeline: geometry and tracking against ground truth, robustness, CLI.

Geometry (crop -> infer -> decode -> map back) and tracking are checked
exactly with an *analytic* ONNX pose model: a real ONNX file, run by the
real onnxruntime through the real pipeline, whose "joints" 0-7 are the
centre of the red light in the crop and joints 8-15 the centre of the blue
light (SimCC logits built from the colour channels' row/column profiles).
On a clip of two moving coloured lights its keypoints must land on the
lights within a pixel and the tracked box must follow them; a wrong channel
order, aspect ratio, affine map or SimCC decode would fail by tens of pixels.

The accuracy tests use a *trained* model: a short public pretraining run of
the project's own ``run_pretrain`` in a session fixture (about 40 s on 2
idle cores), or the checkpoint in FEDPOSE_EDGE_CHECKPOINT when set; the demo
clip is rendered in the public style that model was trained on. Robustness tests (reconnects, unreadable frames, bad
sources) use a random-weight export.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import cv2
import numpy as np
import pytest
import torch

from fedpose.cli.main import main as cli_main
from fedpose.edge.pipeline.demo_video import DemoSpec, load_truth, render_demo, sidecar_path, write_demo_video
from fedpose.edge.export.exporter import export_onnx
from fedpose.edge.export.spec import ExportOptions
from fedpose.edge.pipeline.outputs import KEYPOINTS_FILE
from fedpose.edge.pipeline.source import FrameSource, ReconnectPolicy, SourceError
from fedpose.edge.pipeline.options import PipelineOptions, parse_pixelize
from fedpose.edge.pipeline.loop import run_pipeline
from fedpose.edge.runtime import make_runtime
from fedpose.shared.configuration.schema import ModelConfig
from fedpose.shared.model.posenet import build_model

INPUT = (64, 48)
CLIP = DemoSpec(frames=48, size=(192, 144), seed=0, key_every=16, style="public")


# ---------------------------------------------------------------------------
# fixtures
# ---------------------------------------------------------------------------


# ---------------------------------------------------------------------------
# an analytic pose model and a clip of two moving lights
# ---------------------------------------------------------------------------

BETA = 40.0  # logit sharpness of the analytic model


def _interp_matrix(pixels: int, split_ratio: float = 2.0) -> np.ndarray:
    """(pixels, bins) matrix: bin j takes the profile linearly interpolated at x = j / split_ratio."""
    bins = int(round(pixels * split_ratio))
    m = np.zeros((pixels, bins), np.float32)
    for j in range(bins):
        x = j / split_ratio
        c0 = min(int(np.floor(x)), pixels - 1)
        t = x - c0
        m[c0, j] += 1.0 - t
        if t > 0 and c0 + 1 < pixels:
            m[c0 + 1, j] += t
    return m


def build_light_model(path: Path, input_size=INPUT) -> Path:
    """ONNX model with the pose model's interface: joints 0-7 = red light, 8-15 = blue light (RGB input)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    h, w = input_size
    inits = [
        numpy_helper.from_array(_interp_matrix(w), "mx"),
        numpy_helper.from_array(_interp_matrix(h), "my"),
        numpy_helper.from_array(np.array([1, 1, 1], np.int64), "split"),
        numpy_helper.from_array(np.array([1, 8, 1], np.int64), "expand8"),
        numpy_helper.from_array(np.array([BETA], np.float32), "beta"),
        numpy_helper.from_array(np.array([1e-6], np.float32), "eps"),
        numpy_helper.from_array(np.array([0.0], np.float32), "zero"),
        numpy_helper.from_array(np.array([1, 2], np.int64), "ax_rows"),  # sum over (C, H): column profile
        numpy_helper.from_array(np.array([1, 3], np.int64), "ax_cols"),  # sum over (C, W): row profile
        numpy_helper.from_array(np.array([1], np.int64), "ax1"),
        numpy_helper.from_array(np.array([2], np.int64), "ax2"),
    ]
    nodes = [helper.make_node("Split", ["image", "split"], ["r", "g", "b"], axis=1)]
    outs = {"x": [], "y": []}
    for ch in ("r", "b"):
        for axis, prof_axes, mat in (("x", "ax_rows", "mx"), ("y", "ax_cols", "my")):
            p = f"{ch}{axis}"
            nodes += [
                helper.make_node("ReduceSum", [ch, prof_axes], [f"{p}_prof"], keepdims=0),  # (N, W) or (N, H)
                helper.make_node("ReduceMax", [f"{p}_prof"], [f"{p}_max"], axes=[1], keepdims=1),
                helper.make_node("Add", [f"{p}_max", "eps"], [f"{p}_den"]),
                helper.make_node("Div", [f"{p}_prof", f"{p}_den"], [f"{p}_norm"]),
                helper.make_node("MatMul", [f"{p}_norm", mat], [f"{p}_bins"]),  # (N, bins)
                helper.make_node("Mul", [f"{p}_bins", "beta"], [f"{p}_logit"]),
                helper.make_node("Unsqueeze", [f"{p}_logit", "ax1"], [f"{p}_1"]),
                helper.make_node("Expand", [f"{p}_1", "expand8"], [f"{p}_8"]),  # (N, 8, bins)
            ]
            outs[axis].append(f"{p}_8")
    nodes += [
        helper.make_node("Concat", outs["x"], ["simcc_x"], axis=1),
        helper.make_node("Concat", outs["y"], ["simcc_y"], axis=1),
        helper.make_node("ReduceSum", ["simcc_x", "ax2"], ["xsum"], keepdims=0),
        helper.make_node("Mul", ["xsum", "zero"], ["visibility"]),
    ]
    graph = helper.make_graph(
        nodes,
        "lights",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["batch", 3, h, w])],
        [
            helper.make_tensor_value_info("simcc_x", TensorProto.FLOAT, ["batch", 16, 2 * w]),
            helper.make_tensor_value_info("simcc_y", TensorProto.FLOAT, ["batch", 16, 2 * h]),
            helper.make_tensor_value_info("visibility", TensorProto.FLOAT, ["batch", 16]),
        ],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


LIGHTS = SimpleNamespace(frames=40, size=(160, 120), radius=4, gap=20.0)


def light_positions(i: int) -> tuple[np.ndarray, np.ndarray]:
    """(red (2,), blue (2,)) centres at frame i: the pair drifts right and bobs up and down."""
    cx = 50.0 + 1.5 * i
    cy = 60.0 + 12.0 * np.sin(i / 6.0)
    return np.array([cx, cy + LIGHTS.gap]), np.array([cx, cy - LIGHTS.gap])


def write_light_clip(path: Path) -> Path:
    w, h = LIGHTS.size
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), 25.0, (w, h))
    shift = 4  # sub-pixel drawing: centres are not on the integer grid
    for i in range(LIGHTS.frames):
        frame = np.zeros((h, w, 3), np.uint8)
        red, blue = light_positions(i)
        for centre, bgr in ((red, (0, 0, 255)), (blue, (255, 0, 0))):
            c = tuple(int(round(v * (1 << shift))) for v in centre)
            cv2.circle(frame, c, LIGHTS.radius << shift, bgr, -1, cv2.LINE_AA, shift)
        writer.write(frame)
    writer.release()
    return path


@pytest.fixture(scope="session")
def lights(tmp_path_factory):
    root = tmp_path_factory.mktemp("lights")
    return SimpleNamespace(model=build_light_model(root / "lights.onnx"), clip=write_light_clip(root / "lights.mp4"))


# Small public pretraining run of the project's own code: ~480 AdamW steps of tinyvit-small at 64 x 48 on 512
# public-style 128 px ward images (about 40 s on 2 idle cores). The demo clip is rendered in the same style.
TRAIN_WARD = dict(sites=1, per_site=1, public=512, val=16, seed=0, image_size=128)
TRAIN_EPOCHS = 30
MAX_MEDIAN_ERROR = 0.15  # ground-truth test thresholds, set from measured runs (see the test)
MIN_PCK = 0.6


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """A trained model exported to ONNX: FEDPOSE_EDGE_CHECKPOINT if set, else pretrained here with run_pretrain."""
    import os

    from fedpose.shared.configuration.schema import config_from_dict
    from fedpose.shared.model.posenet import load_checkpoint
    from fedpose.shared.training.runs import run_pretrain

    root = tmp_path_factory.mktemp("trained")
    path = os.environ.get("FEDPOSE_EDGE_CHECKPOINT")
    if not path:
        cfg = config_from_dict({
            "data": {"source": "synthetic", "root": str(root / "ward"), "synth": TRAIN_WARD, "train_splits": ["site-0"],
                     "input_size": list(INPUT)},
            "model": {"variant": "tinyvit-small"},
            "pretrain": {"out": str(root / "pretrain"), "epochs": TRAIN_EPOCHS, "batch_size": 32, "seed": 0},
        })
        metrics = run_pretrain(cfg, progress=False)
        print(f"\ntrained {metrics['steps']} steps in {metrics['seconds']:.0f} s, val PCKh@0.5 "
              f"{metrics['pckh']['mean']:.1f}")
        path = root / "pretrain" / "model.pt"
    model, _ = load_checkpoint(path)
    out = root / "model.onnx"
    export_onnx(model, out, ExportOptions(batch=1))
    return SimpleNamespace(checkpoint=Path(path), onnx=out, model=model)


@pytest.fixture(scope="session")
def clip(tmp_path_factory):
    path = tmp_path_factory.mktemp("clip") / "ward.mp4"
    write_demo_video(path, CLIP)
    return path


@pytest.fixture(scope="module")
def random_onnx(tmp_path_factory):
    torch.manual_seed(0)
    model = build_model(ModelConfig(variant="tinyvit-small"), INPUT).eval()
    path = tmp_path_factory.mktemp("random") / "random.onnx"
    export_onnx(model, path, ExportOptions(batch=1))
    return path


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _frame_count(path: Path) -> int:
    cap = cv2.VideoCapture(str(path))
    n = 0
    while cap.read()[0]:
        n += 1
    cap.release()
    return n


# ---------------------------------------------------------------------------
# demo clip
# ---------------------------------------------------------------------------


def test_demo_clip_reads_back_with_ground_truth(clip):
    assert _frame_count(clip) == CLIP.frames
    cap = cv2.VideoCapture(str(clip))
    ok, frame = cap.read()
    cap.release()
    assert ok and frame.shape == (CLIP.size[1], CLIP.size[0], 3)
    truth = load_truth(clip)
    joints = truth["joints"]
    assert joints.shape == (CLIP.frames, 16, 2) and truth["visible"].all()
    x, y, w, h = truth["roi"]
    assert (joints[..., 0] >= x).all() and (joints[..., 0] <= x + w).all()
    assert (joints[..., 1] >= y).all() and (joints[..., 1] <= y + h).all()
    # The person moves: the joint centroid travels across the clip.
    centroids = joints.mean(axis=1)
    assert np.linalg.norm(centroids.max(axis=0) - centroids.min(axis=0)) > 10
    # Deterministic: the same spec renders the same truth and frames.
    frames_a, truth_a = render_demo(dataclasses.replace(CLIP, frames=3))
    frames_b, truth_b = render_demo(dataclasses.replace(CLIP, frames=3))
    assert truth_a == truth_b and all(np.array_equal(a, b) for a, b in zip(frames_a, frames_b))
    assert np.allclose(np.asarray(truth_a["joints"]), joints[:3], atol=1e-3)


# ---------------------------------------------------------------------------
# accuracy against the ground truth (trained model)
# ---------------------------------------------------------------------------


def test_pipeline_geometry_and_tracking_follow_the_lights(lights, tmp_path):
    """Keypoints land on the lights within a pixel in every frame, and the tracked box follows them."""
    red0, blue0 = light_positions(0)
    roi = (20.0, 20.0, 70.0, 90.0)  # installer's region around the start position
    with make_runtime(lights.model) as rt:
        assert rt.input_size == INPUT
        report = run_pipeline(rt, FrameSource(str(lights.clip)), PipelineOptions(out_dir=tmp_path, roi=roi))
    rows = _read_jsonl(tmp_path / KEYPOINTS_FILE)
    assert report.frames == len(rows) == LIGHTS.frames
    assert [r["box_source"] for r in rows] == ["roi"] + ["track"] * (LIGHTS.frames - 1)
    errors = []  # (F, 2 lights, 2 axes)
    for i, row in enumerate(rows):
        kp = np.array(row["keypoints"])  # (16, 3)
        red, blue = light_positions(i)
        errors.append([kp[:8, :2].mean(0) - red, kp[8:, :2].mean(0) - blue])
        assert np.ptp(kp[:8, :2], axis=0).max() == 0 and np.ptp(kp[8:, :2], axis=0).max() == 0
        assert kp[:, 2].min() > 0.1  # confident (the tracking threshold is 0.05)
        x, y, w, h = row["box"]
        for p in (red, blue):  # the crop box holds both lights
            assert x < p[0] < x + w and y < p[1] < y + h
    errors = np.array(errors)
    worst, bias = float(np.abs(errors).max()), np.abs(errors.mean(axis=0))
    print(f"\nanalytic model on the lights clip: worst keypoint error {worst:.2f} px, largest bias "
          f"{bias.max():.2f} px, {report.fps:.0f} FPS")
    # Per-frame noise comes from the model's coarse profiles and the mp4 codec; a geometry bug (half-pixel
    # shift, wrong scale or aspect, swapped channels) would show as a bias of one light along one axis.
    assert worst < 1.5
    assert bias.max() < 0.3
    # The box moved with the lights: from about x=50 at the start to about x=108 at the end.
    first, last = rows[1]["box"], rows[-1]["box"]
    assert (last[0] + last[2] / 2) - (first[0] + first[2] / 2) > 40


def _errors_vs_truth(rows: list[dict], truth: dict, size: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(F, 16) keypoint errors of the run and of a pixel-blind baseline, as fractions of the person's size.

    The baseline is the clip's average pose in crop coordinates put into the run's own boxes: what a model
    that ignores the pixels could at best output, given the same crops.
    """
    from fedpose.edge.runtime.prepost import box_to_center_scale
    from fedpose.shared.data.transforms import affine_matrix, invert_affine, warp_points

    pred = np.array([r["keypoints"] for r in rows])[..., :2]  # (F, 16, 2)
    gt = truth["joints"]
    height = np.ptp(gt, axis=1).max(axis=1)  # person extent per frame (px)
    err = np.linalg.norm(pred - gt, axis=-1) / height[:, None]
    mats = [affine_matrix(*box_to_center_scale(r["box"], size), size) for r in rows]
    mean_crop = np.mean([warp_points(g, m) for g, m in zip(gt, mats)], axis=0)
    base = np.array([warp_points(mean_crop, invert_affine(m)) for m in mats])
    return err, np.linalg.norm(base - gt, axis=-1) / height[:, None]


def test_pipeline_keypoints_match_ground_truth(trained, clip, tmp_path):
    """Trained model through the whole pipeline (mp4 decode, crop, ONNX, decode, map back) vs the clip's truth.

    The crops are the clip's ground-truth person boxes (a perfect detector), so this measures the model and
    the geometry, not the detector-free tracker: a self-tracking box from a weak model's keypoints drifts
    (see the tracked run below, reported but only checked for completing).
    """
    truth = load_truth(clip)
    size = tuple(trained.model.input_size)
    boxes = truth["boxes"]
    with make_runtime(trained.onnx) as rt:
        report = run_pipeline(rt, FrameSource(str(clip)),
                              PipelineOptions(out_dir=tmp_path / "boxes", boxes=lambda i: boxes[i]))
        tracked = run_pipeline(rt, FrameSource(str(clip)),
                               PipelineOptions(out_dir=tmp_path / "track", roi=tuple(truth["roi"])))
    rows = _read_jsonl(tmp_path / "boxes" / KEYPOINTS_FILE)
    assert report.frames == len(rows) == CLIP.frames
    assert {r["box_source"] for r in rows} == {"external"}
    err, base_err = _errors_vs_truth(rows, truth, size)
    median, base_median = float(np.median(err)), float(np.median(base_err))
    pck, base_pck = float((err < 0.2).mean()), float((base_err < 0.2).mean())
    track_rows = _read_jsonl(tmp_path / "track" / KEYPOINTS_FILE)
    assert tracked.frames == len(track_rows) == CLIP.frames
    track_err, _ = _errors_vs_truth(track_rows, truth, size)
    print(f"\npipeline vs ground truth (ground-truth boxes): median error {median:.3f} of the person's size, "
          f"{100 * pck:.0f}% of joints within 0.2 (pixel-blind baseline {base_median:.3f}, {100 * base_pck:.0f}%); "
          f"tracked from the ROI: median {float(np.median(track_err)):.3f}, "
          f"{100 * float((track_err < 0.2).mean()):.0f}% within 0.2; {report.fps:.0f} FPS")
    # Measured: 480-step fixture model 0.096 / 78%, a 43-PCKh fine-tuned checkpoint 0.095 / 80%, random weights
    # 0.587 / 5%. The clip's own mean pose in the true boxes (an oracle, printed) scores 0.084 / 87%: on this
    # mostly upright clip a tight box already says most of the pose, so it is reported, not asserted against.
    assert median < MAX_MEDIAN_ERROR
    assert pck > MIN_PCK


def test_int8_accuracy_drop_on_trained_model(trained, tmp_path):
    """INT8 vs FP32 PCKh of a trained model on a small synthetic val split (needs FEDPOSE_EDGE_CHECKPOINT)."""
    from fedpose.edge.export.quantize import compare_precisions, quantize_int8, record_crops
    from fedpose.shared.data.mpii import load_split
    from fedpose.shared.data.synth.ward import WardSpec, generate_ward

    root = generate_ward(tmp_path / "ward", WardSpec(sites=1, per_site=1, public=64, val=64, seed=5), progress=False)
    size = tuple(trained.model.input_size)
    int8 = quantize_int8(trained.onnx, tmp_path / "model.int8.onnx", record_crops(load_split(root, "public"), size))
    report = compare_precisions(trained.onnx, int8, load_split(root, "val"))
    print(f"\nPCKh@0.5 on {report.records} val people: fp32 {report.fp32['pckh']['mean']:.1f}, "
          f"int8 {report.int8['pckh']['mean']:.1f} (drop {report.drop:+.1f})")
    assert report.drop < 5


# ---------------------------------------------------------------------------
# robustness
# ---------------------------------------------------------------------------


def _cut_clip(src: Path, dst: Path, start: int, count: int) -> Path:
    cap = cv2.VideoCapture(str(src))
    frames = []
    while True:
        ok, f = cap.read()
        if not ok:
            break
        frames.append(f)
    cap.release()
    h, w = frames[0].shape[:2]
    writer = cv2.VideoWriter(str(dst), cv2.VideoWriter_fourcc(*"mp4v"), 25.0, (w, h))
    for f in frames[start : start + count]:
        writer.write(f)
    writer.release()
    return dst


def test_reconnects_after_a_drop_and_stops_when_the_source_stays_away(random_onnx, clip, tmp_path):
    """A live source whose stream appears late, drops after 10 frames, comes back for 6 more, then dies."""
    part_a = _cut_clip(clip, tmp_path / "a.mp4", 0, 10)
    part_b = _cut_clip(clip, tmp_path / "b.mp4", 10, 6)
    stream = tmp_path / "stream.mp4"  # what the "camera" serves; absent = camera unreachable
    plan = iter([None, part_a, None, None, part_b])  # file present at each open attempt
    opened: list[str] = []

    def opener():
        current = next(plan, None)
        if stream.exists():
            stream.unlink()
        if current is not None:
            shutil.copy(current, stream)
        opened.append(current.name if current else "-")
        return cv2.VideoCapture(str(stream))  # a real capture; fails to open when the file is absent

    waits: list[float] = []
    source = FrameSource("rtsp://camera", live=True, opener=opener, sleep=waits.append,
                         policy=ReconnectPolicy(tries=3, base_delay=0.01, max_delay=0.02))
    with make_runtime(random_onnx) as rt:
        report = run_pipeline(rt, source, PipelineOptions(out_dir=tmp_path / "out"))
    rows = _read_jsonl(tmp_path / "out" / KEYPOINTS_FILE)
    assert report.frames == len(rows) == 16
    assert [r["frame"] for r in rows] == list(range(16))
    assert report.reconnects == 1 and report.source_lost  # the late start is not a reconnect; the drop is
    assert opened == ["-", "a.mp4", "-", "-", "b.mp4", "-", "-", "-"]
    # Exponential backoff (0.01, 0.02, capped at 0.02), restarting after every success.
    assert waits == [0.01, 0.01, 0.02, 0.02, 0.01, 0.02, 0.02]


def test_source_that_never_opens(tmp_path):
    waits: list[float] = []
    source = FrameSource("rtsp://nowhere", live=True, opener=lambda: cv2.VideoCapture(str(tmp_path / "none.mp4")),
                         sleep=waits.append, policy=ReconnectPolicy(tries=3, base_delay=0.5, max_delay=1.0))
    with pytest.raises(SourceError, match="cannot open video source 'rtsp://nowhere' after 3 retries"):
        source.open()
    assert waits == [0.5, 1.0, 1.0]
    with pytest.raises(FileNotFoundError, match="missing.mp4"):
        FrameSource(str(tmp_path / "missing.mp4")).open()


def test_cli_unopenable_source_exits_nonzero(random_onnx, tmp_path, capsys):
    code = cli_main(["edge", "run", "--model", str(random_onnx), "--source", str(tmp_path / "nope.mp4"),
                     "--out", str(tmp_path / "out")])
    assert code == 3
    assert "nope.mp4" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing written for a source that never opened
    not_video = tmp_path / "text.mp4"
    not_video.write_text("this is not a video")
    code = cli_main(["edge", "run", "--model", str(random_onnx), "--source", str(not_video),
                     "--out", str(tmp_path / "out")])
    assert code == 3
    assert "cannot open video source" in capsys.readouterr().err


class _Glitchy:
    """A real capture whose driver returns an empty frame every 4th read (as a flaky USB camera does)."""

    def __init__(self, path: Path) -> None:
        self.cap = cv2.VideoCapture(str(path))
        self.reads = 0

    def read(self):
        self.reads += 1
        ok, frame = self.cap.read()
        if ok and self.reads % 4 == 0:
            return True, None
        return ok, frame

    def __getattr__(self, name):
        return getattr(self.cap, name)


def test_unreadable_frames_are_skipped_and_max_frames_stops(random_onnx, clip, tmp_path):
    source = FrameSource(str(clip), opener=lambda: _Glitchy(clip))
    with make_runtime(random_onnx) as rt:
        report = run_pipeline(rt, source, PipelineOptions(out_dir=tmp_path / "a"))
    assert report.bad_frames == CLIP.frames // 4 and report.frames == CLIP.frames - CLIP.frames // 4
    assert not report.source_lost and report.reconnects == 0
    with make_runtime(random_onnx) as rt:
        report = run_pipeline(rt, FrameSource(str(clip)), PipelineOptions(out_dir=tmp_path / "b", max_frames=5))
    assert report.frames == 5 and len(_read_jsonl(tmp_path / "b" / KEYPOINTS_FILE)) == 5
    assert report.latencies_ms and report.latency(95) >= report.latency(50) > 0


# ---------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------


def test_cli_export_then_run(tmp_path, clip, capsys):
    from fedpose.shared.model.posenet import save_checkpoint

    torch.manual_seed(2)
    save_checkpoint(tmp_path / "model.pt", build_model(ModelConfig(variant="tinyvit-small"), INPUT))
    onnx_path = tmp_path / "m.onnx"
    assert cli_main(["edge", "export", "--checkpoint", str(tmp_path / "model.pt"), "--out", str(onnx_path),
                     "--batch", "dynamic"]) == 0
    out = capsys.readouterr().out
    assert "max abs diff" in out and "TensorRT 10" in out and onnx_path.is_file()
    for model in (onnx_path, tmp_path / "model.pt"):  # the export and the checkpoint itself both run
        code = cli_main(["edge", "run", "--model", str(model), "--source", str(clip), "--out",
                         str(tmp_path / model.suffix[1:]), "--max-frames", "4"])
        assert code == 0
        assert len(_read_jsonl(tmp_path / model.suffix[1:] / KEYPOINTS_FILE)) == 4
    assert cli_main(["edge", "export", "--checkpoint", str(tmp_path / "model.pt"), "--out", str(tmp_path / "x.onnx"),
                     "--input", "128x96"]) == 3
    assert "tied to the training input size" in capsys.readouterr().err


def test_cli_run_with_video_and_pixelized_frames(lights, tmp_path, capsys):
    run_dir = tmp_path / "run"
    code = cli_main(["edge", "run", "--model", str(lights.model), "--source", str(lights.clip), "--out",
                     str(run_dir), "--roi", "20,20,70,90", "--video", "--pixelize", "eps=1,b=8,m=8,n=2", "--seed", "0",
                     "--max-frames", "12"])
    out = capsys.readouterr().out
    assert code == 0
    assert "FPS" in out and "p50" in out and "p95" in out
    from fedpose.shared.pixelization.claim import pixelize_claim

    spec, _ = parse_pixelize("eps=1,b=8,m=8,n=2")
    assert pixelize_claim(spec, mask_source="keypoints", frames=12) in out
    assert "body mask empty" not in out
    rows = _read_jsonl(run_dir / KEYPOINTS_FILE)
    assert len(rows) == 12
    assert set(rows[0]) >= {"frame", "timestamp", "pos_ms", "keypoints", "latency_ms", "box", "box_source"}
    assert np.array(rows[0]["keypoints"]).shape == (16, 3)
    assert _frame_count(run_dir / "annotated.mp4") == 12
    npz = sorted((run_dir / "pixelized").glob("*.npz"))
    assert len(npz) == 12
    from fedpose.shared.pixelization.storage import load_npz

    released = load_npz(npz[5])
    assert released.b == 8 and released.s_b == 4 and released.channels == 1
    # The subdivided cells are where the keypoints are (the body mask comes from this frame's keypoints).
    red, blue = light_positions(5)
    for p in (red, blue):
        assert released.cell_mask[int(p[1]) // 8, int(p[0]) // 8]
    assert released.cell_mask.mean() < 0.5
    # The video shows the published (noisy, pixelized) frames, not the raw black frames with two lights.
    raw, published = (cv2.VideoCapture(str(p)) for p in (lights.clip, run_dir / "annotated.mp4"))
    (ok_r, raw0), (ok_p, pub0) = raw.read(), published.read()
    raw.release()
    published.release()
    assert ok_r and ok_p and np.abs(raw0.astype(float) - pub0.astype(float)).mean() > 5
    restored = tmp_path / "restored.png"
    assert cli_main(["edge", "restore", "--in", str(npz[0]), "--out", str(restored)]) == 0
    assert np.array_equal(cv2.imread(str(restored), cv2.IMREAD_UNCHANGED), load_npz(npz[0]).render())
    # No keypoint clears a threshold above every score: the summary says the masks were empty.
    code = cli_main(["edge", "run", "--model", str(lights.model), "--source", str(lights.clip), "--out",
                     str(tmp_path / "none"), "--roi", "20,20,70,90", "--pixelize", "eps=1,b=8,m=8,n=2", "--seed", "0",
                     "--max-frames", "4", "--threshold", "1.0"])
    assert code == 0
    assert "body mask empty on 4 of 4 frames" in capsys.readouterr().out
    assert not load_npz(tmp_path / "none" / "pixelized" / "frame_000000.npz").cell_mask.any()


def test_cli_pixelize_image_with_pose_mask(lights, tmp_path, capsys):
    cap = cv2.VideoCapture(str(lights.clip))
    _, frame = cap.read()
    cap.release()
    image = tmp_path / "frame.png"
    cv2.imwrite(str(image), frame)
    out = tmp_path / "frame.npz"
    code = cli_main(["edge", "pixelize", "--in", str(image), "--eps", "2", "--b", "16", "--m", "4", "--n", "4",
                     "--mask", "pose", "--model", str(lights.model), "--store", "npz", "--out", str(out),
                     "--seed", "1"])
    text = capsys.readouterr().out
    assert code == 0 and out.is_file() and "keypoints" in text
    from fedpose.shared.pixelization.storage import load_npz

    released = load_npz(out)
    assert released.channels == 3 and released.s_b == 4
    red, blue = light_positions(0)
    for p in (red, blue):
        assert released.cell_mask[int(p[1]) // 16, int(p[0]) // 16]
    png = tmp_path / "gray.png"
    assert cli_main(["edge", "pixelize", "--in", str(image), "--eps", "2", "--b", "16", "--m", "4", "--gray",
                     "--out", str(png)]) == 0
    assert cv2.imread(str(png), cv2.IMREAD_UNCHANGED).shape == (LIGHTS.size[1], LIGHTS.size[0])
    capsys.readouterr()
    assert cli_main(["edge", "pixelize", "--in", str(image), "--eps", "1", "--b", "16", "--m", "4", "--n", "3",
                     "--out", str(tmp_path / "x.png")]) == 3
    assert "does not divide" in capsys.readouterr().err


def test_cli_rejects_bad_arguments(random_onnx, clip, tmp_path, capsys):
    base = ["edge", "run", "--model", str(random_onnx), "--source", str(clip), "--out", str(tmp_path)]
    assert cli_main(base + ["--roi", "1,2,3"]) == 3
    assert "--roi" in capsys.readouterr().err
    assert cli_main(base + ["--pixelize", "eps=0,b=8,m=8"]) == 3
    assert "eps must be > 0" in capsys.readouterr().err
    assert cli_main(["edge", "build", "--onnx", str(random_onnx), "--out", str(tmp_path / "m.plan")]) == 3
    err = capsys.readouterr()
    assert "trtexec" in err.out  # the equivalent command is printed before TensorRT is needed
    if "TensorRT is not installed" in err.err:
        assert "fedpose[tensorrt]" in err.err
    assert parse_pixelize("eps=0.5,b=16,m=16,n=4,color=1")[1] is True
    assert sidecar_path("a/b.mp4") == Path("a/b.mp4.json")


# ---------------------------------------------------------------------------
# what a pixelized run releases (issue #8, finding 8.8)
# ---------------------------------------------------------------------------


def _decode(path: Path) -> list[np.ndarray]:
    cap = cv2.VideoCapture(str(path))
    frames = []
    while True:
        ok, frame = cap.read()
        if not ok:
            break
        frames.append(frame)
    cap.release()
    return frames


def _encode_like_the_pipeline(frames: list[np.ndarray], path: Path) -> list[np.ndarray]:
    """Write frames with the pipeline's codec settings and decode them again (mp4v is deterministic)."""
    h, w = frames[0].shape[:2]
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), 25.0, (w, h))
    for f in frames:
        writer.write(f if f.ndim == 3 else cv2.cvtColor(f, cv2.COLOR_GRAY2BGR))
    writer.release()
    return _decode(path)


def test_published_pixelized_frames_carry_no_raw_overlay_and_the_claim_names_every_output(lights, tmp_path, capsys):
    """Threat model 4b: the camera viewer learns only what the printed edge claim lists.

    By default the published video is exactly the DP pixelization of each frame (nothing drawn from the
    raw frame's keypoints over it); the claim names keypoints.jsonl, annotated.mp4 and the region mask as
    derived from the raw frames and NOT protected. An explicit --overlay draws the skeleton, and then the
    claim says so.
    """
    from fedpose.shared.pixelization.storage import load_npz

    frames = 8
    run_dir = tmp_path / "run"
    code = cli_main(["edge", "run", "--model", str(lights.model), "--source", str(lights.clip), "--out",
                     str(run_dir), "--roi", "20,20,70,90", "--video", "--pixelize", "eps=1,b=8,m=8,n=2", "--seed", "0",
                     "--max-frames", str(frames)])
    out = capsys.readouterr().out
    assert code == 0
    renders = [load_npz(p).render() for p in sorted((run_dir / "pixelized").glob("*.npz"))]
    assert len(renders) == frames
    published = _decode(run_dir / "annotated.mp4")
    expected = _encode_like_the_pipeline(renders, tmp_path / "expected.mp4")
    assert len(published) == len(expected) == frames
    for got, want in zip(published, expected):
        assert np.array_equal(got, want)  # the pixelization of the frame, with no overlay

    claim = out[out.index("DP pixelization"):]
    for name in ("keypoints.jsonl", "annotated.mp4", "region mask", "pixelized"):
        assert name in claim, name
    assert f"F={frames}" in claim and "eps" in claim
    kp_line = next(line for line in claim.splitlines() if "keypoints.jsonl" in line)
    assert "raw" in kp_line and "NOT protected" in kp_line
    video_line = next(line for line in claim.splitlines() if "annotated.mp4" in line)
    assert "no overlay" in video_line

    # --overlay: the skeleton drawn from the raw frame's keypoints is released, and the claim names it.
    code = cli_main(["edge", "run", "--model", str(lights.model), "--source", str(lights.clip), "--out",
                     str(tmp_path / "overlay"), "--roi", "20,20,70,90", "--video", "--overlay", "--pixelize",
                     "eps=1,b=8,m=8,n=2", "--seed", "0", "--max-frames", str(frames)])
    out = capsys.readouterr().out
    assert code == 0
    video_line = next(line for line in out[out.index("DP pixelization"):].splitlines() if "annotated.mp4" in line)
    assert "skeleton" in video_line and "NOT protected" in video_line
    drawn = _decode(tmp_path / "overlay" / "annotated.mp4")
    assert any(not np.array_equal(a, b) for a, b in zip(drawn, expected))

    # Without --video nothing names a video that was not written.
    code = cli_main(["edge", "run", "--model", str(lights.model), "--source", str(lights.clip), "--out",
                     str(tmp_path / "novideo"), "--roi", "20,20,70,90", "--pixelize", "eps=1,b=8,m=8,n=2",
                     "--seed", "0", "--max-frames", "2"])
    out = capsys.readouterr().out
    assert code == 0 and "annotated.mp4" not in out[out.index("DP pixelization"):]
    assert "keypoints.jsonl" in out[out.index("DP pixelization"):]


def test_cli_device_maps_to_onnxruntime_providers_and_prints_the_ones_used(random_onnx, clip, tmp_path, capsys):
    from fedpose.edge.runtime.onnx import providers_for

    assert providers_for("tensorrt")[0] == "TensorrtExecutionProvider"
    assert providers_for("cpu") == ["CPUExecutionProvider"]
    base = ["edge", "run", "--model", str(random_onnx), "--source", str(clip), "--max-frames", "2"]
    assert cli_main(base + ["--out", str(tmp_path / "cpu"), "--device", "cpu"]) == 0
    assert "(onnxruntime with CPUExecutionProvider," in capsys.readouterr().out
    # This machine's onnxruntime is the CPU build: asking for CUDA says what to install, and runs nothing.
    assert cli_main(base + ["--out", str(tmp_path / "cuda"), "--device", "cuda"]) == 3
    err = capsys.readouterr().err
    assert "CUDAExecutionProvider is not available" in err and "fedpose[edge-gpu]" in err
    assert not (tmp_path / "cuda").exists()


def test_max_eps_stops_releasing_and_the_claim_counts_the_frames_released(random_onnx, clip, tmp_path, capsys):
    """F x eps composes over a stream: with --max-eps the camera stops releasing frames at the budget (keypoints go
    on), nothing of an unreleased frame reaches the video, and the claim and summary count what was released."""
    out = tmp_path / "run"
    assert cli_main(["edge", "run", "--model", str(random_onnx), "--source", str(clip), "--out", str(out), "--video",
                     "--pixelize", "eps=1,b=16,m=16,n=4", "--max-eps", "3.5", "--max-frames", "8", "--store", "png",
                     "--seed", "0"]) == 0
    printed = capsys.readouterr().out
    assert len(_read_jsonl(out / KEYPOINTS_FILE)) == 8  # inference goes on
    frames = sorted((out / "pixelized").iterdir())
    assert [f.suffix for f in frames] == [".png"] * 3  # floor(3.5 / 1) frames, as images
    assert _frame_count(out / "annotated.mp4") == 3  # the video shows released frames only
    summary = json.loads((out / "summary.json").read_text())
    assert summary["released_frames"] == 3 and summary["budget_stop"] == 3 and summary["frames"] == 8
    assert "3 over F=3 frames" in printed and "frame_*.png" in printed
    assert cli_main(["edge", "run", "--model", str(random_onnx), "--source", str(clip), "--out", str(tmp_path / "x"),
                     "--pixelize", "eps=1,b=16,m=16", "--max-eps", "0.5"]) == 3  # not even one frame fits
    assert "--max-eps" in capsys.readouterr().err


def test_sigterm_ends_the_camera_run_with_its_outputs_finalised(random_onnx, tmp_path):
    """A camera service is stopped with SIGTERM: the run ends after the current frame, the video is finalised (it
    opens and holds the frames written), summary.json is written and the claim printed; exit code 0."""
    import os
    import signal
    import subprocess
    import sys
    import time

    source = tmp_path / "long.mp4"
    write_demo_video(source, DemoSpec(frames=600, size=(192, 144), seed=1, style="public"))
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "fedpose.cli.main", "edge", "run", "--model", str(random_onnx),
                             "--source", str(source), "--out", str(out), "--video", "--pixelize",
                             "eps=0.5,b=16,m=16,n=4", "--threads", "1"], cwd=Path(__file__).resolve().parents[1],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": "."})
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            path = out / KEYPOINTS_FILE
            if path.is_file() and len(path.read_text().splitlines()) >= 5:
                break
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGTERM" and 5 <= summary["frames"] < 600
    assert _frame_count(out / "annotated.mp4") == summary["released_frames"] == summary["frames"]
    assert "stopped by SIGTERM" in stdout and f"over F={summary['frames']} frames" in stdout


# ---------------------------------------------------------------------------
# what a camera user types (issue 42, item 8): ROI, a missing camera, sizes HxW, flag names, stills
# ---------------------------------------------------------------------------


def test_cli_roi_reaching_past_the_frame_is_refused_with_the_frame_size(random_onnx, clip, tmp_path, capsys):
    w, h = CLIP.size  # the clip is 144x192 (HxW)
    base = ["edge", "run", "--model", str(random_onnx), "--source", str(clip), "--max-frames", "2"]
    for roi in (f"{w - 40},{h - 50},60,60", f"{w + 10},10,20,20"):  # partly and wholly outside
        assert cli_main(base + ["--out", str(tmp_path / "out"), "--roi", roi]) == 3
        err = capsys.readouterr().err
        assert f"--roi {roi}" in err and f"{h}x{w} (HxW)" in err, err
        assert not (tmp_path / "out" / KEYPOINTS_FILE).exists()  # refused before anything is written
    inside = f"{w - 60},{h - 60},60,60"  # touching the frame's edges is fine
    assert cli_main(base + ["--out", str(tmp_path / "ok"), "--roi", inside]) == 0
    assert _read_jsonl(tmp_path / "ok" / KEYPOINTS_FILE)[0]["box_source"] == "roi"


def _absent_camera_index() -> int:
    return next(i for i in range(64) if not Path(f"/dev/video{i}").exists())


def test_cli_camera_index_without_a_camera_fails_fast(random_onnx, tmp_path, capsys):
    import time

    index = _absent_camera_index()
    t0 = time.monotonic()
    code = cli_main(["edge", "run", "--model", str(random_onnx), "--source", str(index), "--out", str(tmp_path / "o")])
    elapsed = time.monotonic() - t0
    err = capsys.readouterr().err
    assert code == 3 and f"--source {index}" in err and "no camera" in err, err
    assert elapsed < 3.0, f"took {elapsed:.1f} s"
    assert not (tmp_path / "o").exists()


def test_cli_stream_that_never_opens_gives_up_within_the_first_open_budget(random_onnx, tmp_path, capsys):
    import time

    t0 = time.monotonic()
    code = cli_main(["edge", "run", "--model", str(random_onnx), "--source", "rtsp://127.0.0.1:9/ward",
                     "--out", str(tmp_path / "o")])
    elapsed = time.monotonic() - t0
    err = capsys.readouterr().err
    assert code == 3 and "rtsp://127.0.0.1:9/ward" in err, err
    assert elapsed < 8.0, f"took {elapsed:.1f} s"  # the reconnect policy (24 s) is for drops, not the first open


def test_cli_sizes_are_written_height_first(tmp_path, capsys):
    from fedpose.shared.pixelization.spec import PixelizeSpec
    from fedpose.shared.pixelization.mechanism import pixelize
    from fedpose.shared.pixelization.storage import save_npz

    image = np.random.default_rng(0).integers(0, 256, (96, 128), dtype=np.uint8)  # 96x128 (HxW)
    save_npz(pixelize(image, PixelizeSpec(eps=1, b=16, m=4), rng=np.random.default_rng(0)), tmp_path / "f.npz")
    assert cli_main(["edge", "restore", "--in", str(tmp_path / "f.npz"), "--out", str(tmp_path / "f.png")]) == 0
    assert "96x128 (HxW)" in capsys.readouterr().out
    cv2.imwrite(str(tmp_path / "img.png"), image)
    cv2.imwrite(str(tmp_path / "mask.png"), np.zeros((64, 96), np.uint8))
    assert cli_main(["edge", "pixelize", "--in", str(tmp_path / "img.png"), "--eps", "1", "--b", "16", "--m", "4",
                     "--mask", str(tmp_path / "mask.png"), "--out", str(tmp_path / "p.png")]) == 3
    err = capsys.readouterr().err
    assert "64x96 (HxW)" in err and "96x128 (HxW)" in err, err
    assert cli_main(["edge", "demo-video", "--out", str(tmp_path / "d.mp4"), "--size", "2000x100"]) == 3
    err = capsys.readouterr().err
    assert "1080x1920" in err and "2000x100" in err and "HxW" in err, err


def test_cli_unknown_model_suffix_names_the_backend_flag(clip, tmp_path, capsys):
    model = tmp_path / "model.bin"
    model.write_bytes(b"weights")
    assert cli_main(["edge", "run", "--model", str(model), "--source", str(clip), "--out", str(tmp_path / "o")]) == 3
    err = capsys.readouterr().err
    assert "--backend" in err and "backend=" not in err, err


def test_cli_pixelize_folder_of_stills_makes_no_video_claim(clip, tmp_path, capsys):
    folder = tmp_path / "stills"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(3):
        cv2.imwrite(str(folder / f"bed{i}.png"), rng.integers(0, 256, (64, 64), dtype=np.uint8))
    assert cli_main(["edge", "pixelize", "--in", str(folder), "--eps", "0.5", "--b", "16", "--m", "4",
                     "--out", str(tmp_path / "out")]) == 0
    text = capsys.readouterr().out
    assert "all frames" not in text and "Video" not in text, text
    assert "each of the 3 images is 0.5-DP on its own" in text and "in k of the 3 images: k*eps" in text, text
    assert cli_main(["edge", "pixelize", "--in", str(folder / "bed0.png"), "--eps", "0.5", "--b", "16", "--m", "4",
                     "--out", str(tmp_path / "one.png")]) == 0
    text = capsys.readouterr().out
    assert "Video" not in text and "F=" not in text, text
    assert cli_main(["edge", "pixelize", "--in", str(clip), "--eps", "0.5", "--b", "16", "--m", "4",
                     "--out", str(tmp_path / "vid")]) == 0
    assert f"F*eps = {CLIP.frames * 0.5:g}" in capsys.readouterr().out  # a video keeps its composition line


# ---------------------------------------------------------------------------
# the shipped demo clip through `fedpose edge run` (issue 42, item 6)
# ---------------------------------------------------------------------------


def test_cli_run_finds_the_person_on_the_demo_clip_and_reports_its_accuracy(trained, tmp_path, capsys):
    """The demo clip as the README renders it (120 frames, 240x320), tracked from the full frame with no ROI:
    the box must find and keep the person (no collapse), and the run prints PCK@0.2 of the person's height
    against the clip's ground truth and writes it to summary.json. Target: at least 0.8 of what the same
    model scores on crops of the true person boxes (a perfect detector), on the same clip."""
    clip = tmp_path / "demo.mp4"
    assert cli_main(["edge", "demo-video", "--out", str(clip)]) == 0
    truth = load_truth(clip)
    with make_runtime(trained.onnx) as rt:
        run_pipeline(rt, FrameSource(str(clip)),
                     PipelineOptions(out_dir=tmp_path / "oracle", boxes=lambda i: truth["boxes"][i]))
    oracle = _read_jsonl(tmp_path / "oracle" / KEYPOINTS_FILE)
    gt, vis = truth["joints"], truth["visible"]
    ref = np.ptp(gt, axis=1).max(axis=1)
    err = np.linalg.norm(np.array([r["keypoints"] for r in oracle])[..., :2] - gt, axis=-1)
    oracle_pck = float((err / ref[:, None] <= 0.2)[vis].mean())
    capsys.readouterr()

    assert cli_main(["edge", "run", "--model", str(trained.onnx), "--source", str(clip), "--out",
                     str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    acc = summary["accuracy"]
    assert acc["truth"] == str(sidecar_path(clip)) and acc["frames"] == 120
    assert f"PCK@0.2 {acc['pck@0.2']:.3f}" in out, out
    rows = _read_jsonl(tmp_path / "run" / KEYPOINTS_FILE)
    sides = np.array([r["box"][2] for r in rows])
    print(f"\ndemo clip, tracked from the full frame: PCK@0.2 {acc['pck@0.2']:.3f}, median error "
          f"{acc['median_error_px']:.1f} px; with the true boxes {oracle_pck:.3f}; box side min {sides.min():.0f} px, "
          f"sources {sorted({r['box_source'] for r in rows})}")
    assert sides.min() >= 0.1 * 240  # never collapses onto a few pixels
    assert acc["pck@0.2"] >= 0.8 * oracle_pck, (acc, oracle_pck)


def test_a_tracked_box_that_covers_too_little_of_the_moving_person_is_reacquired(monkeypatch):
    """A model whose keypoints shrink onto part of the body pulls the next crop onto that part, and the crop
    after onto less: the track is dropped for the moving person's box as soon as it overlaps that box by
    less than 0.7 (IoU), not only once it has nearly left it."""
    from fedpose.edge.pipeline import tracking

    moving = np.array([90.0, 40.0, 140.0, 160.0])  # (x, y, w, h) of what moves
    monkeypatch.setattr(tracking.MotionFinder, "box", lambda self, frame: moving)
    frame = np.zeros((240, 320, 3), np.uint8)
    tracker = tracking.BoxTracker(None, threshold=0.3)
    tracker.see(frame)
    # confident keypoints on the lower half of the person: their box overlaps the moving one at IoU 0.57
    keypoints = np.stack([np.linspace(110, 200, 16), np.linspace(80, 170, 16)], axis=1)
    tracker.update(keypoints, np.ones(16), (240, 320))
    tracker.see(frame)
    box, source = tracker.box((240, 320))
    assert source == "motion" and tracker.reacquired == 1
    assert np.allclose(box, moving)
    # keypoints over the whole person keep the track
    keypoints = np.stack([np.linspace(110, 200, 16), np.linspace(60, 170, 16)], axis=1)
    tracker.update(keypoints, np.ones(16), (240, 320))
    tracker.see(frame)
    assert tracker.box((240, 320))[1] == "track"
