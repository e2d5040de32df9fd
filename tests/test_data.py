"""Data package: synthetic ward, MPII/COCO readers, transforms, dataset, P2 disjointness."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import shutil
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

from fedpose.shared.data.synth.body import POSE_KINDS
from fedpose.shared.data.synth.pose import sample_pose
from fedpose.shared.data.synth.rng import _derive_rng
from fedpose.shared.data.synth.styles import PUBLIC_STYLE, site_style
from fedpose.shared.data.synth.ward import WardSpec, ensure_ward, generate_ward, load_identities, render_sample
from fedpose.shared.data.augment import Augment, sample_augment
from fedpose.shared.data.coco import load_coco
from fedpose.shared.data.dataset import PoseDataset, collate
from fedpose.shared.data.joints import FLIP_PAIRS, JOINT_NAMES, NUM_JOINTS
from fedpose.shared.data.mpii import load_mpii, load_split
from fedpose.shared.data.records import PoseRecord, content_hash, inside, sanitize_joints
from fedpose.shared.data.split import check_disjoint
from fedpose.shared.data.transforms import (
    affine_matrix,
    flip_horizontal,
    inverse_transform,
    invert_affine,
    record_boxes,
    warp_points,
)

FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures"
J = {name: i for i, name in enumerate(JOINT_NAMES)}
TINY = WardSpec(sites=2, per_site=4, public=3, val=2, seed=7, image_size=64, images_per_identity=2)


def _fixture(sub: str) -> Path:
    path = FIXTURES / sub
    if not path.is_dir():
        pytest.skip(f"real-format fixtures not found at {path} (the shared/ directory beside the checkout)")
    return path


@pytest.fixture(scope="module")
def ward(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_ward(tmp_path_factory.mktemp("ward") / "w", TINY, progress=False)


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# --------------------------------------------------------------------------- synthetic ward


def test_generator_is_deterministic_and_seed_dependent(tmp_path: Path, ward: Path) -> None:
    again = generate_ward(tmp_path / "again", TINY, progress=False)
    first, second = _files(ward), _files(again)
    assert first.keys() == second.keys()
    assert any(name.endswith(".png") for name in first)
    assert all(first[name] == second[name] for name in first)

    other = generate_ward(tmp_path / "other", dataclasses.replace(TINY, seed=8), progress=False)
    third = _files(other)
    pngs = [n for n in first if n.endswith(".png")]
    assert all(first[n] != third[n] for n in pngs)
    assert first["site-0/annotations.json"] != third["site-0/annotations.json"]


def test_a_ward_drawn_by_several_processes_is_the_same_ward(tmp_path: Path, ward: Path) -> None:
    # a large ward is drawn by a pool of processes (minutes on one core): the files must not depend on how many
    parallel = generate_ward(tmp_path / "parallel", TINY, progress=False, workers=2)
    first, second = _files(ward), _files(parallel)
    assert first.keys() == second.keys()
    assert [name for name in first if first[name] != second[name]] == []


def test_a_runs_data_identity_counts_the_records_of_each_split(ward: Path) -> None:
    from fedpose.shared.data.digest import data_identity

    found = data_identity(ward, ["site-0", "public", "val"])
    assert found["records"] == {"site-0": TINY.per_site, "public": TINY.public, "val": TINY.val}


# The synthetic ward's content under the locked environment (constraints.txt). The ward is drawn with OpenCV and
# NumPy: a version of either that draws other pixels changes every number the results report, so it must fail
# here, loudly, before anyone compares a result. Update this value only together with the lock and the results.
TINY_WARD_DIGEST = "59d6619e3dcbb12149fa62e19639a04aacd56a079d7b31d401298323c05a3f71"


def test_the_synthetic_ward_is_pixel_for_pixel_the_pinned_one(ward: Path) -> None:
    from fedpose.shared.data.records import content_hash

    digest = hashlib.sha256()
    for path in sorted(p for p in ward.rglob("*") if p.is_file()):
        digest.update(path.relative_to(ward).as_posix().encode())
        data = content_hash(path) if path.suffix == ".png" else hashlib.sha256(path.read_bytes()).hexdigest()
        digest.update(data.encode())
    assert digest.hexdigest() == TINY_WARD_DIGEST, (
        "the synthetic ward drew other pixels or annotations than the pinned ones: a dependency changed (OpenCV, "
        "NumPy?) or the generator did; every reported number depends on it (see constraints.txt)")


def test_splits_are_independent_of_other_split_sizes() -> None:
    bigger = dataclasses.replace(TINY, per_site=9, public=11, sites=3)
    for split in ("site-1", "public"):
        for index in (0, 3):
            img_a, rec_a, id_a, kind_a = render_sample(TINY, split, index)
            img_b, rec_b, id_b, kind_b = render_sample(bigger, split, index)
            assert np.array_equal(img_a, img_b)
            assert np.array_equal(rec_a.joints, rec_b.joints) and (id_a, kind_a) == (id_b, kind_b)
    # Every (seed, split, index) has its own random stream.
    draws = {key: _derive_rng(*key).random(4).tolist() for key in
             [(7, "site-0", 0), (7, "site-1", 0), (7, "site-0", 1), (8, "site-0", 0), (7, "val", 0)]}
    assert len({tuple(v) for v in draws.values()}) == len(draws)
    assert _derive_rng(7, "site-1", 0).random(4).tolist() == draws[(7, "site-1", 0)]


def test_annotations_round_trip_through_load_split(ward: Path) -> None:
    for split, count in TINY.splits().items():
        records = load_split(ward, split)
        assert len(records) == count
        assert len(load_identities(ward, split)) == count
        for index, record in enumerate(records):
            _, expected, _, _ = render_sample(TINY, split, index)
            assert record.image.is_absolute() and record.image.is_file()
            assert record.image.parent == (ward / split / "images").resolve()
            np.testing.assert_array_equal(record.visible, expected.visible)
            np.testing.assert_allclose(record.joints, expected.joints, atol=1e-3)
            np.testing.assert_allclose(record.center, expected.center, atol=1e-3)
            np.testing.assert_allclose(record.scale, expected.scale, rtol=1e-5)
            np.testing.assert_allclose(record.headbox, expected.headbox, atol=1e-3)
            image = cv2.imread(str(record.image))
            assert image.shape == (TINY.image_size, TINY.image_size, 3)
    manifest = json.loads((ward / "manifest.json").read_text())
    assert manifest["spec"]["seed"] == TINY.seed and manifest["splits"] == TINY.splits()


def test_identities_repeat_within_a_split_and_val_people_are_held_out(ward: Path) -> None:
    site = load_identities(ward, "site-0")
    assert site[0] == site[1] != site[2]  # images_per_identity = 2
    val = set(load_identities(ward, "val"))
    private = {i for s in range(TINY.sites) for i in load_identities(ward, f"site-{s}")}
    assert val and not val & private


def test_synthetic_joints_lie_inside_images_and_poses_are_plausible() -> None:
    spec = WardSpec(sites=4, per_site=30, public=30, val=4, seed=3, image_size=96)
    kinds = set()
    for split in ("public", "site-0", "site-3"):
        for index in range(30):
            image, record, _, kind = render_sample(spec, split, index)
            kinds.add(kind)
            assert image.shape == (96, 96, 3) and image.dtype == np.uint8
            assert record.visible.all(), f"{split}/{index}: all joints are placed inside the frame"
            assert (record.joints >= 0).all() and (record.joints < 96).all()
            side = record.scale * 200
            lo, hi = record.joints.min(axis=0), record.joints.max(axis=0)
            assert (hi - lo).max() * 1.2 < side < (hi - lo).max() * 1.6  # box ~25% larger than the person
            assert np.all(np.abs(record.joints - record.center) <= side / 2)
    assert kinds == set(POSE_KINDS)

    rng = np.random.default_rng(0)
    for _ in range(20):
        upright = sample_pose("standing", rng)
        assert upright[J["head_top"], 1] < upright[J["thorax"], 1] < upright[J["pelvis"], 1]
        assert upright[J["pelvis"], 1] < upright[J["r_ankle"], 1] and upright[J["pelvis"], 1] < upright[J["l_ankle"], 1]
        lying = sample_pose("lying", rng)
        axis = lying[J["head_top"]] - (lying[J["r_ankle"]] + lying[J["l_ankle"]]) / 2
        assert abs(axis[0]) > 2 * abs(axis[1])  # body roughly horizontal
        raised = sample_pose("arms_raised", rng)
        assert min(raised[J["r_wrist"], 1], raised[J["l_wrist"], 1]) < raised[J["thorax"], 1]


def test_sites_differ_and_public_style_is_separate() -> None:
    styles = [site_style(i) for i in range(6)]
    assert len({(s.wall, s.floor, s.person_height, s.noise) for s in styles}) == 6
    assert PUBLIC_STYLE not in styles
    # Mean colour of site images differs clearly between the hand-made sites.
    spec = WardSpec(sites=4, per_site=8, public=1, val=1, seed=0, image_size=64)
    means = [np.mean([render_sample(spec, f"site-{s}", i)[0].mean(axis=(0, 1)) for i in range(8)], axis=0)
             for s in range(4)]
    for a in range(4):
        for b in range(a + 1, 4):
            assert np.abs(means[a] - means[b]).max() > 10


def test_a_shifted_public_style_changes_only_the_public_split(tmp_path: Path, ward: Path) -> None:
    """The study's domain-shift ablation: data.synth.public_style = shifted."""
    from fedpose.shared.configuration.schema import config_from_dict

    shifted = generate_ward(tmp_path / "shifted", dataclasses.replace(TINY, public_style="shifted"),
                                  progress=False)
    base, other = _files(ward), _files(shifted)
    for name in base:
        if name.startswith(("site-", "val/")):
            assert base[name] == other[name], name  # the sites and validation are the same images
    public = [n for n in base if n.startswith("public/images/")]
    assert public and all(base[n] != other[n] for n in public)
    assert base["public/annotations.json"] != other["public/annotations.json"]  # people larger, other poses
    # A ward generated before the field existed (no public_style in its manifest) is still the default ward.
    assert "public_style" not in json.loads((ward / "manifest.json").read_text())["spec"]
    with pytest.raises(ValueError, match="public_style"):
        ensure_ward(ward, dataclasses.replace(TINY, public_style="shifted"), progress=False)
    with pytest.raises(ValueError, match="public_style must be one of"):
        WardSpec(public_style="night")
    cfg = config_from_dict({"data": {"synth": {"public_style": "shifted"}}})
    assert cfg.data.synth.public_style == "shifted"
    # Pretrained weights cached before the field existed are still this config's (their fingerprint lacks it).
    from fedpose.shared.configuration.flat import config_fingerprint

    assert "public_style" not in config_fingerprint(config_from_dict({}), "data")["data"]["synth"]
    assert config_fingerprint(cfg, "data")["data"]["synth"]["public_style"] == "shifted"


