"""Tests for shared/metrics/pose.py: PCKh (hand-computed case) and OKS AP (real COCO fixture)."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np
import pytest

from fedpose.shared.data.joints import NUM_JOINTS
from fedpose.shared.metrics.pose import gt_as_detections, oks_ap, pckh, pckh_report, pckh_table

FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures"
COCO_JSON = FIXTURES / "coco" / "test_coco.json"

# Three people with known head sizes: 0.6 * head-box diagonal.
#   person 0: box 30 x 40 -> diagonal 50  -> head size 30
#   person 1: box 60 x 80 -> diagonal 100 -> head size 60
#   person 2: box  6 x  8 -> diagonal 10  -> head size 6
HEADBOXES = np.array(
    [
        [[5.0, 5.0], [35.0, 45.0]],
        [[100.0, 20.0], [160.0, 100.0]],
        [[0.0, 300.0], [6.0, 308.0]],
    ]
)
HEAD_SIZES = np.array([30.0, 60.0, 6.0])

# Error of each joint as a fraction of the person's head size (MPII joint order:
# 0 r_ankle 1 r_knee 2 r_hip 3 l_hip 4 l_knee 5 l_ankle 6 pelvis 7 thorax
# 8 upper_neck 9 head_top 10 r_wrist 11 r_elbow 12 r_sho 13 l_sho 14 l_elb 15 l_wrist).
FRACTIONS = np.array(
    [
        #  0     1     2    3    4     5    6    7    8     9    10    11    12    13    14    15
        [0.0, 0.05, 0.5, 0.2, 0.3, 0.6, 2.0, 0.0, 0.7, 0.08, 0.9, 0.12, 0.4, 0.45, 0.55, 0.3],
        [0.0, 0.6, 0.3, 0.05, 0.2, 0.2, 0.0, 3.0, 0.2, 0.6, 0.05, 0.3, 0.02, 0.7, 0.2, 5.0],
        [0.3, 0.3, 0.8, 0.3, 0.09, 0.9, 0.0, 0.4, 0.04, 0.3, 0.2, 0.8, 0.3, 0.06, 0.4, 0.25],
    ]
)
VISIBLE = np.ones((3, NUM_JOINTS), dtype=bool)
VISIBLE[1, 0] = False  # would be correct (error 0) if it were counted
VISIBLE[1, 15] = False  # would be wrong (error 5 head sizes) if it were counted
VISIBLE[2, 6] = False  # pelvis: excluded from the mean anyway


def _case() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    gt = rng.uniform(0, 400, size=(3, NUM_JOINTS, 2))
    # Offset along (3, 4) / 5 so that e.g. 0.5 * 30 = 15 -> (9, 12), norm exactly 15.
    length = FRACTIONS * HEAD_SIZES[:, None]  # (3, 16) pixels
    offset = np.stack([length / 5 * 3, length / 5 * 4], axis=-1)
    # Flip some directions: the distance, not the sign, must matter.
    offset[:, ::2] *= -1
    return gt + offset, gt, VISIBLE.copy(), HEADBOXES.copy()


def test_pckh_hand_computed_at_0_5():
    pred, gt, vis, boxes = _case()
    got = pckh(pred, gt, vis, boxes, threshold=0.5)
    # Per joint (correct / visible), error <= 0.5 counts (person 0 r_hip is exactly 0.5):
    #   r_ankle 2/2 (person 1 invisible), l_ankle 1/3   -> ankle    (100 + 33.3) / 2
    #   r_knee 2/3, l_knee 3/3                          -> knee     (66.7 + 100) / 2
    #   r_hip 2/3, l_hip 3/3                            -> hip      (66.7 + 100) / 2
    #   head_top 2/3                                    -> head     66.7
    #   r_sho 3/3, l_sho 2/3                            -> shoulder (100 + 66.7) / 2
    #   r_elb 2/3, l_elb 2/3                            -> elbow    66.7
    #   r_wri 2/3, l_wri 2/2 (person 1 invisible)       -> wrist    (66.7 + 100) / 2
    # Mean over all joints but pelvis/thorax, upper neck (2/3) included:
    #   hits 2+1+2+3+2+3+2+3+2+2+2+2+2+2 = 30 over 12*3 + 2*2 = 40 visible -> 75
    expected = {
        "head": 200 / 3,
        "shoulder": (100 + 200 / 3) / 2,
        "elbow": 200 / 3,
        "wrist": (200 / 3 + 100) / 2,
        "hip": (200 / 3 + 100) / 2,
        "knee": (200 / 3 + 100) / 2,
        "ankle": (100 + 100 / 3) / 2,
        "mean": 75.0,
    }
    assert list(got) == list(expected)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, abs=1e-9), key
    # Counting pelvis/thorax would give 33/45 = 73.3; counting invisible joints 31/42;
    # an unweighted mean of the 14 joints 76.19: all differ from 75.
    assert all(isinstance(v, float) for v in got.values())


def test_pckh_hand_computed_at_0_1_differs_from_0_5():
    pred, gt, vis, boxes = _case()
    got = pckh(pred, gt, vis, boxes, threshold=0.1)
    # error <= 0.1: r_ankle 1/2, l_ankle 0/3, r_knee 1/3, l_knee 1/3, r_hip 0/3, l_hip 1/3,
    # head 1/3, r_sho 1/3, l_sho 1/3, r_elb 0/3 (0.12 > 0.1), l_elb 0/3, r_wri 1/3, l_wri 0/2,
    # neck 1/3 -> mean 9 / 40.
    expected = {
        "head": 100 / 3,
        "shoulder": 100 / 3,
        "elbow": 0.0,
        "wrist": 50 / 3,
        "hip": 50 / 3,
        "knee": 100 / 3,
        "ankle": 25.0,
        "mean": 22.5,
    }
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, abs=1e-9), key

    report = pckh_report(pred, gt, vis, boxes)
    assert set(report) == {"pckh", "pckh@0.1"}
    assert list(report["pckh"]) == list(report["pckh@0.1"])
    assert report["pckh@0.1"] == got
    assert report["pckh"]["mean"] == pytest.approx(75.0)
    # A stricter threshold can never score higher on any column.
    for key in report["pckh"]:
        assert report["pckh@0.1"][key] <= report["pckh"][key]


def test_pckh_perfect_and_unseen_group():
    _, gt, vis, boxes = _case()
    vis[:, [0, 5]] = False  # no ankle visible anywhere
    got = pckh(gt.copy(), gt, vis, boxes)
    assert math.isnan(got["ankle"])
    assert all(got[k] == 100.0 for k in got if k != "ankle")


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda p, g, v, b: (p[:, :15], g, v, b), "pred shape"),
        (lambda p, g, v, b: (p, g, v[:2], b), "visible must have shape"),
        (lambda p, g, v, b: (p, g, v, b[:, 0]), "headboxes must have shape"),
        (lambda p, g, v, b: (p[:0], g[:0], v[:0], b[:0]), "at least one person"),
        (lambda p, g, v, b: (p, g, v, np.concatenate([b[:2], b[2:, :1].repeat(2, 1)])), "zero size"),
        (lambda p, g, v, b: (p, g, np.zeros_like(v), b), "no visible joint"),
    ],
)
def test_pckh_validation(mutate, message):
    with pytest.raises(ValueError, match=message):
        pckh(*mutate(*_case()))


def test_pckh_table_lists_paper_columns():
    pred, gt, vis, boxes = _case()
    table = pckh_table({"fpdp": pckh(pred, gt, vis, boxes), "raw": pckh(gt, gt, vis, boxes)})
    lines = table.splitlines()
    assert lines[0].split() == ["Method", "Head", "Shoulder", "Elbow", "Wrist", "Hip", "Knee", "Ankle", "Mean"]
    assert lines[2].split()[0] == "fpdp" and lines[2].split()[-1] == "75.00"
    assert lines[3].split()[1:] == ["100.00"] * 8
    with pytest.raises(ValueError, match="lacks keys"):
        pckh_table({"broken": {"head": 1.0}})


# ----------------------------------------------------------------------------- OKS AP

needs_coco = pytest.mark.skipif(not COCO_JSON.is_file(), reason=f"COCO fixture missing: {COCO_JSON}")


@needs_coco
def test_oks_ap_ground_truth_is_perfect(capsys):
    dets = gt_as_detections(COCO_JSON)
    assert len(dets) == 12  # 14 annotations, 2 without keypoints
    before = copy.deepcopy(dets)
    result = oks_ap(COCO_JSON, dets)
    assert set(result) == {"AP", "AP50", "AP75", "APm", "APl", "AR"}
    assert result["AP"] == pytest.approx(1.0)
    assert result["AP50"] == pytest.approx(1.0)
    assert result["AR"] == pytest.approx(1.0)
    assert dets == before, "oks_ap must not modify the caller's detections"
    assert capsys.readouterr().out == "", "COCOeval output must go to the log, not stdout"


@needs_coco
def test_oks_ap_perturbed_is_worse():
    rng = np.random.default_rng(0)
    dets = gt_as_detections(COCO_JSON)
    for det in dets:
        k = np.asarray(det["keypoints"], dtype=float).reshape(-1, 3)
        labelled = k[:, 2] > 0
        k[labelled, :2] += rng.normal(0, 8.0, size=(int(labelled.sum()), 2))
        det["keypoints"] = k.ravel().tolist()
    result = oks_ap(COCO_JSON, dets)
    assert result["AP"] < 0.99
    assert 0.0 <= result["AP"] <= 1.0


@needs_coco
def test_oks_ap_validation():
    with pytest.raises(ValueError, match="empty"):
        oks_ap(COCO_JSON, [])
    det = gt_as_detections(COCO_JSON)[0]
    with pytest.raises(ValueError, match="image_id"):
        oks_ap(COCO_JSON, [dict(det, image_id=-5)])
    with pytest.raises(ValueError, match="keypoint values"):
        oks_ap(COCO_JSON, [dict(det, keypoints=det["keypoints"][:-3])])
