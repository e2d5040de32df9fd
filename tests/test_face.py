"""The face tasks (DPLH): labels on the ward, their annotation file, the crop's transforms, the head's losses
under per-sample clipping, training under every method, and the metrics."""

from __future__ import annotations

import json
import math

import cv2
import numpy as np
import pytest
import torch

from fedpose.shared.configuration.schema import ModelConfig
from fedpose.shared.data.synth.identity import FACES
from fedpose.shared.data.synth.ward import (WardSpec, ensure_faces, face_sample, generate_ward, manifest_for,
                                            render_sample)
from fedpose.shared.data.face import LANDMARK_NAMES, FaceLabels, read_faces, write_faces
from fedpose.shared.data.augment import Augment

SPEC = WardSpec(sites=1, per_site=60, public=40, val=20, seed=3, image_size=128, images_per_identity=4)
INPUT = (64, 48)
ALL_TASKS = ("detect", "landmarks", "head_pose", "attribute")


@pytest.fixture(scope="module")
def ward(tmp_path_factory):
    """One ward of SPEC for the tests that read files (generated once)."""
    return generate_ward(tmp_path_factory.mktemp("face-ward") / "w", SPEC, progress=False)


def _faces(split: str = "site-0", n: int = 60) -> list[tuple[int, FaceLabels]]:
    return [(i, f) for i in range(n) if (f := face_sample(SPEC, split, i)) is not None]


# ---------------------------------------------------------------------------------------------------------------
# labels and their file
# ---------------------------------------------------------------------------------------------------------------


def test_ward_face_labels_sit_on_the_drawn_face():
    dark = total = 0
    present = 0
    for i, face in _faces():
        if not face.present:
            assert not face.visible.any() and not face.box.any()
            continue
        present += 1
        image, _, _, _ = render_sample(SPEC, "site-0", i)
        gray = cv2.cvtColor(image, cv2.COLOR_BGR2GRAY).astype(float)
        (x1, y1), (x2, y2) = face.box
        box = gray[max(0, int(y1)):int(y2) + 1, max(0, int(x1)):int(x2) + 1]
        seen = face.landmarks[face.visible]
        assert np.all(seen >= face.box[0] - 0.5) and np.all(seen <= face.box[1] + 0.5), "landmarks outside the box"
        for k in (0, 1):  # the eyes are drawn as dark dots on the skin
            if face.visible[k]:
                x, y = face.landmarks[k]
                total += 1
                dark += gray[int(round(y)), int(round(x))] < np.median(box)
        if face.visible[0] and face.visible[1]:  # frontal: the eye line runs across the head, so it gives the roll
            d = face.landmarks[1] - face.landmarks[0]
            assert math.degrees(math.atan2(d[1], d[0])) == pytest.approx(float(face.head_pose[2]), abs=1e-3)
    assert present >= 30
    assert dark / total > 0.7, f"only {dark} of {total} eye labels fall on a dark pixel"


def test_ward_writes_the_face_file_on_first_use_and_it_round_trips(ward):
    root = ward
    assert not (root / "val" / "faces.json").exists()
    path = ensure_faces(root, SPEC, "val")
    assert path == root / "val" / "faces.json"
    faces, names = read_faces(path, SPEC.val)
    assert names == FACES
    for i, face in enumerate(faces):
        want = face_sample(SPEC, "val", i)
        assert (face is None) == (want is None)
        if face is not None:
            assert face.present == want.present and face.attribute == want.attribute
            np.testing.assert_allclose(face.landmarks, want.landmarks, atol=1e-3)
            np.testing.assert_allclose(face.head_pose, want.head_pose, atol=1e-3)
            assert np.array_equal(face.visible, want.visible)
    # the pose reader attaches them to the records
    from fedpose.shared.data.mpii import load_split

    records = load_split(root, "val")
    assert [r.face is not None for r in records] == [f is not None for f in faces]
    # and the ward's manifest does not change: wards generated before the face tasks stay valid
    assert json.loads((root / "manifest.json").read_text()) == manifest_for(SPEC)


