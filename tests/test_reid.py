"""Re-identification of pixelized frames: the sweep runs, writes its files, and noise hurts re-ID."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedpose.shared.experiments.reid import ReidSpec, person_crop, run_reid
from fedpose.shared.data.synth.ward import WardSpec, generate_ward


@pytest.fixture(scope="module")
def ward(tmp_path_factory):
    root = tmp_path_factory.mktemp("reid") / "ward"
    generate_ward(root, WardSpec(sites=1, per_site=48, public=2, val=2, seed=4, image_size=128,
                                 images_per_identity=8), progress=False)
    return root


def test_person_crop_shape_and_range():
    frame = np.full((64, 64), 255, np.uint8)
    crop = person_crop(frame, np.array([32.0, 32.0]), 0.2)
    assert crop.shape == (1, 64, 64) and crop.dtype == np.float32 and crop.max() == pytest.approx(1.0)
    assert person_crop(np.zeros((64, 64, 3), np.uint8), np.array([32.0, 32.0]), 0.2).shape == (3, 64, 64)


@pytest.mark.slow
def test_reid_sweep_end_to_end(ward, tmp_path):
    spec = ReidSpec(epsilons=(0.1, 5.0), cells=(8,), n=2, steps=200, train_per_identity=5, seed=0)
    res = run_reid(ward, "site-0", spec, tmp_path, progress=False)
    assert res["identities"] == 6 and res["query_frames"] == 18 and res["chance"] == pytest.approx(1 / 6)
    assert len(res["pixelized"]) == 4 and {r["mode"] for r in res["pixelized"]} == {"uniform", "adaptive"}
    assert all(0.0 <= r["top1"] <= 1.0 for r in res["pixelized"])
    # the attacker recognises these people on clean frames better than chance (5 shots each, CI-sized)
    assert res["clean"] > res["chance"]
    saved = json.loads((tmp_path / "reid.json").read_text())
    assert saved["clean"] == res["clean"] and "F x eps" in saved["claim"]
    assert [r["b"] for r in saved["plain_pixelization"]] == [8]
    assert (tmp_path / "reid.png").stat().st_size > 1000


def test_bad_sweeps_are_refused():
    with pytest.raises(ValueError, match="multiple"):
        ReidSpec(cells=(10,), n=4)
    with pytest.raises(ValueError, match="epsilons"):
        ReidSpec(epsilons=(0.0,))


@pytest.mark.slow
def test_cli_attack_reid(ward, tmp_path, capsys):
    from fedpose.cli.main import main

    code = main(["attack", "reid", "--data", str(ward), "--epsilons", "1", "--cells", "16", "--steps", "20",
                 "--gray", "--out", str(tmp_path), "--quiet"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "clean" in printed and "DP pixelization b=16" in printed and "claim:" in printed
    assert (tmp_path / "reid.json").is_file() and (tmp_path / "reid.png").is_file()
    assert main(["attack", "reid", "--data", str(ward), "--cells", "10", "--n", "4"]) == 3
    assert "multiple" in capsys.readouterr().err
