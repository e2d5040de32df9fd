"""``fedpose simulate`` on Flower's supported simulation path: a local SuperLink in simulation mode and ``flwr run``.

The SuperLink runs as a child of this command, on free ports of 127.0.0.1 with its state in the run
folder, and stops with it. The app is this fedpose (its ``fedpose.server.server_app`` and ``fedpose.client.client_app``,
exactly the deployment's); each simulated site is a Flower node with a ``partition-id``, so it takes the
site policy ``fedpose simulate`` wrote for it. Ray gives each site one CPU and, when CUDA is present, an
equal share of the GPUs; every site prints the device it trains on.

This is the runtime: it names the apps by their entry points and imports neither side.
``fedpose.cli.local_federation`` composes a simulation from it, the server's paths and the sites' own
policies and checks (only the CLI imports both sides).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from fedpose.shared.errors import ConfigError

# Every Flower process we start runs offline, installs nothing and keeps Ray on loopback.
FLOWER_ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",  # Ray leaves CUDA_VISIBLE_DEVICES alone for a site with no GPU share
    # Ray prints every site's line as it was written: its deduplication would fold the rounds' lines of the sites
    # into "[repeated Nx across cluster]" markers, seconds later.
    "RAY_DEDUP_LOGS": "0",
}

def check_simulation_sites(cfg: Any) -> None:
    """A simulated federation has one site per ``data.train_splits`` entry: ``min_sites`` must fit.

    (Not a Config rule: a centralized run with one split keeps the default
    ``min_sites``, and a deployment's sites are its SuperNodes, not splits.)
    """
    if cfg.federation.min_sites > len(cfg.data.train_splits):
        raise ConfigError(
            f"federation.min_sites = {cfg.federation.min_sites} is more than the "
            f"{len(cfg.data.train_splits)} sites of data.train_splits: no round could ever be aggregated"
        )


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_RAY_REPEATED = re.compile(r"\s*\[repeated \d+x across cluster\]( \(Ray deduplicates logs by default\.[^)]*\))?")
_EMPTY = re.compile(r"^(?:\(\S+ pid=\d+\) )?(?:INFO|DEBUG)\s*:\s*$")


def clean_log_line(line: str, *, terminal: bool) -> str | None:
    """One line of Flower's run log as this command prints it: colours only on a terminal, without Ray's
    repeat markers; None for a line that says nothing (an empty INFO)."""
    plain = _ANSI.sub("", line)
    if _EMPTY.match(plain):
        return None
    if _RAY_REPEATED.search(plain):
        line, plain = _RAY_REPEATED.sub("", _ANSI.sub("", line)), _RAY_REPEATED.sub("", plain)
    return line if terminal else plain


def follow_log(cmd: list[str], env: dict[str, str], *, quiet: bool) -> None:
    """Run ``flwr log --stream`` to the run's end, printing its lines cleaned (nothing when ``quiet``)."""
    if quiet:
        subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        return
    terminal = sys.stdout.isatty()
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          errors="replace") as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            cleaned = clean_log_line(line.rstrip("\n"), terminal=terminal)
            if cleaned is not None:
                print(cleaned, flush=True)


def flower_env(flwr_home: Path) -> None:
    """Set the Flower environment of this process (before flwr or ray is imported)."""
    os.environ.update(FLOWER_ENV)
    os.environ.setdefault("FLWR_HOME", str(flwr_home))
    Path(os.environ["FLWR_HOME"]).mkdir(parents=True, exist_ok=True)


APP_PYPROJECT = """\
# The Flower app of fedpose for a local simulation: its components are fedpose's own installed modules.
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "fedpose"
version = "{version}"
dependencies = []

[tool.flwr.app]
publisher = "fedpose"

[tool.flwr.app.components]
serverapp = "fedpose.server.server_app:app"
clientapp = "fedpose.client.client_app:app"

[tool.flwr.app.config]
config = ""
overrides = ""
out = ""
resume = false
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _bin(name: str) -> str:
    path = Path(sys.executable).with_name(name)
    if not path.exists():
        found = shutil.which(name)
        if found is None:
            raise FileNotFoundError(f"{name} is not installed next to this Python: install fedpose[train] (it brings "
                                    "flwr) in this environment")
        return found
    return str(path)


def app_folder(out: Path) -> Path:
    """A minimal Flower app folder for this fedpose (only its pyproject.toml: the code is the installed fedpose)."""
    from importlib import metadata

    try:
        version = metadata.version("fedpose")
    except metadata.PackageNotFoundError:
        version = "0.0.0"
    app = out / "flwr-app"
    app.mkdir(parents=True, exist_ok=True)
    (app / "pyproject.toml").write_text(APP_PYPROJECT.format(version=version))
    return app


def gpu_share(sites: int) -> float:
    """The fraction of a GPU each simulated site gets: all GPUs shared equally (0 without CUDA)."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return 0.0 if count == 0 else min(1.0, round(count / sites, 4))


