"""Issue #15, CLI: the project's errors are one line (`fedpose <command>: error: ...`), exit non-zero,
no traceback; `eval --predictions` writes the annotations' 1-based convention."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fedpose.cli.main import main


def _one_line_error(capsys: pytest.CaptureFixture[str], code: int, *needles: str) -> str:
    captured = capsys.readouterr()
    assert code != 0
    assert "Traceback" not in captured.err
    lines = [line for line in captured.err.splitlines() if "error:" in line]
    assert len(lines) == 1, captured.err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("kind", ["file", "dir"])
def test_data_synth_onto_existing_path_is_a_one_line_error(tmp_path: Path, capsys, kind: str) -> None:
    target = tmp_path / "w"
    if kind == "file":
        target.write_text("x")
    else:
        target.mkdir()
        (target / "keep.txt").write_text("x")
    code = main(["data", "synth", "--out", str(target), "--sites", "1", "--per-site", "1", "--public", "1",
                 "--val", "1", "--quiet"])
    _one_line_error(capsys, code, "fedpose data", str(target))


def test_eval_with_broken_checkpoint_is_a_one_line_error(tmp_path: Path, capsys) -> None:
    split = tmp_path / "val"
    (split / "images").mkdir(parents=True)
    (split / "annotations.json").write_text("[]")
    ckpt = tmp_path / "model.pt"
    ckpt.write_bytes(b"not a checkpoint")
    code = main(["eval", "--checkpoint", str(ckpt), "--data", str(split), "--quiet"])
    _one_line_error(capsys, code, "fedpose eval", "model.pt")


def test_non_utf8_config_is_a_one_line_error(tmp_path: Path, capsys) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_bytes(b"train:\n  lr: \xff\n")
    code = main(["train", "--config", str(cfg), "--method", "dpsgd", "--out", str(tmp_path / "o"), "--quiet"])
    _one_line_error(capsys, code, "c.yaml")


def test_predictions_use_the_annotations_one_based_convention(tmp_path: Path) -> None:
    from fedpose.shared.data.mpii import MATLAB_OFFSET, load_mpii, prediction_rows

    images = tmp_path / "images"
    (images / "sub").mkdir(parents=True)
    from PIL import Image

    Image.fromarray(np.zeros((30, 40, 3), np.uint8)).save(images / "sub" / "a.png")
    joints = [[10.0 + i, 5.0 + i] for i in range(16)]
    ann = tmp_path / "annotations.json"
    ann.write_text(json.dumps([{"image": "sub/a.png", "center": [20, 15], "scale": 0.2, "joints": joints,
                                "joints_vis": [1] * 16}]))
    records = load_mpii(ann, images)
    rows = prediction_rows(records, np.stack([r.joints for r in records]), np.ones((1, 16)), images)
    assert rows[0]["image"] == "sub/a.png"
    # The stored 0-based record joints come back as the file's 1-based numbers.
    assert np.allclose(rows[0]["joints"], joints)
    assert MATLAB_OFFSET == 1.0