def test_ensure_ward_reuses_matching_and_refuses_mismatched(tmp_path: Path, ward: Path) -> None:
    before = (ward / "site-0" / "annotations.json").stat().st_mtime_ns
    assert ensure_ward(ward, TINY, progress=False) == ward
    assert (ward / "site-0" / "annotations.json").stat().st_mtime_ns == before
    with pytest.raises(ValueError, match="seed"):
        ensure_ward(ward, dataclasses.replace(TINY, seed=99), progress=False)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "file.txt").write_text("x")
    with pytest.raises(ValueError, match="manifest"):
        ensure_ward(tmp_path / "junk", TINY, progress=False)
    with pytest.raises(FileExistsError):
        generate_ward(ward, TINY, progress=False)
    with pytest.raises(ValueError, match="per_site"):
        WardSpec(per_site=0)


# --------------------------------------------------------------------------- MPII


def test_mpii_fixture_loads_with_hrnet_conventions() -> None:
    root = _fixture("mpii")
    raw = json.loads((root / "test_mpii.json").read_text())
    records = load_mpii(root / "test_mpii.json", root)
    assert len(records) == len(raw) == 5
    for entry, record in zip(raw, records):
        assert record.image == (root / entry["image"]).resolve()
        vis = np.array(entry["joints_vis"]) > 0
        np.testing.assert_array_equal(record.visible, vis)
        np.testing.assert_allclose(record.joints[vis], np.array(entry["joints"])[vis] - 1.0, atol=1e-4)
        assert np.all(record.joints[~vis] == 0)
        assert record.scale == pytest.approx(entry["scale"] * 1.25)
        assert record.center[0] == pytest.approx(entry["center"][0] - 1)
        assert record.center[1] == pytest.approx(entry["center"][1] + 15 * entry["scale"] - 1, abs=1e-3)


