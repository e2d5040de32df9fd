"""Shared pieces of the federation tests: a tiny world, Flower's environment, process helpers.

Not a test module; the tests import it as ``from support.federation import ...`` (pytest puts tests/ on the
path: tests/conftest.py), and benchmarks/deploy_round.py with tests/ on its path.
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

REPO = Path(__file__).resolve().parents[2]


def tiny_dict(root: Path, *, sites: int = 2, rounds: int = 2, **sections: dict[str, Any]) -> dict[str, Any]:
    """A config small enough for a round in seconds on one CPU core (32x32 inputs, k=4, m=8)."""
    data: dict[str, Any] = {
        "data": {
            "source": "synthetic",
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
    from fedpose.shared.configuration.schema import config_from_dict

    return config_from_dict(tiny_dict(root, **kwargs))


def world_root(tmp_path_factory: Any) -> Path:
    """One data + pretrained-weights cache per test session (generated once, reused by every test)."""
    return tmp_path_factory.getbasetemp() / "fedpose-world"


def prepare_world(root: Path, **kwargs: Any) -> Any:
    """Tiny config with its data generated and pretrained weights cached under ``root``."""
    from fedpose.shared.training.runs import ensure_data, ensure_pretrained

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


# ---------------------------------------------------------------------------
# a pilot on the deployment engine: SuperLink (TLS, node auth), registered sites, `flwr` CLI
# ---------------------------------------------------------------------------


def fedpose_cli(*args: str) -> None:
    """The ``fedpose`` command line, in process."""
    from fedpose.cli.main import main

    assert main(list(args)) == 0


class Pilot:
    """Certificates, site policies and approvals under ``root``; starts and stops the real processes.

    Every process binds 127.0.0.1 and is started in its own session; ``close`` stops them all.
    """

    def __init__(self, root: Path, cfg: Any, *, sites: int = 2, lifetime_rounds: int = 2,
                 database: bool = False) -> None:
        self.root, self.cfg, self.sites = root, cfg, sites
        self.env = flower_env(root / "flwr-home")
        self.certs = root / "certs"
        self.database = root / "superlink.db" if database else None
        self.link = free_port()
        self.ports = [free_port() for _ in range(sites + 1)]
        self.procs: list[subprocess.Popen] = []
        self.superlink: subprocess.Popen | None = None
        self.supernodes: dict[int, subprocess.Popen] = {}
        fedpose_cli("certs", "--out", str(self.certs), "--nodes", str(sites + 1))
        # The app as `flwr run` bundles it, frozen now: what the sites approve and what is submitted stay
        # the same bytes even if the working tree changes while the test runs.
        self.app = app_snapshot(root / "app")
        data = Path(cfg.data.root)
        for i in range(sites):
            fedpose_cli("site-policy", "--out", str(self.policy(i)), "--site", f"site-{i}", "--epsilon", "2.0",
                        "--delta", "1e-3", "--lifetime-rounds", str(lifetime_rounds),
                        "--data-path", str(data / f"site-{i}"),
                        "--sample-rate", repr(cfg.train.batch_size / cfg.data.synth.per_site),
                        "--expected-batch", str(cfg.train.batch_size),
                        "--steps-per-round", str(cfg.federation.local_steps), "--psi-min", repr(cfg.privacy.psi_param),
                        "--public-path", str(data / "public"),
                        # a Feature-DP federation needs each site's opt-in (and its pinned public batch)
                        *(["--release-blurred-images-and-labels", "--public-batch-size",
                           str(cfg.train.public_batch_size)] if cfg.train.method in ("fdp", "fpdp") else []))
            # The hospital approves the bundle it reviewed (here: this repository, as `flwr run` builds it).
            fedpose_cli("site", "approve", "--bundle", str(self.app), "--approved", str(self.approved(i)))

    def policy(self, i: int) -> Path:
        return self.root / f"site-{i}" / "policy.yaml"

    def approved(self, i: int) -> Path:
        return self.root / f"site-{i}" / "approved.txt"

    def site_ledger(self, i: int) -> Path:
        return self.root / f"site-{i}" / "ledger.sqlite"

    def log(self, name: str) -> Path:
        return self.root / f"{name}.log"

    def healthy(self) -> bool:
        import ssl
        import urllib.request

        ctx = ssl.create_default_context(cafile=str(self.certs / "ca.crt"))
        try:
            with urllib.request.urlopen(f"https://127.0.0.1:{self.link}/health", context=ctx, timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    def start_superlink(self, log_name: str = "superlink") -> None:
        cmd = [bin_path("flower-superlink"), "--ssl-ca-certfile", str(self.certs / "ca.crt"),
               "--ssl-certfile", str(self.certs / "server.pem"), "--ssl-keyfile", str(self.certs / "server.key"),
               "--enable-supernode-auth", "--host", "127.0.0.1", "--port", str(self.link)]
        if self.database is not None:
            cmd += ["--database", str(self.database)]
        self.superlink = start(cmd, self.log(log_name), self.env)
        self.procs.append(self.superlink)
        wait_for(lambda: self.healthy() or self.superlink.poll() is not None, 60, "the SuperLink")
        assert self.superlink.poll() is None, self.log(log_name).read_text()[-3000:]
        (self.root / "flwr-home" / "config.toml").write_text(
            '[superlink]\ndefault = "pilot"\n\n[superlink.pilot]\n'
            f'address = "127.0.0.1:{self.link}"\nroot-certificates = "{self.certs / "ca.crt"}"\n'
        )

    def register(self, *nodes: int) -> None:
        import json

        for i in nodes:
            reg = self.flwr("supernode", "register", str(self.certs / f"node-{i}.pub"), "pilot", "--format", "json")
            assert reg.returncode == 0 and json.loads(reg.stdout)["success"], reg.stdout + reg.stderr

    def start_site(self, i: int, log_name: str | None = None, *extra: str) -> subprocess.Popen:
        """Site ``i``'s SuperNode through ``fedpose site start`` (the app-approval gate), key node-(i+1)."""
        proc = start([
            sys.executable, "-m", "fedpose.cli.main", "site", "start", "--approved", str(self.approved(i)),
            "--policy", str(self.policy(i)), *extra, "--",
            "--root-certificates", str(self.certs / "ca.crt"), "--superlink", f"127.0.0.1:{self.link}",
            "--auth-supernode-private-key", str(self.certs / f"node-{i + 1}"),
            "--host", "127.0.0.1", "--port", str(self.ports[i]),
            "--max-retries", "3", "--max-wait-time", "30",
        ], self.log(log_name or f"supernode-{i}"), self.env)
        self.procs.append(proc)
        self.supernodes[i] = proc
        return proc

    def flwr(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([bin_path("flwr"), *args], cwd=self.root, env=self.env, capture_output=True, text=True,
                              timeout=timeout)

    def submit(self, app: Path, run_config: str) -> int:
        import json

        run = self.flwr("run", str(app), "pilot", "--format", "json", "--run-config", run_config, timeout=180)
        assert run.returncode == 0, run.stdout + run.stderr
        return int(json.loads(run.stdout)["run-id"])

    def status(self, run_id: int) -> str:
        import json

        ls = self.flwr("ls", "pilot", "--run-id", str(run_id), "--format", "json")
        return json.loads(ls.stdout)["runs"][0]["status"] if ls.returncode == 0 else ""

    def wait_finished(self, run_id: int, timeout: float) -> str:
        wait_for(lambda: self.status(run_id).startswith("finished"), timeout, f"run {run_id} to finish", poll=2.0)
        return self.status(run_id)

    def run_log(self, run_id: int) -> str:
        return self.flwr("log", str(run_id), "pilot", "--show").stdout

    def close(self) -> None:
        stop(*self.procs)


def app_snapshot(dst: Path) -> Path:
    """This repository's app bundle (the FAB ``flwr run`` builds), unpacked into ``dst``."""
    import io
    import zipfile

    from flwr.cli.build import build_fab_from_disk

    with zipfile.ZipFile(io.BytesIO(build_fab_from_disk(REPO))) as fab:
        for name in fab.namelist():
            if not name.startswith(".info/"):
                (dst / name).parent.mkdir(parents=True, exist_ok=True)
                (dst / name).write_bytes(fab.read(name))
    return dst


def kill_group(proc: subprocess.Popen) -> None:
    """kill -9 of a process and everything it started (a crash, not a shutdown)."""
    _signal_group(proc, signal.SIGKILL)
    proc.wait(timeout=30)


def ledger_rows(path: Path, sql: str = "SELECT * FROM spend ORDER BY id", params: tuple = ()) -> list[tuple]:
    import sqlite3

    if not path.exists():
        return []
    db = sqlite3.connect(path, timeout=10)
    try:
        return db.execute(sql, params).fetchall()
    finally:
        db.close()


class InProcessGrid:
    """A Flower Grid whose nodes are the real site handlers (``fedpose.client.client_app.on_query / on_train``), in
    process.

    The server's own round loop (``fedpose.server.run.run_federation``) drives it: planning from the sites'
    declarations, requests, the sites' checks, training and ledgers, replies, aggregation, the claim.
    Flower's simulation (Ray) runs the same handlers; ``tests/test_federation_sim.py`` covers that path.
    """

    def __init__(self, run_config: dict, sites: int) -> None:
        from flwr.app import Context, RecordDict
        from flwr.supercore.task_identity import TaskIdentity

        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 0  # the ServerApp's identity
        self.run_config = run_config
        self.contexts = {i + 1: Context(run_id=1, node_id=i + 1, node_config={"partition-id": i}, state=RecordDict(),
                                        run_config={}) for i in range(sites)}
        self.pending: dict[str, Any] = {}  # replies waiting for pull_messages, by the id of their message
        self.sent = 0

    def get_node_ids(self) -> list[int]:
        return sorted(self.contexts)

    def send_and_receive(self, messages, timeout=None):
        from flwr.app import MessageType

        from fedpose.client.client_app import on_query, on_train

        replies = []
        for message in messages:
            context = self.contexts[message.metadata.dst_node_id]
            handler = on_query if message.metadata.message_type == MessageType.QUERY else on_train
            replies.append(handler(message, context, dict(self.run_config)))
        return replies

    def push_messages(self, messages):
        """Each site answers at once; the replies wait for ``pull_messages`` (as a SuperLink's would)."""
        ids = []
        for message in messages:
            self.sent += 1
            key = f"m{self.sent}"
            (reply,) = self.send_and_receive([message])
            reply.metadata.__dict__["_reply_to_message_id"] = key
            self.pending[key] = reply
            ids.append(key)
        return ids

    def pull_messages(self, message_ids):
        return [self.pending.pop(key) for key in list(message_ids) if key in self.pending]
