"""What a kit's holder installs fedpose from: the wheel and the lock (``constraints.txt``).

``fedpose provision`` puts both in every kit, so a kit's first step runs as written:
``pip install -c constraints.txt './fedpose-<version>-py3-none-any.whl[train]'``. Given ``--wheel`` and
``--constraints`` (the release's files, from which the operator installed), it copies them; run from a source
checkout it builds the wheel from it (``pip wheel --no-deps``, offline: the build backend is the installed
setuptools) and takes the checkout's ``constraints.txt``.
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

DISTRIBUTION = "fedpose"
# Top-level folders of a checkout that a wheel never holds (copied around the build, they only cost time).
NOT_BUILT = {"runs", "data", "build", "site", "docs", "tests", "benchmarks", "tools"}


def source_root() -> Path | None:
    """The source checkout fedpose runs from (its pyproject.toml names the distribution), or None when installed."""
    root = Path(__file__).resolve().parents[2]  # server/kits/wheel.py -> the checkout
    project = root / "pyproject.toml"
    if project.is_file() and re.search(rf'^name = "{DISTRIBUTION}"$', project.read_text(), re.M):
        return root
    return None


@functools.lru_cache(maxsize=1)
def build_wheel() -> Path:
    """The wheel of the checkout fedpose runs from, built once per process into a temporary folder."""
    root = source_root()
    if root is None:
        raise ValueError("fedpose runs from an installed package, not a source checkout: give --wheel the fedpose "
                         "wheel you installed (fedpose-<version>-py3-none-any.whl) and --constraints its "
                         "constraints.txt")
    tmp = Path(tempfile.mkdtemp(prefix="fedpose-wheel-"))
    src = tmp / "src"  # pip builds inside the source folder: a copy, so the checkout gets no build/ folder
    shutil.copytree(root, src, ignore=lambda folder, names: [
        n for n in names if n.startswith(".") or n == "__pycache__" or n.endswith(".egg-info")
        or (Path(folder) == root and n in NOT_BUILT)])
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                           str(tmp / "dist"), str(src)], capture_output=True, text=True, timeout=600)
    shutil.rmtree(src, ignore_errors=True)
    wheels = sorted((tmp / "dist").glob(f"{DISTRIBUTION}-*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        tail = " ".join((done.stdout + done.stderr).split())[-600:]
        raise RuntimeError(f"building the fedpose wheel from {root} failed ({tail}): build it with `pip wheel "
                           "--no-deps .` there and give it with --wheel")
    return wheels[0]


def kit_install_files(wheel: str | None, constraints: str | None) -> tuple[Path, Path]:
    """(wheel, constraints.txt) to put in the kits: the ones given, else the checkout's."""
    if wheel is None:
        found = build_wheel()
    else:
        found = Path(wheel).expanduser().resolve()
        if not found.is_file() or not re.fullmatch(rf"{DISTRIBUTION}-[^-]+-py3-none-any\.whl", found.name):
            raise ValueError(f"--wheel {wheel}: not a fedpose wheel file (fedpose-<version>-py3-none-any.whl)")
    if constraints is None:
        root = source_root()
        if root is None or not (root / "constraints.txt").is_file():
            raise ValueError("give --constraints the constraints.txt of the fedpose release you install (fedpose "
                             "does not run from a checkout that holds one)")
        lock = root / "constraints.txt"
    else:
        lock = Path(constraints).expanduser().resolve()
        if not lock.is_file():
            raise FileNotFoundError(f"--constraints {constraints}: no such file")
    return found, lock