def test_mpii_headboxes_from_official_mat_and_count_check(tmp_path: Path) -> None:
    from scipy.io import savemat

    root = _fixture("mpii")
    boxes = np.stack([np.array([[10.0 + i, 20.0], [50.0, 70.0 + i]]) for i in range(5)], axis=2)  # (2, 2, 5)
    savemat(tmp_path / "mpii_gt_val.mat", {"headboxes_src": boxes})
    records = load_mpii(root / "test_mpii.json", root, headboxes=tmp_path / "mpii_gt_val.mat")
    np.testing.assert_allclose(records[3].headbox, boxes[:, :, 3] - 1.0)
    savemat(tmp_path / "short.mat", {"headboxes_src": boxes[:, :, :4]})
    with pytest.raises(ValueError, match="4 head boxes"):
        load_mpii(root / "test_mpii.json", root, headboxes=tmp_path / "short.mat")


def _hrnet_reference_matrix(center: np.ndarray, side: float, size: int, rotation: float) -> np.ndarray:
    """Independent construction (three point correspondences, as HRNet does) for a square output."""
    r = math.radians(rotation)

    def turn(v: tuple[float, float]) -> np.ndarray:
        return np.array([v[0] * math.cos(r) - v[1] * math.sin(r), v[0] * math.sin(r) + v[1] * math.cos(r)])

    src = np.float32([center, center + turn((0, -side / 2)), center + turn((-side / 2, 0))])
    dst = np.float32([[size / 2, size / 2], [size / 2, 0], [0, size / 2]])
    return cv2.getAffineTransform(src, dst)


