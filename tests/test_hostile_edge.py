"""Issue #15, edge and checkpoint boundaries: NPZ restore with declared sizes checked before any
allocation, pixelize/ROI/threads options, checkpoint dimensions and contents."""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from fedpose.edge.pipeline.options import parse_pixelize
from fedpose.edge.pipeline.tracking import parse_roi
from fedpose.shared.pixelization.spec import PixelizeSpec
from fedpose.shared.pixelization.storage import load_npz, restore, save_npz
from fedpose.shared.pixelization.mechanism import pixelize

ROOT = Path(__file__).resolve().parents[1]


def _bounded(code: str, *, mem_mb: int = 1500, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter with its address space capped (a bomb dies, not the runner)."""
    prelude = (
        "import resource\n"
        f"resource.setrlimit(resource.RLIMIT_AS, ({mem_mb} << 20, {mem_mb} << 20))\n"
    )
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def _npz(path: Path, **arrays: np.ndarray) -> Path:
    with open(path, "wb") as f:
        np.savez_compressed(f, **arrays)
    return path


def _frame_fields(**over: object) -> dict[str, np.ndarray]:
    fields = dict(simple_means=np.zeros((1, 1), np.float32), complex_means=np.zeros((0, 1, 1, 1), np.float32),
                  cell_mask=np.zeros((1, 1), bool), b=np.int64(8), s_b=np.int64(8), height=np.int64(8),
                  width=np.int64(8), channels=np.int64(1))
    fields.update({k: np.asarray(v) for k, v in over.items()})
    return fields


# --------------------------------------------------------------------------- item 8: NPZ restore


def test_declared_huge_frame_refused_before_allocation(tmp_path: Path) -> None:
    path = _npz(tmp_path / "big.npz", **_frame_fields(b=200000, s_b=200000, height=200000, width=200000))
    assert path.stat().st_size < 4096
    result = _bounded(f"""
        from fedpose.shared.pixelization.storage import restore
        try:
            restore({str(path)!r})
        except ValueError as err:
            print("VALUEERROR", err)
    """)
    assert "VALUEERROR" in result.stdout and "too large" in result.stdout, result.stdout + result.stderr[-2000:]


def _zip_bomb(path: Path, side: int) -> Path:
    """An NPZ whose cell_mask member declares (side, side) bool and really holds it (zeros compress well)."""
    fields = _frame_fields(height=1000, width=1000, b=1000, s_b=1000)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, arr in fields.items():
            if name == "cell_mask":
                continue
            buf = io.BytesIO()
            np.lib.format.write_array(buf, arr)
            zf.writestr(name + ".npy", buf.getvalue())
        with zf.open("cell_mask.npy", "w", force_zip64=True) as member:
            np.lib.format.write_array_header_1_0(
                member, {"descr": "|b1", "fortran_order": False, "shape": (side, side)})
            chunk = bytes(1 << 22)
            left = side * side
            while left:
                member.write(chunk[: min(left, len(chunk))])
                left -= min(left, len(chunk))
    return path


def test_zip_bomb_mask_refused_from_its_header(tmp_path: Path) -> None:
    path = _zip_bomb(tmp_path / "bomb.npz", 30000)  # 900 MB of mask in ~1 MB
    assert path.stat().st_size < 2_000_000
    result = _bounded(f"""
        from fedpose.shared.pixelization.storage import restore
        try:
            restore({str(path)!r})
        except ValueError as err:
            print("VALUEERROR", err)
    """, mem_mb=1000)
    assert "VALUEERROR" in result.stdout and "cell_mask" in result.stdout, result.stdout + result.stderr[-2000:]


@pytest.mark.parametrize("content", [b"", b"hello, this is text\n", b"PK\x03\x04broken"])
def test_text_empty_or_broken_npz_is_a_value_error(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "f.npz"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="f.npz"):
        restore(path)


def test_wrong_dtype_member_refused(tmp_path: Path) -> None:
    path = _npz(tmp_path / "f.npz", **_frame_fields(simple_means=np.array([["x"]])))
    with pytest.raises(ValueError, match="simple_means"):
        load_npz(path)


def test_valid_npz_still_restores(tmp_path: Path) -> None:
    img = np.random.default_rng(0).integers(0, 256, size=(30, 41, 3), dtype=np.uint8)
    frame = pixelize(img, PixelizeSpec(eps=1.0, b=8, m=4), rng=np.random.default_rng(1))
    save_npz(frame, tmp_path / "ok.npz")
    assert np.array_equal(restore(tmp_path / "ok.npz"), frame.render())


# --------------------------------------------------------------------------- item 9/10: pixelize, ROI


def test_cell_larger_than_the_frame_refused() -> None:
    img = np.zeros((20, 30), np.uint8)
    with pytest.raises(ValueError, match="b=1000.*20x30"):
        pixelize(img, PixelizeSpec(eps=1.0, b=1000, m=1), rng=np.random.default_rng(0))


def test_m_larger_than_the_frame_refused() -> None:
    with pytest.raises(ValueError, match="m"):
        pixelize(np.zeros((20, 30), np.uint8), PixelizeSpec(eps=1.0, b=4, m=10**20), rng=np.random.default_rng(0))


@pytest.mark.parametrize("text", ["eps=1,b=16,m=100000000000000000000", "eps=1,b=16,m=1e20",
                                  "eps=1e400,b=16,m=4", "eps=nan,b=16,m=4", "eps=1,b=99999999999,m=4"])
def test_absurd_pixelize_numbers_refused(text: str) -> None:
    with pytest.raises(ValueError, match="--pixelize"):
        parse_pixelize(text)


def test_duplicate_pixelize_keys_refused() -> None:
    with pytest.raises(ValueError, match="eps.*twice"):
        parse_pixelize("eps=1,b=16,m=4,eps=100")


@pytest.mark.parametrize(("text", "color"), [("color=off", False), ("color=no", False), ("color=0", False),
                                             ("color=on", True), ("color=1", True), ("color=true", True)])
def test_pixelize_color_words(text: str, color: bool) -> None:
    assert parse_pixelize("eps=1,b=16,m=4," + text)[1] is color


def test_unknown_color_word_refused() -> None:
    with pytest.raises(ValueError, match="color"):
        parse_pixelize("eps=1,b=16,m=4,color=maybe")


@pytest.mark.parametrize("text", ["1e308,0,10,10", "0,0,1e308,10", "nan,0,10,10", "0,0,inf,10"])
def test_non_finite_or_absurd_roi_refused(text: str) -> None:
    with pytest.raises(ValueError, match="--roi"):
        parse_roi(text)


def test_roi_outside_the_frame_refused() -> None:
    from fedpose.edge.pipeline.tracking import BoxTracker

    tracker = BoxTracker(parse_roi("500,500,20,20"), threshold=0.1)
    with pytest.raises(ValueError, match="--roi.*outside"):
        tracker.box((240, 320))
    with pytest.raises(ValueError, match=r"--roi 300,200,50,50 \(x,y,w,h\) reaches past the 240x320 \(HxW\) frame"):
        BoxTracker(parse_roi("300,200,50,50"), threshold=0.1).box((240, 320))  # partly outside: issue 42, item 8
    assert BoxTracker(parse_roi("300,200,20,40"), threshold=0.1).box((240, 320))[1] == "roi"


def test_negative_threads_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fedpose.cli.main import main

    code = main(["edge", "run", "--model", str(tmp_path / "m.onnx"), "--source", "x.mp4",
                 "--out", str(tmp_path / "o"), "--threads", "-2"])
    assert code != 0
    assert "--threads" in capsys.readouterr().err


# --------------------------------------------------------------------------- item 9/11: checkpoints


def _checkpoint(tmp_path: Path, **changes: object) -> Path:
    from fedpose.shared.configuration.schema import ModelConfig
    from fedpose.shared.model.posenet import build_model, save_checkpoint

    path = tmp_path / "model.pt"
    save_checkpoint(path, build_model(ModelConfig(hidden=16, joint_channels=4), (32, 32)))
    payload = torch.load(path, weights_only=True)
    for key, value in changes.items():
        if value is None:
            payload.pop(key)
        else:
            payload[key] = value
    torch.save(payload, path)
    return path


@pytest.mark.parametrize("changes", [
    {"model_config": None},
    {"input_size": None},
    {"state_dict": None},
    {"input_size": [100000, 100000]},
    {"input_size": "big"},
    {"model_config": {"variant": "tinyvit-huge"}},
    {"model_config": {"hidden": 10**9}},
    {"model_config": "x"},
])
def test_broken_checkpoints_are_value_errors(tmp_path: Path, changes: dict) -> None:

    path = _checkpoint(tmp_path, **changes)
    result = _bounded(f"""
        from fedpose.shared.model.posenet import load_checkpoint
        try:
            load_checkpoint({str(path)!r})
        except ValueError as err:
            print("VALUEERROR", err)
    """, mem_mb=4000)
    assert "VALUEERROR" in result.stdout and "model.pt" in result.stdout, result.stdout + result.stderr[-1500:]


def test_nan_weights_refused(tmp_path: Path) -> None:
    from fedpose.shared.model.posenet import load_checkpoint

    path = _checkpoint(tmp_path)
    payload = torch.load(path, weights_only=True)
    name = next(k for k, v in payload["state_dict"].items() if v.is_floating_point())
    payload["state_dict"][name] = payload["state_dict"][name].clone().fill_(float("nan"))
    torch.save(payload, path)
    with pytest.raises(ValueError, match=f"non-finite.*{name}"):
        load_checkpoint(path)