def test_face_file_errors_name_the_problem(tmp_path):
    face = FaceLabels(True, [[1, 2], [9, 12]], np.ones((5, 2)), [1, 1, 0, 1, 1], (10.0, -5.0, 3.0), 1)
    path = tmp_path / "faces.json"
    write_faces(path, [face, None, FaceLabels.absent(0)], ("a", "b"))
    faces, names = read_faces(path, 3)
    assert names == ("a", "b") and faces[1] is None and not faces[2].present
    assert faces[0].landmarks[2].tolist() == [0.0, 0.0] and not faces[0].visible[2]
    with pytest.raises(ValueError, match="2 faces for 3 records"):
        write_faces(path, [face, None], ("a", "b")) or read_faces(path, 3)
    payload = json.loads(path.read_text())
    payload["faces"][0]["attribute"] = 5
    path.write_text(json.dumps(payload))
    with pytest.raises(ValueError, match=r"faces\[0\]: attribute"):
        read_faces(path, 2)
    payload["landmarks"] = list(reversed(LANDMARK_NAMES))
    path.write_text(json.dumps(payload))
    with pytest.raises(ValueError, match="landmarks must be"):
        read_faces(path, 2)
    with pytest.raises(ValueError, match="x2 > x1"):
        FaceLabels(True, [[5, 5], [1, 9]], np.zeros((5, 2)), [0] * 5, (0, 0, 0))
    with pytest.raises(ValueError, match="no visible landmarks"):
        FaceLabels(False, np.zeros((2, 2)), np.zeros((5, 2)), [1, 0, 0, 0, 0], (0, 0, 0))
    with pytest.raises(ValueError, match="head_pose"):
        FaceLabels(True, [[1, 2], [9, 12]], np.zeros((5, 2)), [0] * 5, (0, 200, 0))


def test_crop_flip_and_rotation_move_the_face_labels_with_the_image(ward):
    from fedpose.shared.data.dataset import PoseDataset
    from fedpose.shared.data.mpii import load_split

    root = ward
    ensure_faces(root, SPEC, "site-0")
    records = load_split(root, "site-0")
    augment = Augment(rotation=40.0, rotation_prob=1.0, flip_prob=0.5)
    ds = PoseDataset(records, input_size=INPUT, augment=augment, seed=0, face_tasks=True)
    checked = flips = 0
    for i in range(len(records)):
        for _ in range(3):
            item = ds[i]
            if item["face_present"] < 1 or item["face_visible"][:2].sum() < 2:
                continue
            right, left = item["face_landmarks"][0], item["face_landmarks"][1]
            d = left - right
            roll = float(item["head_pose"][2])
            assert math.degrees(math.atan2(d[1], d[0])) == pytest.approx(roll, abs=0.05), "roll does not turn"
            box, seen = item["face_box"], item["face_landmarks"][item["face_visible"].bool()]
            assert bool(((seen >= box[:2] - 0.5) & (seen <= box[2:] + 0.5)).all()), "landmarks leave the box"
            checked += 1
    assert checked > 20
    # a mirrored crop swaps the eyes and negates yaw and roll
    plain = PoseDataset(records, input_size=INPUT, augment=None, face_tasks=True)
    for i in range(len(records)):
        a = plain[i]
        if a["face_present"] < 1:
            continue
        from fedpose.shared.data.transforms import affine_matrix, transform_face

        rec = records[i]
        m = affine_matrix(rec.center, rec.scale, INPUT)
        present, _, pts, vis, pose = transform_face(rec.face, m, rotation=0.0, flip_width=INPUT[1], size_hw=INPUT)
        assert present
        assert pose[0] == pytest.approx(-float(a["head_pose"][0]))
        assert pose[2] == pytest.approx(-float(a["head_pose"][2]))
        assert vis.tolist() == a["face_visible"].bool()[[1, 0, 2, 4, 3]].tolist()
        np.testing.assert_allclose(pts[vis, 0], INPUT[1] - 1 - a["face_landmarks"][[1, 0, 2, 4, 3]][vis, 0].numpy(),
                                   atol=1e-4)
        flips += 1
    assert flips > 10
    # an empty Poisson batch keeps every face key, correctly shaped
    from fedpose.shared.data.dataset import FACE_KEYS, KEYS

    assert set(ds[0]) == set(KEYS) | set(FACE_KEYS) == set(ds.batch([0, 1]))
    empty = ds.batch([])
    assert set(empty) == set(KEYS) | set(FACE_KEYS)
    assert empty["face_landmarks"].shape == (0, 5, 2) and empty["face_attribute"].dtype == torch.int64


