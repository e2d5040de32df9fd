"""Deployment engine on loopback: a real SuperLink with TLS and SuperNode authentication, two
registered SuperNodes (one per site, each with its own policy file) running 2 rounds via
``flwr run``, and a SuperNode with an unregistered key that is refused.

The site SuperNodes are started with ``fedpose site start`` (client/app_trust.py): they run the
approved bundle (this repository, approved with ``fedpose site approve``) and refuse a bundle the
operator altered (issue #8, finding 8.9): its ClientApp is never imported, the site ledgers stay
as they were.

Everything binds 127.0.0.1; every process is started in its own session and stopped by
process group in ``finally``; every wait is bounded.
"""

from __future__ import annotations

import io
import json
import ssl
import subprocess
import sys
import zipfile
import urllib.request
from pathlib import Path

import pytest

from federation_support import (
    REPO,
    bin_path,
    flower_env,
    free_port,
    prepare_world,
    start,
    stop,
    wait_for,
    world_root,
)
from shared.config import dump_config
from shared.privacy.accountant import StepRecord, epsilon_spent

pytestmark = pytest.mark.slow


def _healthy(port: int, ca: Path) -> bool:
    ctx = ssl.create_default_context(cafile=str(ca))
    try:
        with urllib.request.urlopen(f"https://127.0.0.1:{port}/health", context=ctx, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def _fedpose(*args: str) -> None:
    """The ``fedpose`` command line, in process."""
    from cli.main import main

    assert main(list(args)) == 0


def _flwr(*args: str, env: dict[str, str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([bin_path("flwr"), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _hostile_bundle(dst: Path, marker: Path) -> Path:
    """This app with a ClientApp that ignores the site's policy and leaves ``marker`` if it is ever imported."""
    from flwr.cli.build import build_fab_from_disk

    with zipfile.ZipFile(io.BytesIO(build_fab_from_disk(REPO))) as fab:
        for name in fab.namelist():
            if not name.startswith(".info/"):
                (dst / name).parent.mkdir(parents=True, exist_ok=True)
                (dst / name).write_bytes(fab.read(name))
    (dst / "client" / "client_app.py").write_text(
        "from pathlib import Path\n"
        "from flwr.app import Message, RecordDict\n"
        "from flwr.clientapp import ClientApp\n"
        f"Path({str(marker)!r}).write_text('hostile ClientApp imported')\n"
        "app = ClientApp()\n\n"
        "@app.query()\n"
        "def query(msg, context):\n"
        "    return Message(RecordDict(), reply_to=msg)  # would train without any policy check\n"
    )
    return dst


def _site_rows(path: Path) -> list[tuple]:
    import sqlite3

    db = sqlite3.connect(path)
    try:
        return db.execute("SELECT * FROM spend ORDER BY id").fetchall()
    finally:
        db.close()


def test_tls_auth_deployment_two_rounds_and_unregistered_node_refused(tmp_path: Path, tmp_path_factory) -> None:
    # Broadcast V, refreshed every 2 rounds: sent in round 1, cached by the sites for round 2.
    cfg = prepare_world(world_root(tmp_path_factory), rounds=2, federation={"local_steps": 1, "basis_mode": "broadcast"},
                        privacy={"basis_every": 2})
    config_path = tmp_path / "federation.yaml"
    dump_config(cfg, config_path)
    env = flower_env(tmp_path / "flwr-home")
    certs = tmp_path / "certs"
    _fedpose("certs", "--out", str(certs), "--nodes", "3")
    data = Path(cfg.data.root)
    for i in range(2):
        _fedpose("site-policy", "--out", str(tmp_path / f"site-{i}" / "policy.yaml"), "--site", f"site-{i}",
                 "--epsilon", "2.0", "--delta", "1e-3", "--lifetime-rounds", "2", "--data-path", str(data / f"site-{i}"),
                 "--sample-rate", repr(cfg.train.batch_size / cfg.data.synth.per_site),
                 "--steps-per-round", str(cfg.federation.local_steps), "--psi-min", repr(cfg.privacy.psi_param),
                 "--public-path", str(data / "public"))
        # The hospital approves the bundle it reviewed (here: this repository, exactly as `flwr run` builds it).
        _fedpose("site", "approve", "--bundle", str(REPO), "--approved", str(tmp_path / f"site-{i}" / "approved.txt"))

    link, ports = free_port(), [free_port() for _ in range(3)]
    procs: list[subprocess.Popen] = []
    try:
        procs.append(start([
            bin_path("flower-superlink"), "--ssl-ca-certfile", str(certs / "ca.crt"),
            "--ssl-certfile", str(certs / "server.pem"), "--ssl-keyfile", str(certs / "server.key"),
            "--enable-supernode-auth", "--host", "127.0.0.1", "--port", str(link),
        ], tmp_path / "superlink.log", env))
        wait_for(lambda: _healthy(link, certs / "ca.crt") or procs[0].poll() is not None, 60, "the SuperLink")
        assert procs[0].poll() is None, (tmp_path / "superlink.log").read_text()[-3000:]

        (tmp_path / "flwr-home" / "config.toml").write_text(
            '[superlink]\ndefault = "pilot"\n\n[superlink.pilot]\n'
            f'address = "127.0.0.1:{link}"\nroot-certificates = "{certs / "ca.crt"}"\n'
        )
        for i in (1, 2):
            reg = _flwr("supernode", "register", str(certs / f"node-{i}.pub"), "pilot", "--format", "json",
                        env=env, cwd=tmp_path)
            assert reg.returncode == 0 and json.loads(reg.stdout)["success"], reg.stdout + reg.stderr

        for i in (0, 1):
            node_config = f"site-policy='{tmp_path / f'site-{i}' / 'policy.yaml'}'"
            procs.append(start([
                sys.executable, "-m", "cli.main", "site", "start",
                "--approved", str(tmp_path / f"site-{i}" / "approved.txt"), "--",
                "--root-certificates", str(certs / "ca.crt"),
                "--superlink", f"127.0.0.1:{link}", "--auth-supernode-private-key", str(certs / f"node-{i + 1}"),
                "--node-config", node_config, "--host", "127.0.0.1", "--port", str(ports[i]),
                "--max-retries", "3", "--max-wait-time", "30",
            ], tmp_path / f"supernode-{i}.log", env))

        # A node whose key was never registered cannot join: it exits with status 1 (activation refused).
        rogue_log = tmp_path / "supernode-unregistered.log"
        rogue = start([
            bin_path("flower-supernode"), "--root-certificates", str(certs / "ca.crt"),
            "--superlink", f"127.0.0.1:{link}", "--auth-supernode-private-key", str(certs / "node-3"),
            "--node-config", "partition-id=2", "--host", "127.0.0.1", "--port", str(ports[2]),
        ], rogue_log, env)
        try:
            code = rogue.wait(timeout=90)
        finally:
            stop(rogue)
        assert code == 1, rogue_log.read_text()[-3000:]
        assert "2004" in rogue_log.read_text()

        out = tmp_path / "out"
        run = _flwr("run", str(REPO), "pilot", "--format", "json",
                    "--run-config", f"config='{config_path}' out='{out}'", env=env, cwd=tmp_path, timeout=180)
        assert run.returncode == 0, run.stdout + run.stderr
        run_id = json.loads(run.stdout)["run-id"]

        def finished() -> bool:
            ls = _flwr("ls", "pilot", "--run-id", str(run_id), "--format", "json", env=env, cwd=tmp_path)
            return ls.returncode == 0 and json.loads(ls.stdout)["runs"][0]["status"].startswith("finished")

        def finished_any(rid: int) -> bool:
            ls = _flwr("ls", "pilot", "--run-id", str(rid), "--format", "json", env=env, cwd=tmp_path)
            return ls.returncode == 0 and json.loads(ls.stdout)["runs"][0]["status"].startswith("finished")

        wait_for(finished, 420, "the federation run to finish", poll=2.0)
        ls = _flwr("ls", "pilot", "--run-id", str(run_id), "--format", "json", env=env, cwd=tmp_path)
        status = json.loads(ls.stdout)["runs"][0]["status"]
        if status != "finished:completed":
            log = _flwr("log", str(run_id), "pilot", "--show", env=env, cwd=tmp_path)
            pytest.fail(f"run status {status}:\n{log.stdout[-6000:]}")

        # The operator submits an altered bundle to the same SuperNodes: both sites refuse to run it.
        ledgers = {i: _site_rows(tmp_path / f"site-{i}" / "ledger.sqlite") for i in (0, 1)}
        marker = tmp_path / "hostile-ran"
        hostile = _hostile_bundle(tmp_path / "hostile-app", marker)
        run = _flwr("run", str(hostile), "pilot", "--format", "json",
                    "--run-config", f"config='{config_path}' out='{tmp_path / 'out-hostile'}'", env=env, cwd=tmp_path,
                    timeout=180)
        assert run.returncode == 0, run.stdout + run.stderr
        run_id = json.loads(run.stdout)["run-id"]
        wait_for(lambda: finished_any(run_id), 240, "the hostile run to end", poll=2.0)
        ls = _flwr("ls", "pilot", "--run-id", str(run_id), "--format", "json", env=env, cwd=tmp_path)
        assert json.loads(ls.stdout)["runs"][0]["status"] != "finished:completed"
    finally:
        stop(*procs)

    assert not marker.exists()  # the altered ClientApp was never imported at either site
    for i in (0, 1):
        assert _site_rows(tmp_path / f"site-{i}" / "ledger.sqlite") == ledgers[i]
        assert "is not approved by this site" in (tmp_path / f"supernode-{i}.log").read_text()

    rounds = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1, 2]
    assert all(r["accepted"] == ["site-0", "site-1"] for r in rounds)
    assert all(r["basis_version"] == 1 for r in rounds)
    from shared.model.posenet import apply_strategy, build_model

    model = build_model(cfg.model, cfg.data.input_size)
    named = dict(model.named_parameters())
    p = sum(named[n].numel() for n in apply_strategy(model, cfg.train.strategy))
    for site in ("site-0", "site-1"):  # V (p x k, fp16) went down in round 1 only
        assert rounds[0]["bytes_down"][site] - rounds[1]["bytes_down"][site] >= p * cfg.privacy.k * 2
    assert rounds[1]["bytes_up"]["site-1"] > 0

    import sqlite3

    server = sqlite3.connect(out / "ledger.sqlite")
    for i in (0, 1):
        srows = server.execute("SELECT round, sigma, sample_rate, steps, delta, epsilon FROM spend WHERE site = ?"
                               " ORDER BY id", (f"site-{i}",)).fetchall()
        site = sqlite3.connect(tmp_path / f"site-{i}" / "ledger.sqlite")
        lrows = site.execute("SELECT round, sigma, sample_rate, steps, delta, epsilon FROM spend ORDER BY id")
        lrows = lrows.fetchall()
        site.close()
        assert [r[:4] for r in srows] == [r[:4] for r in lrows] and [r[0] for r in srows] == [1, 2]
        fresh = epsilon_spent([StepRecord(sigma=r[1], sample_rate=r[2], steps=r[3]) for r in srows],
                              delta=srows[0][4], accountant="rdp")
        assert srows[-1][5] == pytest.approx(fresh, rel=1e-9)
        assert lrows[-1][5] == pytest.approx(fresh, rel=1e-9)
        assert fresh <= 2.0
    server.close()