def test_affine_crop_of_fixture_people_matches_explicit_mapping() -> None:
    root = _fixture("mpii")
    records = load_mpii(root / "test_mpii.json", root)
    size = 128
    for record in records:
        for rotation in (0.0, 25.0):
            m = affine_matrix(record.center, record.scale, (size, size), rotation=rotation)
            ref = _hrnet_reference_matrix(record.center.astype(np.float64), record.box_side, size, rotation)
            np.testing.assert_allclose(m, ref, rtol=1e-4, atol=1e-3)
            out = warp_points(record.joints[record.visible], m)
            if rotation == 0.0:
                # Explicit inverse: x = c + (u - size / 2) * side / size.
                back = record.center + (out.astype(np.float64) - size / 2) * record.box_side / size
                np.testing.assert_allclose(back, record.joints[record.visible], atol=1e-2)
                assert ((out >= 0) & (out < size)).all()
            np.testing.assert_allclose(warp_points(out, invert_affine(m)), record.joints[record.visible], atol=1e-2)
    # Non-square output: the box is widened to the aspect, its width spans exactly W.
    m = affine_matrix((100.0, 50.0), 0.5, (64, 48))
    np.testing.assert_allclose(warp_points(np.array([[50.0, 50.0], [150.0, 50.0], [100.0, 0.0]]), m),
                               [[0.0, 32.0], [48.0, 32.0], [24.0, 32.0 - 50.0 * 48 / 100]], atol=1e-4)


def _marked_record(tmp_path: Path) -> PoseRecord:
    """A synthetic frame with a unique magenta marker painted on the right wrist."""
    image, record, _, _ = render_sample(WardSpec(seed=5, image_size=128), "public", 2)
    magenta = (255, 0, 255)  # BGR
    image[np.all(image == magenta, axis=2)] = (0, 0, 0)
    wrist = record.joints[J["r_wrist"]]
    cv2.circle(image, (int(round(wrist[0])), int(round(wrist[1]))), 3, magenta, -1)
    path = tmp_path / "marked.png"
    cv2.imwrite(str(path), image)
    return PoseRecord(path, record.center, record.scale, record.joints, record.visible, record.headbox)


def _colour_at(item: dict[str, torch.Tensor], joint: int) -> np.ndarray:
    x, y = (int(round(float(v))) for v in item["joints"][joint])
    return item["image"][:, y, x].numpy()  # RGB