# ---------------------------------------------------------------------------------------------------------------
# the head under per-sample clipping
# ---------------------------------------------------------------------------------------------------------------


def _face_batch(n: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    h, w = INPUT
    lo = torch.rand(n, 2, generator=gen) * torch.tensor([w / 2, h / 2])
    return {
        "image": torch.rand(n, 3, h, w, generator=gen),
        "joints": torch.rand(n, 16, 2, generator=gen) * torch.tensor([w - 1.0, h - 1.0]),
        "visible": (torch.rand(n, 16, generator=gen) > 0.2).float(),
        "face_labelled": (torch.rand(n, generator=gen) > 0.2).float(),
        "face_present": (torch.rand(n, generator=gen) > 0.3).float(),
        "face_box": torch.cat([lo, lo + 4 + torch.rand(n, 2, generator=gen) * 6], dim=1),
        "face_landmarks": lo[:, None] + torch.rand(n, 5, 2, generator=gen) * 4,
        "face_visible": (torch.rand(n, 5, generator=gen) > 0.3).float(),
        "head_pose": (torch.rand(n, 3, generator=gen) - 0.5) * 300,
        "face_attribute": torch.randint(-1, 4, (n,), generator=gen),
    }


@pytest.mark.parametrize("strategy,uncertainty", [("finetune", True), ("full", False)])
def test_face_losses_clip_exactly_like_the_per_example_loop(strategy, uncertainty):
    from fedpose.shared.model.face_head import loss_terms
    from fedpose.shared.model.posenet import build_model
    from fedpose.shared.model.pose_loss import make_loss_fn
    from fedpose.shared.model.strategy import apply_strategy
    from fedpose.shared.privacy.step import bookkeeping
    from fedpose.shared.privacy.step.fpdp import clipped_grad_sum

    torch.manual_seed(0)
    model = build_model(ModelConfig(face_tasks=ALL_TASKS, task_uncertainty=uncertainty), INPUT)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    trainable = apply_strategy(model, strategy)
    assert any(n.startswith("face_head.") for n in trainable), "the face head must train under every strategy"
    named = dict(model.named_parameters())
    params = {n: named[n].detach() for n in trainable}
    batch = _face_batch(5, torch.Generator().manual_seed(1))
    loss_fn = make_loss_fn(model, trainable)
    parts = loss_fn.parts(params, batch)
    assert parts.shape == (5, 3 + len(loss_terms(ALL_TASKS))) and bool(torch.isfinite(parts).all())
    unlabelled = batch["face_labelled"] == 0
    assert bool((parts[unlabelled, 3:] == 0).all()), "a record without face labels has no face loss"
    assert bookkeeping.supports(loss_fn, params)
    fast = clipped_grad_sum(loss_fn, params, batch, clip_norm=0.05, chunk_size=2)
    slow = clipped_grad_sum(lambda p, b: loss_fn(p, b), params, batch, clip_norm=0.05, chunk_size=2)
    assert torch.allclose(fast.norms, slow.norms, rtol=1e-4)
    for name in slow.summed:
        scale = float(slow.summed[name].abs().max()) + 1e-12
        assert torch.allclose(fast.summed[name], slow.summed[name], rtol=2e-4, atol=2e-6 * max(scale, 1.0)), name
    # each sample's loss depends on that sample only
    single = loss_fn(params, {k: v[2:3] for k, v in batch.items()})
    assert torch.allclose(single, loss_fn(params, batch)[2:3], rtol=1e-5, atol=1e-6)


def test_head_pose_loss_wraps_around_180_degrees():
    from fedpose.shared.model.face_head import face_losses

    out = torch.zeros(2, 3)
    out[:, :] = 179.0 / 90.0
    batch = {"face_labelled": torch.ones(2), "face_present": torch.ones(2),
             "head_pose": torch.tensor([[-179.0, -179.0, -179.0], [179.0, 179.0, 179.0]])}
    loss = face_losses(out, batch, tasks=("head_pose",), attributes=4, input_size=INPUT)
    assert float(loss[0, 0]) == pytest.approx((2 / 90) ** 2, rel=1e-3) and float(loss[1, 0]) == pytest.approx(0.0)


def test_checkpoint_keeps_the_face_head(tmp_path):
    from fedpose.shared.model.posenet import build_model, load_checkpoint, save_checkpoint

    torch.manual_seed(0)
    model = build_model(ModelConfig(face_tasks=("landmarks", "detect")), INPUT).eval()
    save_checkpoint(tmp_path / "m.pt", model)
    again, _ = load_checkpoint(tmp_path / "m.pt")
    x = torch.rand(2, 3, *INPUT)
    with torch.no_grad():
        for a, b in zip(model.forward_with_face(x), again.forward_with_face(x)):
            assert torch.equal(a, b)
    assert again.cfg.face_tasks == ("landmarks", "detect")
    with pytest.raises(ValueError, match="no face tasks"):
        build_model(ModelConfig(), INPUT).forward_with_face(x)


# ---------------------------------------------------------------------------------------------------------------
# training under the five methods, evaluation, the claim
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def face_world(tmp_path_factory):
    from support.federation import prepare_world

    return prepare_world(tmp_path_factory.getbasetemp() / "fedpose-face-world",
                         model={"face_tasks": list(ALL_TASKS)}, train={"epochs": 1})


@pytest.mark.parametrize("method", ["nonprivate", "dpsgd", "proj", "fdp", "fpdp"])
def test_face_heads_train_under_every_method(face_world, method):
    from fedpose.shared.training.runs import initial_model, load_records
    from fedpose.shared.training.batches import make_dataset
    from fedpose.shared.privacy.step.subspace import public_basis_at
    from fedpose.shared.training.loop import select_device
    from fedpose.shared.training.loop import LocalData, LocalRun, local_train, step_spec

    cfg = face_world
    model = initial_model(cfg, progress=False)
    from fedpose.shared.model.strategy import apply_strategy

    trainable = apply_strategy(model, cfg.train.strategy)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith("face_head.")}
    assert before and all(n in trainable for n in before)
    records = load_records(cfg.data.root, "site-0")
    assert all(r.face is not None for r in records), "the ward's face file was not read"
    private = make_dataset(records, cfg, train=True, seed=0)
    public = make_dataset(load_records(cfg.data.root, cfg.data.public_split), cfg, train=False)
    basis = None
    if method in ("proj", "fpdp"):
        from fedpose.shared.model.pose_loss import make_loss_fn

        basis = public_basis_at(model, make_loss_fn(model, trainable), trainable, public, cfg.privacy,
                                select_device("cpu"))
    local_data = LocalData(private, public=public)
    local_run = LocalRun(step_spec(method, cfg.train, cfg.privacy, sigma=0.0 if method == "nonprivate" else 1.0,
                         data=local_data), 2, cfg.train, cfg.privacy)
    result = local_train(model, local_data, local_run, generator=torch.Generator().manual_seed(0), basis=basis,
                         bar=None)
    assert result.steps == 2
    moved = [n for n, p in model.named_parameters() if n in before and not torch.equal(p, before[n])]
    assert moved, f"{method}: no face-head weight moved"
    scale = dict(model.named_parameters())["head.log_task_scale"]
    assert scale.shape == (3 + 6,) and bool(torch.isfinite(scale).all())


