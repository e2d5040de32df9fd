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
RUFF_PATHS = ("shared", "client", "server", "edge", "cli", "configs", "tools", "benchmarks", "tests")
# Packages mypy checks (a gradual start: [tool.mypy] in pyproject.toml).
MYPY_PATHS = ("shared/privacy", "client", "server")


def _run(tool: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    if importlib.util.find_spec(tool) is None:
        pytest.skip(f"{tool} is not installed (pip install -c constraints.txt -e '.[test]')")
    return subprocess.run([sys.executable, "-m", tool, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def test_ruff_finds_nothing():
    done = _run("ruff", "check", "--no-cache", *RUFF_PATHS, timeout=300)
    assert done.returncode == 0, f"ruff check {' '.join(RUFF_PATHS)}:\n{done.stdout}{done.stderr}"


def test_mypy_finds_nothing():
    done = _run("mypy", *MYPY_PATHS, timeout=900)
    assert done.returncode == 0, f"mypy {' '.join(MYPY_PATHS)}:\n{done.stdout}{done.stderr}"