def test_crop_puts_the_marked_pixel_at_the_transformed_joint(tmp_path: Path) -> None:
    record = _marked_record(tmp_path)
    plain = PoseDataset([record], input_size=(96, 96), augment=None)[0]
    assert plain["visible"][J["r_wrist"]] == 1
    np.testing.assert_allclose(_colour_at(plain, J["r_wrist"]), [1.0, 0.0, 1.0], atol=0.1)
    # Rotated, rescaled and flipped: the right wrist becomes the left wrist of the mirrored person.
    aug = Augment(scale_factor=0.2, rotation=30.0, rotation_prob=1.0, flip_prob=1.0)
    dataset = PoseDataset([record], input_size=(96, 80), augment=aug, seed=1)
    checked = 0
    for _ in range(8):
        item = dataset[0]
        if item["visible"][J["l_wrist"]]:
            np.testing.assert_allclose(_colour_at(item, J["l_wrist"]), [1.0, 0.0, 1.0], atol=0.15)
            checked += 1
    assert checked >= 4


def test_inverse_transform_returns_original_coordinates() -> None:
    root = _fixture("mpii")
    records = load_mpii(root / "test_mpii.json", root)
    dataset = PoseDataset(records, input_size=(64, 48), augment=None, cache_images=False)
    batch = dataset.batch(range(len(records)))
    centers, scales = record_boxes(records)
    back = inverse_transform(batch["joints"].numpy(), centers, scales, (64, 48))
    for i, record in enumerate(records):
        vis = batch["visible"][i].numpy() > 0
        assert vis.sum() >= 14
        np.testing.assert_allclose(back[i][vis], record.joints[vis], atol=1e-2)


# --------------------------------------------------------------------------- COCO


def test_coco_fixture_maps_to_mpii_joints() -> None:
    root = _fixture("coco")
    raw = json.loads((root / "test_coco.json").read_text())
    usable = [a for a in raw["annotations"] if not a["iscrowd"] and a["num_keypoints"] > 0]
    records = load_coco(root / "test_coco.json", root)
    assert 1 <= len(records) == len(usable) < len(raw["annotations"])
    by_image = {img["id"]: img["file_name"] for img in raw["images"]}
    first = sorted(usable, key=lambda a: a["image_id"])[0]
    record = next(r for r in records if r.image.name == by_image[first["image_id"]])
    kp = np.array(first["keypoints"], dtype=float).reshape(17, 3)
    for mpii_name, coco_index in (("r_ankle", 16), ("l_wrist", 9), ("r_elbow", 8), ("l_hip", 11), ("r_knee", 14)):
        np.testing.assert_allclose(record.joints[J[mpii_name]], kp[coco_index, :2])
    np.testing.assert_allclose(record.joints[J["pelvis"]], (kp[11, :2] + kp[12, :2]) / 2)
    np.testing.assert_allclose(record.joints[J["thorax"]], (kp[5, :2] + kp[6, :2]) / 2)
    assert record.visible.all()
    assert record.joints[J["head_top"], 1] < record.joints[J["upper_neck"], 1] < record.joints[J["thorax"], 1]
    x, y, w, h = first["bbox"]
    np.testing.assert_allclose(record.center, [x + w / 2, y + h / 2], atol=1e-3)
    assert record.scale == pytest.approx(max(w, h) * 1.25 / 200)


def test_coco_unlabelled_face_leaves_head_invisible() -> None:
    from fedpose.shared.data.coco import coco_to_mpii

    kp = np.zeros((17, 3))
    kp[5:, :2] = np.arange(24).reshape(12, 2) + 10
    kp[5:, 2] = 2
    joints, vis = coco_to_mpii(kp)
    assert vis[J["thorax"]] and not vis[J["head_top"]] and not vis[J["upper_neck"]]
    kp[6, 2] = 0  # right shoulder missing -> no thorax
    kp[0] = (50, 5, 2)
    joints, vis = coco_to_mpii(kp)
    assert not vis[J["thorax"]] and not vis[J["head_top"]] and not vis[J["r_shoulder"]]


# --------------------------------------------------------------------------- transforms, records