def test_a_face_run_reports_the_face_metrics_and_names_its_labels_in_the_claim(face_world, tmp_path):
    from fedpose.shared.training.runs import run_train

    run_train(face_world, tmp_path / "run", progress=False)
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    face = metrics["face"]
    assert face["faces_present"] > 0 and face["nme_faces"] > 0
    for key in ("detection_accuracy", "box_iou", "landmark_mse", "visibility_mse", "nme_interocular", "pose_mse",
                "attribute_accuracy"):
        assert isinstance(face[key], float) and math.isfinite(face[key]), key
    assert set(face["pose_mae_degrees"]) == {"yaw", "pitch", "roll"}
    assert "face presence and box" in metrics["claim"] and "face attribute" in metrics["claim"]


# ---------------------------------------------------------------------------------------------------------------
# export and the camera
# ---------------------------------------------------------------------------------------------------------------


def test_the_export_carries_the_face_heads_and_the_camera_writes_them(tmp_path):
    import onnx

    from fedpose.edge.pipeline.demo_video import DemoSpec, load_truth, write_demo_video
    from fedpose.edge.export.exporter import export_onnx
    from fedpose.edge.export.spec import ExportOptions, export_outputs
    from fedpose.edge.runtime.onnx import OnnxRuntime
    from fedpose.edge.pipeline.source import FrameSource
    from fedpose.edge.pipeline.options import PipelineOptions
    from fedpose.edge.pipeline.loop import run_pipeline
    from fedpose.edge.pipeline.outputs import release_claim
    from fedpose.shared.pixelization.spec import PixelizeSpec
    from fedpose.edge.runtime.pytorch import TorchRuntime
    from fedpose.shared.model.posenet import build_model, save_checkpoint

    torch.manual_seed(0)
    model = build_model(ModelConfig(face_tasks=ALL_TASKS), INPUT).eval()
    save_checkpoint(tmp_path / "m.pt", model)
    report = export_onnx(model, tmp_path / "m.onnx", ExportOptions(batch="dynamic"))  # parity of every output checked
    assert report.max_abs_diff < 1e-4
    proto = onnx.load(str(tmp_path / "m.onnx"))
    names = ("simcc_x", "simcc_y", "visibility", "face_detect", "face_landmarks", "head_pose", "face_attribute")
    assert [o.name for o in proto.graph.output] == list(export_outputs(model)) == list(names)
    meta = {p.key: p.value for p in proto.metadata_props}
    assert meta["fedpose.face_tasks"] == "detect,landmarks,head_pose,attribute"
    assert meta["fedpose.face_attributes"] == "4"

    # the contract's second consumer (an integrator's OpenCV DNN / C++ pipeline) reads the face outputs too
    one = np.random.default_rng(1).random((1, 3, *INPUT), dtype=np.float32)
    fixed = export_onnx(model, tmp_path / "m1.onnx", ExportOptions(batch=1)).path
    import onnxruntime as ort

    ref = ort.InferenceSession(str(fixed), providers=["CPUExecutionProvider"]).run(list(names), {"image": one})
    net = cv2.dnn.readNetFromONNX(str(fixed))
    net.setInput(one, "image")
    for name, r, g in zip(names, ref, net.forward(list(names))):
        assert g.shape == r.shape and float(np.abs(g - r).max()) <= 1e-4, name

    x = np.random.default_rng(0).random((3, 3, *INPUT), dtype=np.float32)
    with OnnxRuntime(tmp_path / "m.onnx") as ort_rt, TorchRuntime(tmp_path / "m.pt") as torch_rt:
        assert ort_rt.face_outputs == torch_rt.face_outputs == names[3:]
        a, b = ort_rt.infer_all(x), torch_rt.infer_all(x)
        assert a.keys() == b.keys() == set(names) - {"visibility"}
        for k in a:
            np.testing.assert_allclose(a[k], b[k], atol=1e-4)
        clip = tmp_path / "clip.mp4"
        write_demo_video(clip, DemoSpec(frames=6, size=(160, 120), seed=1))
        roi = tuple(load_truth(clip)["roi"])
        run_pipeline(ort_rt, FrameSource(str(clip)), PipelineOptions(out_dir=tmp_path / "run", roi=roi))
    lines = [json.loads(line) for line in (tmp_path / "run" / "keypoints.jsonl").read_text().splitlines()]
    assert len(lines) == 6
    for rec in lines:
        face = rec["face"]
        assert set(face) == {"presence", "box", "landmarks", "head_pose", "attribute", "attribute_probability"}
        assert len(face["landmarks"]) == 5 and all(len(p) == 3 for p in face["landmarks"])
        assert face["box"][0] <= face["box"][2] and face["box"][1] <= face["box"][3]
        assert all(-180 <= v < 180 for v in face["head_pose"]) and 0 <= face["attribute"] < 4
    claim = release_claim(PixelizeSpec(eps=1.0, b=8, m=16), frames=6, keypoints_file="keypoints.jsonl", video_file=None,
                          face_outputs=names[3:])
    assert "face_detect" in claim and "NOT protected" in claim


