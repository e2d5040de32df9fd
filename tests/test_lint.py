"""Style and types in CI: ruff over the code folders, mypy over the typed packages (settings in pyproject.toml).

To check more of the tree, add its folder to RUFF_PATHS or MYPY_PATHS (and fix what the tool then finds).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Folders ruff checks (every rule selected in [tool.ruff.lint]).
RUFF_PATHS = ("fedpose", "shared", "client", "server", "edge", "cli", "configs", "tools", "benchmarks", "tests")
# Packages mypy checks (a gradual start: [tool.mypy] in pyproject.toml), as folders of the repository.
MYPY_PATHS = ("shared/privacy", "client", "server")
ROOT_PACKAGE = "fedpose"  # fedpose/<folder> is a link to each top-level folder: mypy resolves imports by path


def _run(tool: str, *args: str, timeout: float, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    if importlib.util.find_spec(tool) is None:
        pytest.skip(f"{tool} is not installed (pip install -c constraints.txt -e '.[test]')")
    return subprocess.run([sys.executable, "-m", tool, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def test_ruff_finds_nothing():
    done = _run("ruff", "check", "--no-cache", *RUFF_PATHS, timeout=300)
    assert done.returncode == 0, f"ruff check {' '.join(RUFF_PATHS)}:\n{done.stdout}{done.stderr}"


def test_mypy_finds_nothing(tmp_path):
    packages = [f"{ROOT_PACKAGE}.{path.replace('/', '.')}" for path in MYPY_PATHS]
    args = [x for p in packages for x in ("-p", p)]
    done = _run("mypy", "--config-file", str(REPO / "pyproject.toml"), "--cache-dir", str(tmp_path / "cache"), *args,
                timeout=900)
    assert done.returncode == 0, f"mypy {' '.join(args)}:\n{done.stdout}{done.stderr}"