def test_flip_swaps_left_right_and_mirrors_x() -> None:
    rng = np.random.default_rng(0)
    image = rng.integers(0, 255, (20, 30, 3), dtype=np.uint8)
    joints = rng.uniform(0, 29, (NUM_JOINTS, 2)).astype(np.float32)
    visible = np.ones(NUM_JOINTS, bool)
    visible[J["r_ankle"]] = False
    flipped, fj, fv = flip_horizontal(image, joints, visible, 30)
    np.testing.assert_array_equal(flipped[:, 29 - 4], image[:, 4])
    for right, left in FLIP_PAIRS:
        assert fv[left] == visible[right] and fv[right] == visible[left]
        if visible[right]:
            np.testing.assert_allclose(fj[left], [29 - joints[right, 0], joints[right, 1]])
        np.testing.assert_allclose(fj[right], [29 - joints[left, 0], joints[left, 1]])
    assert not fv[J["l_ankle"]] and np.all(fj[J["l_ankle"]] == 0)
    np.testing.assert_allclose(fj[J["head_top"]], [29 - joints[J["head_top"], 0], joints[J["head_top"], 1]])
    back, bj, bv = flip_horizontal(flipped, fj, fv, 30)
    np.testing.assert_array_equal(back, image)
    np.testing.assert_allclose(bj[bv], joints[bv], atol=1e-5)


def test_nan_and_outside_joints_become_invisible() -> None:
    joints = np.full((NUM_JOINTS, 2), 10.0)
    joints[0] = (np.nan, 3.0)
    joints[1] = (np.inf, 3.0)
    joints[2] = (-0.5, 5.0)
    joints[3] = (5.0, 40.0)  # below a 40-high image
    joints[4] = (49.9, 39.9)  # last pixel: inside
    clean, vis = sanitize_joints(joints, np.ones(NUM_JOINTS), (40, 50))
    assert vis.tolist() == [False] * 4 + [True] * 12
    assert np.all(clean[:4] == 0) and np.isfinite(clean).all()
    with pytest.raises(ValueError, match="non-finite"):
        PoseRecord(Path("/x.png"), (1, 1), 1.0, joints, np.ones(NUM_JOINTS, bool))
    with pytest.raises(ValueError, match="absolute"):
        PoseRecord(Path("x.png"), (1, 1), 1.0, clean, vis)
    record = PoseRecord(Path("/x.png"), (1, 1), 1.0, clean, vis)
    with pytest.raises(ValueError):
        record.joints[5, 0] = 3.0  # read-only


def test_sample_augment_ranges_and_validation() -> None:
    rng = np.random.default_rng(0)
    aug = Augment()
    draws = [sample_augment(rng, aug) for _ in range(400)]
    scales = np.array([d[0] for d in draws])
    rotations = np.array([d[1] for d in draws])
    flips = np.array([d[2] for d in draws])
    assert scales.min() >= 0.75 and scales.max() <= 1.25 and scales.std() > 0.1
    assert np.abs(rotations).max() <= 60 and 0.3 < (rotations == 0).mean() < 0.5
    assert 0.4 < flips.mean() < 0.6
    with pytest.raises(ValueError, match="flip_prob"):
        Augment(flip_prob=1.5)


# --------------------------------------------------------------------------- errors, P2, dataset


def test_missing_image_is_named(tmp_path: Path) -> None:
    root = _fixture("mpii")
    entries = json.loads((root / "test_mpii.json").read_text())[:2]
    entries[1]["image"] = "does_not_exist_123.jpg"
    for entry in entries[:1]:
        shutil.copy(root / entry["image"], tmp_path / entry["image"])
    (tmp_path / "ann.json").write_text(json.dumps(entries))
    with pytest.raises(FileNotFoundError, match="does_not_exist_123.jpg"):
        load_mpii(tmp_path / "ann.json", tmp_path)
    # A file that disappears after loading is named when the dataset reads it.
    (tmp_path / "ann.json").write_text(json.dumps(entries[:1]))
    records = load_mpii(tmp_path / "ann.json", tmp_path)
    (tmp_path / entries[0]["image"]).unlink()
    with pytest.raises(FileNotFoundError, match=entries[0]["image"]):
        PoseDataset(records, input_size=(32, 32), augment=None)[0]


