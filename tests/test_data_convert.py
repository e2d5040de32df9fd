"""Real data to fedpose's layout: ``fedpose data convert`` on the real MPII and COCO fixtures, ``data split``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fedpose.cli.main import main
from fedpose.shared.data.mpii import load_mpii, load_split

FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures"


def _fixture(sub: str) -> Path:
    path = FIXTURES / sub
    if not path.is_dir():
        pytest.skip(f"real-format fixtures not found at {path} (the shared/ directory beside the checkout)")
    return path


def test_mpii_json_converts_to_a_split_that_reads_back_the_same_people(tmp_path):
    mpii = _fixture("mpii")
    out = tmp_path / "mpii" / "train"
    assert main(["data", "convert", "--format", "mpii-json", "--annotations", str(mpii / "test_mpii.json"),
                 "--images", str(mpii), "--out", str(out), "--quiet"]) == 0
    before = load_mpii(mpii / "test_mpii.json", mpii)
    after = load_split(out.parent, "train")
    assert len(after) == len(before) > 0
    for a, b in zip(before, after):
        assert a.image.name == b.image.name and b.image.stat().st_ino == a.image.stat().st_ino  # linked
        np.testing.assert_allclose(a.joints, b.joints, atol=1e-3)
        assert (a.visible == b.visible).all()
        np.testing.assert_allclose(a.center, b.center, atol=1e-3)
        assert a.scale == pytest.approx(b.scale, rel=1e-5)
    assert main(["data", "convert", "--format", "mpii-json", "--annotations", str(mpii / "test_mpii.json"),
                 "--images", str(mpii), "--out", str(out), "--quiet"]) == 3  # never over an existing split


def test_coco_keypoints_convert_to_the_16_mpii_joints(tmp_path):
    coco = _fixture("coco")
    out = tmp_path / "coco" / "public"
    assert main(["data", "convert", "--format", "coco", "--annotations", str(coco / "test_coco.json"), "--images",
                 str(coco), "--out", str(out), "--copy", "--quiet"]) == 0
    records = load_split(out.parent, "public")
    assert records and all(r.joints.shape == (16, 2) for r in records)
    assert not (out / "headboxes.json").exists()  # COCO has none: PCKh is not evaluated on it
    assert all(r.image.stat().st_nlink == 1 for r in records)  # copied


def test_split_keeps_every_image_and_every_patient_on_one_side(tmp_path, capsys):
    from support.federation import tiny_dict
    from fedpose.shared.configuration.schema import config_from_dict
    from fedpose.shared.training.runs import ensure_data

    cfg = config_from_dict(tiny_dict(tmp_path / "w"))
    root = ensure_data(cfg, progress=False)
    source = root / "site-0"  # 40 records of 5 people (identities.json: patient ids)
    assert main(["data", "split", "--in", str(source), "--out", str(tmp_path / "cut"), "--sites", "2", "--public",
                 "0.2", "--val", "0.2", "--json", "--quiet"]) == 0
    counts = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert sum(counts.values()) == 40
    owners: dict[str, str] = {}
    for split in counts:
        for record in load_split(tmp_path / "cut", split):
            assert owners.setdefault(record.patient, split) == split  # a patient on one side only
    assert len(set(owners.values())) == len(counts) == 4
    assert main(["data", "split", "--in", str(source), "--out", str(tmp_path / "cut2"), "--sites", "9", "--public",
                 "0.2", "--val", "0.2", "--quiet"]) == 3  # too few patients, one line


def test_the_papers_config_names_what_to_download_when_the_data_is_absent(tmp_path, monkeypatch, capsys):
    """configs/paper.yaml is the real setting; without MPII and COCO it fails in one line saying what to get, and a
    mistyped --data is never filled with synthetic data."""
    monkeypatch.chdir(tmp_path)
    assert main(["pretrain", "--config", "paper", "--quiet"]) == 3
    err = capsys.readouterr().err
    assert "no such directory: data/mpii" in err and "fedpose data convert --format mpii-json" in err
    assert main(["train", "--config", "default", "--data", str(tmp_path / "typo"), "--out", str(tmp_path / "o"),
                 "--quiet"]) == 3
    assert "no such directory" in capsys.readouterr().err
    assert not (tmp_path / "typo").exists()  # before: a synthetic ward was generated there and trained on


def test_convert_says_loudly_when_the_split_it_wrote_has_no_head_boxes(tmp_path, capsys):
    """A split without head boxes cannot be the validation split (PCKh needs them): convert says so when it writes
    one, naming the flag that adds them, not the training run after its pretraining."""
    mpii = _fixture("mpii")
    out = tmp_path / "mpii" / "val"
    assert main(["data", "convert", "--format", "mpii-json", "--annotations", str(mpii / "test_mpii.json"),
                 "--images", str(mpii), "--out", str(out), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert not (out / "headboxes.json").exists()
    assert "warning" in err.lower() and "no head boxes" in err and "data.val_split" in err and "--headboxes" in err, err


def test_a_validation_split_without_head_boxes_is_refused_before_pretraining(tmp_path, capsys):
    """Training checks the validation split at its start, in one line naming the split and the fix; nothing is
    pretrained first."""
    import shutil

    import yaml

    from support.federation import tiny_dict
    from fedpose.shared.configuration.schema import config_from_dict
    from fedpose.shared.training.runs import ensure_data

    data = tiny_dict(tmp_path / "w")
    root = ensure_data(config_from_dict(data), progress=False)
    files = tmp_path / "files"
    shutil.copytree(root, files)
    (files / "val" / "headboxes.json").unlink()
    data["data"].update({"source": "files", "root": str(files)})
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(data))
    assert main(["train", "--config", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "o"), "--quiet"]) == 3
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "data.val_split 'val'" in err and "head boxes" in err and "--headboxes" in err, err
    assert not (tmp_path / "w" / "pretrained" / "model.pt").exists()  # refused before pretraining
