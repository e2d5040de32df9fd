"""End to end in Flower's simulation (``fedpose simulate``, real Ray workers), with a server kill.

One 2-round federation of 2 sites: the first process is killed (SIGKILL, whole process
group: server, Ray and the sites) after round 1 was checkpointed; ``--resume`` then runs
round 2 only. Afterwards both ledgers must agree with a fresh accountant, round 1 must be
recorded exactly once and unchanged, and every result file must exist.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from support.federation import (
    REPO,
    flower_env,
    prepare_world,
    start,
    stop,
    wait_for,
    world_root,
)

from fedpose.shared.configuration.schema import dump_config
from fedpose.shared.privacy.accounting.accountant import StepRecord, epsilon_spent

pytestmark = pytest.mark.slow


def _spend(db: Path, site: str | None = None) -> list[dict]:
    conn = sqlite3.connect(db)
    conn.row_factory = sqlite3.Row
    query = "SELECT * FROM spend" + (" WHERE site = ?" if site else "") + " ORDER BY id"
    rows = [dict(r) for r in conn.execute(query, (site,) if site else ())]
    conn.close()
    return rows


def _fresh(rows: list[dict], delta: float) -> float:
    history = [StepRecord(sigma=r["sigma"], sample_rate=r["sample_rate"], steps=r["steps"]) for r in rows]
    return epsilon_spent(history, delta=delta, accountant="rdp")


def test_simulation_two_rounds_with_server_kill_and_resume(tmp_path: Path, tmp_path_factory) -> None:
    # basis_mode "site": each site computes V from its copy of the public set (no V on the wire).
    cfg = prepare_world(world_root(tmp_path_factory), rounds=2, federation={"basis_mode": "site"})
    config_path = tmp_path / "federation.yaml"
    dump_config(cfg, config_path)
    out = tmp_path / "out"
    env = flower_env(tmp_path / "flwr-home")
    cmd = [sys.executable, "-m", "fedpose.cli.main", "simulate", "--config", str(config_path), "--out", str(out),
           "--quiet"]

    first = start(cmd, tmp_path / "first.log", env)
    try:
        wait_for(lambda: (out / "rounds.jsonl").is_file() and (out / "rounds.jsonl").read_text().strip() != ""
                 or first.poll() is not None, 300, "round 1 to be checkpointed")
        assert first.poll() is None, (tmp_path / "first.log").read_text()[-4000:]
        os.killpg(first.pid, signal.SIGKILL)  # the server and its sites, mid round 2
        first.wait(timeout=30)
    finally:
        stop(first)
    checkpointed = [json.loads(line)["round"] for line in (out / "rounds.jsonl").read_text().splitlines()]
    assert checkpointed == [1]
    before = _spend(out / "ledger.sqlite")
    assert sorted(r["site"] for r in before if r["round"] == 1) == ["site-0", "site-1"]

    resumed = subprocess.run([*cmd, "--resume"], cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-5000:]
    assert "privacy spent per site" in resumed.stdout
    # The summary names the start, the gain and the best round, and the data the numbers came from.
    assert re.search(r"PCKh@0\.5: start \d+\.\d\d \(the public-pretrained model\) -> \d+\.\d\d after 2 rounds "
                     r"\(gain [+-]\d+\.\d\d; best \d+\.\d\d at round [12]\)", resumed.stdout), resumed.stdout[-2000:]
    assert "data: synthetic ward at " in resumed.stdout

    rounds = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1, 2]
    assert all(r["accepted"] == ["site-0", "site-1"] for r in rounds)
    weights_only = rounds[0]["bytes_down"]["site-0"]
    assert all(b == weights_only for r in rounds for b in r["bytes_down"].values())  # no V sent
    assert all("site_basis" not in r["seconds"] for r in rounds)  # site timings stay at the sites (P10)
    after = _spend(out / "ledger.sqlite")
    assert [r for r in after if r["round"] == 1] == [r for r in before if r["round"] == 1]  # same ledger
    metrics = json.loads((out / "metrics.json").read_text())
    delta = cfg.privacy.delta
    for site in ("site-0", "site-1"):
        # The killed run's round-2 request, written down before it was sent, counted until the site's own
        # report of round 2 covered it (resolved); what ran is the rest.
        assert [r["round"] for r in after if r["site"] == site and r["state"] == "resolved"] in ([], [2])
        server_rows = [r for r in after if r["site"] == site and r["state"] != "resolved"]
        assert [r["round"] for r in server_rows] == [1, 2]
        assert all(r["state"] == "completed" for r in server_rows)
        fresh = _fresh(server_rows, delta)
        assert server_rows[-1]["epsilon"] == pytest.approx(fresh, rel=1e-9)
        site_rows = _spend(out / "sites" / site / "ledger.sqlite")
        site_fresh = _fresh(site_rows, delta)
        assert site_rows[-1]["epsilon"] == pytest.approx(site_fresh, rel=1e-9)
        # The site may have committed round 2 of the killed run too: then it refused the resumed round 2
        # (already spent) and its refusal carried its spend; the server counts the larger, never less.
        assert metrics["sites"][site]["epsilon"] == pytest.approx(max(fresh, site_fresh), rel=1e-9)
        assert metrics["sites"][site]["epsilon"] >= site_fresh * (1 - 1e-12)
        assert max(fresh, site_fresh) <= cfg.privacy.epsilon
    assert metrics["epsilon"] == max(s["epsilon"] for s in metrics["sites"].values())
    assert metrics["rounds"] == 2 and "Feature-DP" in metrics["claim"]

    from fedpose.shared.model.posenet import load_checkpoint

    model, meta = load_checkpoint(out / "model.pt")
    assert meta["rounds"] == 2 and tuple(model.input_size) == tuple(cfg.data.input_size)
    assert (out / "federation.png").stat().st_size > 1000
    assert "| 2 |" in (out / "report.md").read_text()

    listed = subprocess.run([sys.executable, "-m", "fedpose.cli.main", "ledger", "--db", str(out / "ledger.sqlite"),
                             "--json"], cwd=REPO, capture_output=True, text=True, timeout=120, check=True)
    rows = json.loads(listed.stdout)
    assert len([r for r in rows if r["state"] != "resolved"]) == 4  # and the killed run's requests, resolved
    for key in ("site", "round", "sigma", "sample_rate", "steps", "delta", "epsilon", "budget"):
        assert all(key in r for r in rows)


def test_a_first_simulation_says_its_phases_with_progress_and_the_time_left(tmp_path: Path) -> None:
    """A fresh clone's first ``fedpose simulate``: no data, no pretrained weights. It says, before each, that it
    generates the data, that it pretrains on the public split first (once, then cached), and what the federation
    runs; and each round's line says how many rounds of the run are done and about how long the rest takes."""
    from support.federation import tiny_config

    cfg = tiny_config(tmp_path / "fresh", rounds=2)  # nothing generated or pretrained under it yet
    config_path = tmp_path / "federation.yaml"
    dump_config(cfg, config_path)
    done = subprocess.run([sys.executable, "-m", "fedpose.cli.main", "simulate", "--config", str(config_path),
                           "--out", str(tmp_path / "out")], cwd=REPO, env=flower_env(tmp_path / "flwr-home"),
                          capture_output=True, text=True, timeout=900)
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-5000:]
    phases = [re.search(rf"^\[{i}/3\] [^\n]*", done.stdout, re.M) for i in (1, 2, 3)]
    assert all(phases), done.stdout[-3000:]
    data, pretrain, federation = (m.group(0) for m in phases)
    assert done.stdout.index(data) < done.stdout.index(pretrain) < done.stdout.index(federation)
    assert "generating" in data and str(cfg.data.root) in data, data
    assert "pretraining on the public split first" in pretrain and "once" in pretrain, pretrain
    assert "2 rounds" in federation and "2 sites" in federation, federation
    assert re.search(r"round 1/2: PCKh [\d.]+, .*about \d+ (s|min) left", text), text[-5000:]
    assert re.search(r"round 2/2: PCKh [\d.]+, .*the last round", text), text[-5000:]