@pytest.mark.invariant("P2")
def test_check_disjoint_catches_a_copied_image(tmp_path: Path, ward: Path) -> None:
    public = load_split(ward, "public")
    private = load_split(ward, "site-0")
    check_disjoint(public, private)  # generated splits are disjoint
    copy = tmp_path / "renamed.png"
    shutil.copy(public[1].image, copy)
    assert content_hash(copy) == content_hash(public[1].image)
    leaked = PoseRecord(copy, private[0].center, private[0].scale, private[0].joints, private[0].visible)
    with pytest.raises(ValueError, match="renamed.png"):
        check_disjoint(public, [*private, leaked])


def test_dataset_batch_shapes_empty_batch_and_seeded_augmentation(ward: Path) -> None:
    records = load_split(ward, "site-1")
    size = (48, 40)
    aug = Augment()
    dataset = PoseDataset(records, input_size=size, augment=aug, seed=3)
    batch = dataset.batch([2, 0, 2])
    assert batch["image"].shape == (3, 3, 48, 40) and batch["image"].dtype == torch.float32
    assert 0.0 <= float(batch["image"].min()) and float(batch["image"].max()) <= 1.0
    assert batch["joints"].shape == (3, NUM_JOINTS, 2) and batch["visible"].shape == (3, NUM_JOINTS)
    assert batch["index"].tolist() == [2, 0, 2] and batch["index"].dtype == torch.int64
    vis = batch["visible"] > 0
    assert bool(torch.all(batch["joints"][~vis] == 0))
    inside = (batch["joints"][..., 0] < 40) & (batch["joints"][..., 1] < 48) & (batch["joints"] >= 0).all(-1)
    assert bool(torch.all(inside[vis]))
    empty = dataset.batch([])
    assert empty["image"].shape == (0, 3, 48, 40) and empty["joints"].shape == (0, NUM_JOINTS, 2)
    assert empty["visible"].shape == (0, NUM_JOINTS) and empty["index"].shape == (0,)
    assert empty["index"].dtype == torch.int64 and empty["visible"].dtype == torch.float32
    # Same seed -> same augmented batch; the generator is the dataset's own.
    again = PoseDataset(records, input_size=size, augment=aug, seed=3).batch([2, 0, 2])
    assert torch.equal(batch["image"], again["image"]) and torch.equal(batch["joints"], again["joints"])
    np.random.seed(0)
    torch.manual_seed(0)
    other = PoseDataset(records, input_size=size, augment=aug, seed=4).batch([2, 0, 2])
    assert not torch.equal(batch["joints"], other["joints"])
    with pytest.raises(ValueError, match="batch"):
        collate([])


@pytest.mark.parametrize("threads", [1, 3])
def test_a_batch_is_its_items_drawn_in_order_whatever_the_threads_rendering_it(ward: Path, threads: int) -> None:
    """batch() renders crops in a pool of torch's thread count; each item's draws still come from the dataset's
    generator in order, so the batch equals the same items taken one by one (photometric jitter and face labels
    included), bit for bit."""
    records = load_split(ward, "site-1")
    indices = [3, 1, 3, 0, 2, 1, 0, 2]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for augment in (Augment(photometric=0.5), Augment(), None):
            one = PoseDataset(records, input_size=(48, 40), augment=augment, seed=5, face_tasks=True)
            expected = collate([one[i] for i in indices])
            batch = PoseDataset(records, input_size=(48, 40), augment=augment, seed=5, face_tasks=True).batch(indices)
            assert batch.keys() == expected.keys()
            for key, value in expected.items():
                assert batch[key].dtype == value.dtype and torch.equal(batch[key], value), (augment, key)
            assert batch["image"].is_contiguous()
    finally:
        torch.set_num_threads(previous)


def test_joints_outside_the_crop_are_invisible(ward: Path) -> None:
    record = load_split(ward, "public")[0]
    # A small box around the head: the legs fall outside the crop.
    small = PoseRecord(record.image, record.joints[J["head_top"]], record.scale * 0.3, record.joints, record.visible)
    item = PoseDataset([small], input_size=(32, 32), augment=None)[0]
    expected = inside(warp_points(record.joints, affine_matrix(small.center, small.scale, (32, 32))), (32, 32))
    expected &= record.visible
    assert expected[J["head_top"]] and not expected[J["r_ankle"]]
    np.testing.assert_array_equal(item["visible"].numpy() > 0, expected)
    assert torch.all(item["joints"][torch.from_numpy(~expected)] == 0)
