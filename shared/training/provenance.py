"""Where a number came from: the software, the machine and the numeric settings a run used.

Every metrics.json carries ``provenance()``: a result is only reproducible when the package
versions (the synthetic ward is drawn with OpenCV, so even the data depends on them), the
intra-op thread count (float reductions are summed in another order with another count) and
the determinism settings are the same. ``configure_numerics`` is what fixes the last two.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

# The packages whose versions change the numbers (data drawing, maths, the federation runtime).
PACKAGES = ("torch", "numpy", "opencv-python-headless", "pillow", "scipy", "opacus", "flwr", "ray", "onnxruntime",
            "onnx", "pycocotools")

REPO = Path(__file__).resolve().parents[1]
# Where no git repository holds this copy (a wheel installed on a GPU machine), the commit it was built from
SOURCE_COMMIT = "FEDPOSE_SOURCE_COMMIT"


def configure_numerics(threads: int, *, deterministic: bool = True) -> None:
    """Fix the intra-op CPU thread count and ask torch for deterministic kernels.

    The thread count is part of the numerics: a CPU matmul or convolution sums its blocks in
    another order with another count, and a training run amplifies the last-bit differences.
    With a fixed count the same seed gives the same numbers on every machine of a kind. On
    CUDA, ``CUBLAS_WORKSPACE_CONFIG`` makes cuBLAS deterministic; kernels that have no
    deterministic version only warn (``warn_only``) and are named in the log.
    """
    import torch

    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads={threads!r} must be an int >= 1")
    torch.set_num_threads(threads)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _git() -> dict[str, Any]:
    def run(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = run("rev-parse", "HEAD")
    if commit is None and os.environ.get(SOURCE_COMMIT):
        # an installed copy (a wheel, on a machine without the repository): the commit it was built from, as its
        # builder says; whether that tree had local changes is unknown
        given = os.environ[SOURCE_COMMIT].strip().lower()
        if not (7 <= len(given) <= 40 and all(c in "0123456789abcdef" for c in given)):
            raise ValueError(f"{SOURCE_COMMIT}={os.environ[SOURCE_COMMIT]!r} is not a git commit (7 to 40 hex digits)")
        return {"commit": given, "dirty": None, "commit_source": SOURCE_COMMIT}
    status = run("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def provenance(**extra: Any) -> dict[str, Any]:
    """The versions, machine, numeric settings and commit of this process; ``extra`` (e.g. the command) added."""
    import torch

    device = None
    if torch.cuda.is_available():
        device = torch.cuda.get_device_name(0)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **_git(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        # The CPU and the instruction set torch dispatches to (AVX2, AVX512): kernels for another one sum in
        # another order, so the same seed can train to other weights on another kind of CPU.
        "cpu": _cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "gpu": device,
        "threads": torch.get_num_threads(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "versions": _versions(),
        **extra,
    }