# ---------------------------------------------------------------------------------------------------------------
# AFLW: real face data through the same layout
# ---------------------------------------------------------------------------------------------------------------


def _aflw(tmp_path, *, mirror_names: bool = False, flip_roll: bool = False):
    """A hand-written AFLW database of four faces (one whose image is missing) and their images."""
    import sqlite3

    images = tmp_path / "aflw" / "flickr"
    (images / "0").mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(3):
        cv2.imwrite(str(images / "0" / f"image{i:05d}.jpg"), rng.integers(0, 255, (120, 160, 3), dtype=np.uint8))
    # (roll deg, yaw deg, pitch deg, eye centre, which points are seen)
    faces = [(12.0, 25.0, -5.0, (60.0, 50.0), "all"), (-20.0, -35.0, 8.0, (100.0, 60.0), "all"),
             (3.0, 70.0, 0.0, (80.0, 40.0), "profile"), (0.0, 0.0, 0.0, (50.0, 50.0), "all")]
    db = sqlite3.connect(tmp_path / "aflw.sqlite")
    db.executescript("""
        CREATE TABLE FaceImages (image_id INTEGER, db_id TEXT, file_id TEXT, filepath TEXT, bw INTEGER,
                                 width INTEGER, height INTEGER);
        CREATE TABLE Faces (face_id INTEGER, file_id TEXT, db_id TEXT);
        CREATE TABLE FaceRect (face_id INTEGER, x INTEGER, y INTEGER, w INTEGER, h INTEGER, annot_type_id INTEGER);
        CREATE TABLE FacePose (face_id INTEGER, roll REAL, pitch REAL, yaw REAL, annot_type_id INTEGER);
        CREATE TABLE FeatureCoords (face_id INTEGER, feature_id INTEGER, x REAL, y REAL, annot_type_id INTEGER);
        CREATE TABLE FeatureCoordTypes (feature_id INTEGER, descr TEXT, code TEXT, x REAL, y REAL, z REAL);
        CREATE TABLE FaceMetaData (face_id INTEGER, sex TEXT, occluded INTEGER, glasses INTEGER, bw INTEGER,
                                   annot_type_id INTEGER);
    """)
    names = {8: "LeftEyeCenter", 11: "RightEyeCenter", 15: "NoseCenter", 18: "MouthLeftCorner", 20: "MouthRightCorner",
             1: "LeftBrowLeftCorner"}
    db.executemany("INSERT INTO FeatureCoordTypes VALUES (?, ?, '', 0, 0, 0)", list(names.items()))
    truth = []
    for face_id, (roll, yaw, pitch, (cx, cy), seen) in enumerate(faces, start=1):
        file_id = f"image{min(face_id - 1, 3):05d}.jpg"
        db.execute("INSERT INTO FaceImages VALUES (?, 'flickr', ?, ?, 0, 160, 120)", (face_id, file_id, f"0/{file_id}"))
        db.execute("INSERT INTO Faces VALUES (?, ?, 'flickr')", (face_id, file_id))
        db.execute("INSERT INTO FaceRect VALUES (?, ?, ?, 30, 36, 1)", (face_id, int(cx - 15), int(cy - 12)))
        stored_roll = -roll if flip_roll else roll
        db.execute("INSERT INTO FacePose VALUES (?, ?, ?, ?, 1)",
                   (face_id, math.radians(stored_roll), math.radians(pitch), math.radians(yaw)))
        db.execute("INSERT INTO FaceMetaData VALUES (?, ?, 0, 0, 0, 1)", (face_id, "f" if face_id % 2 else "m"))
        across = np.array([math.cos(math.radians(roll)), math.sin(math.radians(roll))])  # right eye -> left eye
        down = np.array([-across[1], across[0]])
        c = np.array([cx, cy])
        points = {"right_eye": c - 8 * across, "left_eye": c + 8 * across,
                  "nose": c + 10 * down + np.sign(yaw) * 3 * across,
                  "mouth_right": c + 18 * down - 6 * across, "mouth_left": c + 18 * down + 6 * across}
        if seen == "profile":
            points = {k: v for k, v in points.items() if k in ("right_eye", "nose", "mouth_right")}
        truth.append(points)
        by_name = {"right_eye": 11, "left_eye": 8, "nose": 15, "mouth_right": 20, "mouth_left": 18}
        if mirror_names:
            by_name = {"right_eye": 8, "left_eye": 11, "nose": 15, "mouth_right": 18, "mouth_left": 20}
        for key, (x, y) in points.items():
            db.execute("INSERT INTO FeatureCoords VALUES (?, ?, ?, ?, 1)", (face_id, by_name[key], float(x), float(y)))
        # a landmark fedpose does not use
        db.execute("INSERT INTO FeatureCoords VALUES (?, 1, 1.0, 1.0, 1)", (face_id,))
    db.commit()
    db.close()
    return tmp_path / "aflw.sqlite", images, truth