class LocalSuperLink:
    """A SuperLink in simulation mode, owned by this process (stopped with it)."""

    def __init__(self, out: Path, env: dict[str, str]) -> None:
        self.port = _free_port()  # the Runtime HTTP API: the simulation's nodes and the Control API (flwr)
        self.log = out / "superlink.log"
        self.env = env
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> LocalSuperLink:
        # Under shared.flower.processes' guard: killed with this command, even by kill -9, with the SuperExec,
        # the simulation runtime and Ray it starts (they would otherwise finish the federation on their own).
        cmd = [sys.executable, "-m", "fedpose.shared.flower.processes", "--",
               _bin("flower-superlink"), "--insecure", "--simulation", "--isolation", "subprocess",
               "--host", "127.0.0.1", "--port", str(self.port),
               "--database", str(self.log.with_name("superlink.db"))]
        self._fh = open(self.log, "ab")  # noqa: SIM115 - closed in __exit__
        self.proc = subprocess.Popen(cmd, stdout=self._fh, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the local SuperLink exited at start (code {self.proc.returncode}); see {self.log}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return self
            except OSError:
                time.sleep(0.3)
        raise RuntimeError(f"the local SuperLink did not start within 120 s; see {self.log}")

    def __exit__(self, *exc: object) -> None:
        import signal

        if self.proc is not None and self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 30)):
                try:
                    os.killpg(self.proc.pid, sig)
                    self.proc.wait(timeout=wait)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
        self._fh.close()


def run_local_simulation(out: Path, run_config: dict[str, Any], *, sites: int, quiet: bool) -> str:
    """Run the federation of ``run_config`` with ``sites`` simulated sites; returns Flower's final run status."""
    home = out / "flwr-home"
    home.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **FLOWER_ENV, "FLWR_HOME": str(home),
           # the SuperLink starts flower-superexec, and it flwr-serverapp / flwr-simulation, by name
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    gpus = gpu_share(sites)
    with LocalSuperLink(out, env) as link:
        (home / "config.toml").write_text(
            f'[superlink]\ndefault = "fedpose-sim"\n\n[superlink.fedpose-sim]\n'
            f'address = "127.0.0.1:{link.port}"\ninsecure = true\n')
        parts = [f"{k}={json.dumps(v) if isinstance(v, str) else str(v).lower()}" for k, v in run_config.items()]
        federation = (f"num_supernodes={sites} client_resources_num_cpus=1 client_resources_num_gpus={gpus} "
                      f"init_args_num_cpus={max(1, min(os.cpu_count() or 1, sites))}")
        submitted = subprocess.run([_bin("flwr"), "run", str(app_folder(out)), "fedpose-sim", "--run-config",
                                    " ".join(parts), "--federation-config", federation, "--format", "json"],
                                   env=env, capture_output=True, text=True, timeout=300)
        try:
            run_id = int(json.loads(submitted.stdout)["run-id"])
        except (ValueError, KeyError, TypeError):
            raise RuntimeError(f"the simulation was not submitted: {(submitted.stdout + submitted.stderr)[-800:]}") \
                from None
        if not quiet:
            print(f"local simulation: run {run_id}, {sites} sites" + (f", {gpus:g} GPU each" if gpus else ", CPU") +
                  f"; Flower's log below, the SuperLink's in {link.log}", flush=True)
        # Follow the run's log to its end (flwr log --stream returns when the run finishes).
        follow_log([_bin("flwr"), "log", str(run_id), "fedpose-sim", "--stream"], env, quiet=quiet)
        status = ""
        for _ in range(150):
            ls = subprocess.run([_bin("flwr"), "ls", "fedpose-sim", "--run-id", str(run_id), "--format", "json"],
                                env=env, capture_output=True, text=True, timeout=60)
            try:
                status = str(json.loads(ls.stdout)["runs"][0]["status"])
            except (ValueError, KeyError, IndexError):
                status = ""
            if status.startswith("finished"):
                break
            time.sleep(2)
        return status
