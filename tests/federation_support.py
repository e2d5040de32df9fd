"""Shared pieces of the federation tests: a tiny world, Flower's environment, process helpers.

Not a test module (no ``test_`` prefix); imported by tests/test_federation_*.py.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def tiny_dict(root: Path, *, sites: int = 2, rounds: int = 2, **sections: dict[str, Any]) -> dict[str, Any]:
    """A config small enough for a round in seconds on one CPU core (32x32 inputs, k=4, m=8)."""
    data: dict[str, Any] = {
        "data": {
            "root": str(root / "data"),
            "synth": {"sites": sites, "per_site": 40, "public": 60, "val": 30, "seed": 0, "image_size": 64},
            "train_splits": [f"site-{i}" for i in range(sites)],
            "input_size": [32, 32],
        },
        "pretrain": {"out": str(root / "pretrained"), "epochs": 1, "batch_size": 16},
        "privacy": {"epsilon": 2.0, "delta": 1.0e-3, "k": 4, "m": 8, "chunk_size": 8, "basis_every": 1},
        "train": {"method": "fpdp", "strategy": "finetune", "batch_size": 8, "public_batch_size": 4},
        "federation": {"rounds": rounds, "local_steps": 2, "min_sites": 2, "round_timeout": 240},
    }
    for name, values in sections.items():
        data[name] = {**data.get(name, {}), **values}
    return data


def tiny_config(root: Path, **kwargs: Any) -> Any:
    from shared.config import config_from_dict

    return config_from_dict(tiny_dict(root, **kwargs))


def world_root(tmp_path_factory: Any) -> Path:
    """One data + pretrained-weights cache per test session (generated once, reused by every test)."""
    return tmp_path_factory.getbasetemp() / "fedpose-world"


def prepare_world(root: Path, **kwargs: Any) -> Any:
    """Tiny config with its data generated and pretrained weights cached under ``root``."""
    from shared.runs import ensure_data, ensure_pretrained

    cfg = tiny_config(root, **kwargs)
    ensure_data(cfg, progress=False)
    ensure_pretrained(cfg, progress=False)
    return cfg


def flower_env(flwr_home: Path) -> dict[str, str]:
    """Environment for every Flower process of a test: offline, no installs, Ray on loopback."""
    env = dict(os.environ)
    env.update({
        "FLWR_HOME": str(flwr_home),
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
        # The SuperLink and SuperNodes start helpers (flower-superexec, flwr-clientapp) by name: the
        # interpreter's environment must come first on PATH even when it is not activated (CI).
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), *filter(None, [os.environ.get("PATH")])]),
    })
    flwr_home.mkdir(parents=True, exist_ok=True)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def bin_path(name: str) -> str:
    """An executable of the running interpreter's environment (flwr, flower-superlink, ...)."""
    return str(Path(sys.executable).parent / name)


def start(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    """Start a process in its own session (so it and its children can be stopped by process group)."""
    fh = open(log, "wb")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def stop(*procs: subprocess.Popen, grace: float = 5.0) -> None:
    """Stop processes we started, each with its process group: SIGTERM, then SIGKILL after ``grace`` s."""
    for proc in procs:
        if proc.poll() is None:
            _signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for proc in procs:
        _signal_group(proc, signal.SIGKILL)  # children (SuperExec, app processes) too
        proc.wait(timeout=30)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def wait_for(predicate: Any, timeout: float, what: str, poll: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)