@pytest.mark.parametrize("mirror_names,flip_roll", [(False, False), (True, False), (False, True)])
def test_aflw_converts_to_the_layout_with_its_conventions_checked(tmp_path, mirror_names, flip_roll):
    from fedpose.shared.data.aflw import ATTRIBUTES, load_aflw
    from fedpose.shared.data.convert import convert
    from fedpose.shared.data.mpii import load_split

    database, images, truth = _aflw(tmp_path, mirror_names=mirror_names, flip_roll=flip_roll)
    records, report = load_aflw(database, images)
    assert report.faces == 3 and report.skipped == 1  # the fourth face's image is not there
    assert report.sides_swapped == mirror_names and report.roll_flipped == flip_roll and not report.yaw_flipped
    order = ("right_eye", "left_eye", "nose", "mouth_right", "mouth_left")
    for record, want, (roll, yaw, pitch) in zip(records, truth, [(12.0, 25.0, -5.0), (-20.0, -35.0, 8.0),
                                                                  (3.0, 70.0, 0.0)]):
        face = record.face
        assert face.present and not record.visible.any()
        assert face.visible.tolist() == [k in want for k in order]
        for i, key in enumerate(order):
            if key in want:
                np.testing.assert_allclose(face.landmarks[i], want[key], atol=1e-4)
        np.testing.assert_allclose(face.head_pose, [yaw, pitch, roll], atol=1e-3)
        assert np.all(record.center == (face.box[0] + face.box[1]) / 2)
    assert [r.face.attribute for r in records] == [1, 0, 1]  # f, m, f
    out = convert("aflw", database, images, tmp_path / "faces" / "train")
    again = load_split(out.parent, "train")
    assert read_faces(out / "faces.json", 3)[1] == ATTRIBUTES
    for a, b in zip(records, again):
        np.testing.assert_allclose(a.face.landmarks, b.face.landmarks, atol=1e-3)
        assert a.face.visible.tolist() == b.face.visible.tolist()


