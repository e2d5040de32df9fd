"""A camera's install: ``pip install 'fedpose[edge]'`` brings numpy, OpenCV and onnxruntime, not torch or Flower,
and the camera commands (``edge run``, ``edge pixelize``, ``edge restore``, ``edge demo-video``) work there.

A fresh virtual environment is made with the lock's versions (``-c constraints.txt``) and fedpose installed
from this checkout as a wheel, the way a camera installs a release. The ONNX model comes from the training
environment this test runs in (a camera receives it the same way); everything after that runs in the slim
environment, and each command's own process is checked to have imported neither torch nor flwr.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import venv
from pathlib import Path

import numpy as np
import pytest

from support.federation import REPO

pytestmark = pytest.mark.slow

# Runs one fedpose command in-process and fails if it pulled in the training stack.
RUN = """
import sys
from fedpose.cli.main import main
code = main(sys.argv[1:])
heavy = sorted(m for m in ("torch", "flwr", "ray", "opacus", "scipy", "onnx") if m in sys.modules)
print("HEAVY=" + ",".join(heavy))
sys.exit(code)
"""


@pytest.fixture(scope="module")
def slim(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("edge-venv")
    # The sources as a release holds them (pip builds in the source folder: not in this checkout).
    source = root / "fedpose"
    top = {"runs", "data", "build", "site", "benchmarks", "docs", "tests"}
    shutil.copytree(REPO, source, ignore=lambda folder, names: [
        n for n in names if n.startswith(".") or n == "__pycache__" or n.endswith(".egg-info")
        or (Path(folder) == REPO and n in top)])
    venv.create(root / "venv", with_pip=True)
    python = root / "venv" / "bin" / "python"
    done = subprocess.run([str(python), "-m", "pip", "install", "-q", "-c", str(REPO / "constraints.txt"),
                           f"{source}[edge]"], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return python


def _fedpose(python: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    # Outside the checkout, so the installed wheel is what runs (not the source tree on sys.path).
    done = subprocess.run([str(python), "-c", RUN, *args], cwd=cwd, capture_output=True, text=True, timeout=600,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert "HEAVY=\n" in done.stdout, f"fedpose {' '.join(args)} imported {done.stdout.split('HEAVY=')[-1]}"
    return done


def test_the_edge_extra_installs_no_training_stack(slim):
    listed = subprocess.run([str(slim), "-m", "pip", "list", "--format", "json"], capture_output=True, text=True,
                            check=True)
    names = {p["name"].lower() for p in json.loads(listed.stdout)}
    assert {"onnxruntime", "opencv-python-headless", "numpy", "fedpose"} <= names
    assert not names & {"torch", "flwr", "ray", "opacus", "onnxruntime-gpu", "scipy", "matplotlib"}, names
    where = subprocess.run([str(slim), "-c", "import fedpose.cli as cli; print(cli.__file__)"], cwd=slim.parent,
                           capture_output=True, text=True, check=True).stdout
    assert "site-packages" in where  # the installed wheel, not this checkout
    # one import root: nothing of ours beside fedpose/ in site-packages (another distribution's server/ or
    # shared/ would overwrite ours, and a user's own folder of that name would shadow it)
    files = subprocess.run([str(slim), "-m", "pip", "show", "--files", "fedpose"], capture_output=True, text=True,
                           check=True).stdout.split("Files:", 1)[1].split()
    tops = {f.split("/")[0] for f in files if not f.startswith("..")}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"fedpose"}, sorted(tops)


def test_camera_commands_run_without_torch(slim, tmp_path):
    import cv2
    import torch

    from fedpose.edge.export.exporter import export_onnx
    from fedpose.edge.export.spec import ExportOptions
    from fedpose.shared.configuration.schema import ModelConfig
    from fedpose.shared.model.posenet import build_model

    torch.manual_seed(0)
    model = build_model(ModelConfig(variant="tinyvit-small"), (64, 48)).eval()
    export_onnx(model, tmp_path / "model.onnx", ExportOptions(batch=1))  # made where torch is, as a camera receives it

    clip = tmp_path / "demo.mp4"
    done = _fedpose(slim, "edge", "demo-video", "--out", str(clip), "--frames", "16", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    done = _fedpose(slim, "edge", "run", "--model", str(tmp_path / "model.onnx"), "--source", str(clip), "--out",
                    str(tmp_path / "run"), "--video", "--pixelize", "eps=1,b=16,m=16,n=4", "--seed", "0", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = (tmp_path / "run" / "keypoints.jsonl").read_text().splitlines()
    assert len(lines) == 16 and len(json.loads(lines[0])["keypoints"]) == 16
    frames = sorted((tmp_path / "run" / "pixelized").glob("*.npz"))
    assert len(frames) == 16 and (tmp_path / "run" / "annotated.mp4").is_file()
    assert "Released by this run" in done.stdout  # the claim is printed
    # the demo clip has its ground truth beside it: the run scores itself, printed and in summary.json
    assert "accuracy vs ground truth" in done.stdout and "PCK@0.2" in done.stdout
    accuracy = json.loads((tmp_path / "run" / "summary.json").read_text())["accuracy"]
    assert 0.0 <= accuracy["pck@0.2"] <= 1.0

    restored = tmp_path / "restored.png"
    done = _fedpose(slim, "edge", "restore", "--in", str(frames[0]), "--out", str(restored), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert cv2.imread(str(restored)).shape[:2] == (240, 320)

    image = tmp_path / "frame.png"
    cv2.imwrite(str(image), np.full((96, 128, 3), 128, np.uint8))
    done = _fedpose(slim, "edge", "pixelize", "--in", str(image), "--eps", "1", "--b", "16", "--m", "16", "--out",
                    str(tmp_path / "pix.png"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "pix.png").is_file()

    # A training command says which extra it needs, in one line, instead of a traceback.
    done = _fedpose(slim, "train", "--out", str(tmp_path / "t"), cwd=tmp_path)
    assert done.returncode == 3 and "fedpose[train]" in done.stderr and "Traceback" not in done.stderr


def test_engine_build_needs_neither_onnx_nor_torch(slim, tmp_path):
    """docs/how-to/jetson.md builds the engine in the camera install: `edge build` reads the ONNX file's input
    (name, batch, size, FP16, Q/DQ) with the edge extra alone, prints the trtexec lines and stops only at the
    missing TensorRT, with its install hint (never asking for the train extra or `onnx`)."""
    import torch

    from fedpose.edge.export.exporter import export_onnx
    from fedpose.edge.export.spec import ExportOptions
    from fedpose.shared.configuration.schema import ModelConfig
    from fedpose.shared.model.posenet import build_model

    torch.manual_seed(0)
    model = build_model(ModelConfig(variant="tinyvit-small"), (64, 48)).eval()
    fixed = export_onnx(model, tmp_path / "model.onnx", ExportOptions(batch=1)).path
    dynamic = export_onnx(model, tmp_path / "dynamic.onnx", ExportOptions(batch="dynamic")).path
    assert "onnx" not in subprocess.run([str(slim), "-m", "pip", "list"], capture_output=True, text=True,
                                        check=True).stdout.lower().split()  # the camera has no onnx package

    done = _fedpose(slim, "edge", "build", "--onnx", str(dynamic), "--out", str(tmp_path / "m.plan"), "--batch",
                    "1,2,4", cwd=tmp_path)
    assert "'onnx'" not in done.stderr and "fedpose[train]" not in done.stderr, done.stderr
    assert "--minShapes=image:1x3x64x48" in done.stdout and "--maxShapes=image:4x3x64x48" in done.stdout, done.stdout
    assert "--fp16" in done.stdout  # TensorRT 10.x line
    assert done.returncode != 0 and "TensorRT is not installed" in done.stderr, done.stderr  # no tensorrt here
    assert not (tmp_path / "m.plan").exists()

    # The checks that read the graph run too: a fixed batch refuses a profile, FP32 refuses INT8.
    done = _fedpose(slim, "edge", "build", "--onnx", str(fixed), "--out", str(tmp_path / "m.plan"), "--precision",
                    "int8", cwd=tmp_path)
    assert done.returncode != 0 and "no QuantizeLinear/DequantizeLinear nodes" in done.stderr, done.stderr
    done = _fedpose(slim, "edge", "build", "--onnx", str(fixed), "--out", str(tmp_path / "m.plan"), "--batch", "1,2,4",
                    cwd=tmp_path)
    assert done.returncode != 0 and "fixed batch of 1" in done.stderr, done.stderr
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\x00not a protobuf" * 10)
    done = _fedpose(slim, "edge", "build", "--onnx", str(garbage), "--out", str(tmp_path / "m.plan"), cwd=tmp_path)
    assert done.returncode != 0 and "garbage.onnx is not a readable ONNX file" in done.stderr, done.stderr