def test_aflw_refuses_what_is_not_an_aflw_database(tmp_path):
    import sqlite3

    from fedpose.shared.data.aflw import load_aflw

    (tmp_path / "img").mkdir()
    sqlite3.connect(tmp_path / "other.sqlite").execute("CREATE TABLE t (x)").connection.close()
    with pytest.raises(ValueError, match="not an AFLW database"):
        load_aflw(tmp_path / "other.sqlite", tmp_path / "img")
    with pytest.raises(FileNotFoundError, match="AFLW database not found"):
        load_aflw(tmp_path / "missing.sqlite", tmp_path / "img")


def test_face_metrics_on_hand_made_predictions():
    from fedpose.shared.metrics.face import face_lines, face_report

    eyes = np.array([[10.0, 20.0], [20.0, 20.0], [15.0, 25.0], [12.0, 30.0], [18.0, 30.0]])
    truth = {"labelled": np.array([1, 1, 1, 0], bool), "present": np.array([1, 1, 0, 1], bool),
             "box": np.tile([8.0, 15.0, 22.0, 35.0], (4, 1)), "landmarks": np.stack([eyes] * 4),
             "visible": np.ones((4, 5), bool), "head_pose": np.tile([170.0, 10.0, -5.0], (4, 1)),
             "attribute": np.array([2, -1, 1, 0])}
    moved = eyes + np.array([1.0, 0.0])  # every point 1 px off: NME = 1 / 10 (inter-ocular distance 10)
    pred = {"presence": np.array([0.9, 0.2, 0.1, 0.9]), "box": np.tile([8.0, 15.0, 22.0, 35.0], (4, 1)),
            "landmarks": np.stack([moved] * 4), "landmark_visibility": np.full((4, 5), 0.8),
            "head_pose": np.tile([-170.0, 10.0, -5.0], (4, 1)),  # yaw 20 degrees off across the wrap
            "attribute": np.array([2, 0, 0, 0]), "attribute_probability": np.full((4, 4), 0.25)}
    r = face_report(pred, truth, input_size=(64, 48))
    assert r["faces_labelled"] == 3 and r["faces_present"] == 2  # the unlabelled fourth counts nowhere
    assert r["detection_accuracy"] == pytest.approx(2 / 3)  # 0.9 present yes, 0.2 present no, 0.1 absent yes
    assert r["box_iou"] == pytest.approx(1.0)
    assert r["nme_interocular"] == pytest.approx(0.1) and r["nme_faces"] == 2
    assert r["landmark_mse"] == pytest.approx((1 / 48) ** 2)
    assert r["visibility_mse"] == pytest.approx(0.04) and r["visibility_accuracy"] == 1.0
    assert r["pose_mae_degrees"] == pytest.approx({"yaw": 20.0, "pitch": 0.0, "roll": 0.0})
    assert r["attribute_accuracy"] == pytest.approx(0.5) and r["attribute_count"] == 2  # -1 is unknown
    text = "\n".join(face_lines(r))
    assert "NME (inter-ocular) 0.100" in text and "yaw 20.0" in text


def test_a_site_trains_the_face_tasks_its_policy_lists_and_refuses_others(face_world, tmp_path):
    from fedpose.client.policy import min_sigma_for
    from fedpose.shared.flower.messages import ARRAYS, Refusal, RefusalCode
    from fedpose.shared.training.runs import initial_model
    from support.site import site_policy, train_request, spend_rows

    cfg = face_world
    state = {k: v.clone() for k, v in initial_model(cfg, progress=False).state_dict().items()}
    allowed = site_policy(cfg, tmp_path / "a", face_tasks=list(ALL_TASKS), methods=["dpsgd"])
    from fedpose.client.site import handle_train

    reply = handle_train(train_request(cfg, state, sigma=min_sigma_for(allowed)), allowed)
    from fedpose.shared.flower.messages import record_tensors

    weights = record_tensors(reply[ARRAYS])
    moved = [k for k in weights if k.startswith("face_head.") and not torch.equal(weights[k], state[k])]
    assert moved, "the site's round did not train the face head"
    assert len(spend_rows(allowed)) == 1
    # a site whose policy lists only some of the tasks refuses, with nothing trained and nothing spent
    partial = site_policy(cfg, tmp_path / "b", face_tasks=["detect"], methods=["dpsgd"])
    with pytest.raises(Refusal) as info:
        handle_train(train_request(cfg, state, sigma=min_sigma_for(partial)), partial)
    assert info.value.code == RefusalCode.POLICY and "face tasks" in str(info.value)
    assert spend_rows(partial) == []
