"""Crashes on the deployment engine (issue #9): kill -9 of a SuperNode and of the SuperLink, then recovery.

Real processes on 127.0.0.1: a SuperLink with TLS, node authentication and a database file (so
registrations and runs survive its restart), two registered site SuperNodes started with
``fedpose site start`` (which restarts a SuperNode that exits with an error, e.g. while the
SuperLink still holds the session of the one that crashed).

1. A site's SuperNode is killed during a federation and restarted once the SuperLink has seen it
   go offline: the round it missed is recorded as missed (its real cause), the server waits for it,
   and the site is asked again in the next round.
2. The SuperLink (with its ServerApp) is killed while round 2 of a second federation is under
   way, after a site has committed round 2 in its own ledger; it is restarted and the federation
   is resumed with ``resume=true`` only; one site's SuperNode comes back only after the resumed
   server first asked it (it waits for it). Every site's ledger then equals what the server's claim
   accounts: the claim is never below any site's ledger, and no round was spent twice.
3. The SuperLink (with its ServerApp) is killed once round 1's requests are sent: ``fedpose server status``
   counts every asked round as spent before any resume.

Every wait is bounded; everything is stopped by process group in ``finally``.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from support.federation import Pilot, kill_group, ledger_rows, prepare_world, wait_for, world_root
from fedpose.shared.configuration.schema import dump_config
from fedpose.shared.privacy.accounting.accountant import StepRecord, epsilon_spent

pytestmark = pytest.mark.slow


def _rounds(out: Path) -> list[dict]:
    path = out / "rounds.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _federation(out: Path) -> str | None:
    try:
        rows = ledger_rows(out / "ledger.sqlite", "SELECT value FROM meta WHERE key = 'federation'")
    except sqlite3.OperationalError:  # the server is creating it right now
        return None
    return rows[0][0] if rows else None


def _site_run(pilot: Pilot, i: int, federation: str) -> list[tuple]:
    return ledger_rows(pilot.site_ledger(i), "SELECT round, sigma, sample_rate, steps, delta, epsilon FROM spend"
                       " WHERE federation = ? ORDER BY id", (federation,))


def _check_accounting(pilot: Pilot, out: Path) -> dict:
    """Every site's ledger against the server's claim; returns metrics.json."""
    metrics = json.loads((out / "metrics.json").read_text())
    federation = metrics["federation"]
    for i in range(pilot.sites):
        site = f"site-{i}"
        rows = _site_run(pilot, i, federation)
        rounds = [r[0] for r in rows]
        assert len(rounds) == len(set(rounds)), f"{site} spent a round twice: {rounds}"
        run_eps = epsilon_spent([StepRecord(sigma=r[1], sample_rate=r[2], steps=r[3]) for r in rows],
                                delta=rows[0][4], accountant="rdp") if rows else 0.0
        lifetime = ledger_rows(pilot.site_ledger(i), "SELECT epsilon FROM spend ORDER BY id DESC LIMIT 1")[0][0]
        got = metrics["sites"][site]
        assert got["epsilon"] == pytest.approx(run_eps, rel=1e-6), (site, got, rounds)
        assert got["epsilon_lifetime"] == pytest.approx(lifetime, rel=1e-6), (site, got)
        assert metrics["epsilon"] >= run_eps - 1e-9
        assert got["rounds"] == len(rows), (site, got, rounds)
    return metrics


def _node_id(pilot: Pilot, i: int) -> str:
    """Site i's SuperNode id, as its log states it (the same id after a restart: it is the key's)."""
    import re

    found = re.findall(r"SuperNode ID: (\d+)", pilot.log(f"supernode-{i}").read_text())
    assert found, pilot.log(f"supernode-{i}").read_text()[-2000:]
    return found[-1]


def _node_status(pilot: Pilot, node_id: str) -> str:
    listed = pilot.flwr("supernode", "list", "pilot", "--format", "json")
    try:
        nodes = json.loads(listed.stdout)["nodes"]
    except (ValueError, KeyError):
        return ""
    return next((n["status"] for n in nodes if n["node-id"] == node_id), "")


def test_supernode_and_superlink_killed_then_recovered(tmp_path: Path, tmp_path_factory) -> None:
    from fedpose.shared.configuration.schema import replace

    cfg = prepare_world(world_root(tmp_path_factory), rounds=3, federation={"local_steps": 1, "round_timeout": 240})
    config_path = tmp_path / "federation.yaml"
    dump_config(cfg, config_path)
    four_rounds = tmp_path / "federation-4.yaml"  # the first federation: a round after the one site-0 missed
    dump_config(replace(cfg, **{"federation.rounds": 4}), four_rounds)
    pilot = Pilot(tmp_path, cfg, lifetime_rounds=7, database=True)
    try:
        pilot.start_superlink()
        pilot.register(1, 2)
        for i in (0, 1):
            pilot.start_site(i)

        # 1. kill -9 of site-0's SuperNode once round 1 is recorded; restarted once the SuperLink has seen it go
        # offline (before that, a restarted node may pick up the dead one's request in time, and no round is
        # missed at all: then there would be nothing to check).
        out1 = tmp_path / "out-1"
        run1 = pilot.submit(pilot.app, f"config='{four_rounds}' out='{out1}'")
        wait_for(lambda: len(_rounds(out1)) >= 1, 300, "round 1 of the first federation", poll=0.5)
        node = _node_id(pilot, 0)
        kill_group(pilot.supernodes[0])
        # While it is down the hospital raises its budget (a policy change is its own event).
        policy = yaml.safe_load(pilot.policy(0).read_text())
        policy["epsilon"] = 3.0
        pilot.policy(0).write_text(yaml.safe_dump(policy, sort_keys=False))
        wait_for(lambda: _node_status(pilot, node) == "offline", 240, "the SuperLink to see site-0 offline", poll=2.0)
        pilot.start_site(0, "supernode-0-restarted")
        status = pilot.wait_finished(run1, 600)
        assert status == "finished:completed", pilot.run_log(run1)[-6000:]
        rounds = _rounds(out1)
        assert [r["round"] for r in rounds] == [1, 2, 3, 4], rounds
        assert rounds[0]["accepted"] == ["site-0", "site-1"]
        lost = [r for r in rounds if "site-0" not in r["accepted"]]
        assert lost, "site-0 was killed: some round must have gone without it"
        assert all("site-0" in r["missed"] or "site-0" in r["offline"] for r in lost), lost
        assert lost[-1]["round"] < 4 and rounds[-1]["accepted"] == ["site-0", "site-1"], \
            ("site-0 came back: it is asked again", rounds)
        report = (out1 / "report.md").read_text()
        assert "no reply within the round timeout" not in report  # the real cause, not a timeout
        changed = [line for line in report.splitlines() if "| site-0 | policy-changed |" in line]
        assert len(changed) == 1 and "epsilon: 2.0 -> 3.0" in changed[0], report
        _check_accounting(pilot, out1)

        # 2. kill -9 of the SuperLink (and its ServerApp) after a site committed round 2 of a new federation.
        out2 = tmp_path / "out-2"
        pilot.submit(pilot.app, f"config='{config_path}' out='{out2}'")

        def round2_committed() -> bool:
            federation = _federation(out2)
            return federation is not None and any(
                any(r[0] == 2 for r in _site_run(pilot, i, federation)) for i in (0, 1))

        wait_for(round2_committed, 300, "a site to commit round 2 of the second federation", poll=0.05)
        kill_group(pilot.superlink)
        # site-0's SuperNode goes down with it and comes back only after the resumed server has asked it:
        # the restarted SuperLink's database still lists it (until its heartbeat lapses), so that first
        # query comes back "Node Unavailable", and the server must wait for it rather than give up.
        kill_group(pilot.supernodes[0])
        crashed_at = len(_rounds(out2))
        pilot.start_superlink("superlink-restarted")
        run3 = pilot.submit(pilot.app, f"out='{out2}' resume=true")
        wait_for(lambda: "did not describe itself" in pilot.run_log(run3) or pilot.status(run3).startswith("finished"),
                 240, "the resumed server to ask the absent site-0", poll=5.0)
        pilot.start_site(0, "supernode-0-after-superlink")
        status = pilot.wait_finished(run3, 600)
        assert status == "finished:completed", pilot.run_log(run3)[-6000:]
    finally:
        pilot.close()

    rounds = _rounds(out2)
    assert [r["round"] for r in rounds] == [1, 2, 3], (crashed_at, rounds)
    metrics = _check_accounting(pilot, out2)
    federation = metrics["federation"]
    for i in (0, 1):  # the crash-time round was answered from the site's stored reply, not trained again
        assert [r[0] for r in _site_run(pilot, i, federation)] == [1, 2, 3]
    db = sqlite3.connect(out2 / "ledger.sqlite")
    try:
        kinds = [r[0] for r in db.execute("SELECT kind FROM events ORDER BY id")]
    finally:
        db.close()
    assert "resumed" in kinds
    assert "resumed" in (out2 / "report.md").read_text()


def _server_status(out: Path) -> tuple[dict, str]:
    """``fedpose server status`` on ``out``, as an operator runs it: (its --json object, its text)."""
    def run(*extra: str) -> str:
        done = subprocess.run([sys.executable, "-m", "fedpose.cli.main", "server", "status", "--out", str(out),
                               *extra], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    return json.loads(run("--json")), run()


def test_a_killed_servers_status_counts_every_round_it_asked_the_sites(tmp_path: Path, tmp_path_factory) -> None:
    """The server (SuperLink and ServerApp) is killed -9 once it has sent round 1's train requests: its status,
    read from the run folder alone, counts each asked round as spent (at the plan) and is never below what a
    site's own ledger charged, before any resume."""
    cfg = prepare_world(world_root(tmp_path_factory), rounds=2, federation={"local_steps": 1, "round_timeout": 240})
    config_path = tmp_path / "federation.yaml"
    dump_config(cfg, config_path)
    pilot = Pilot(tmp_path, cfg)
    out = tmp_path / "out"
    try:
        pilot.start_superlink()
        pilot.register(1, 2)
        for i in (0, 1):
            pilot.start_site(i)
        pilot.submit(pilot.app, f"config='{config_path}' out='{out}'")

        def asked() -> bool:
            try:
                return len(ledger_rows(out / "ledger.sqlite", "SELECT site FROM sent WHERE round = 1")) == 2
            except sqlite3.OperationalError:  # the server is creating it right now
                return False

        wait_for(asked, 300, "the server to ask both sites for round 1", poll=0.05)
        # the whole server: the SuperLink's process group, and the ServerApp (its SuperExec's own session), by
        # the pid it wrote into the run folder's lock
        server_app = int((out / "server.lock").read_text().split()[0])
        kill_group(pilot.superlink)
        os.kill(server_app, signal.SIGKILL)
        replied = ledger_rows(out / "ledger.sqlite", "SELECT site FROM spend")
        time.sleep(5.0)  # a site that already took its request charges it (or not) before its ledger is read
        federation = _federation(out)
        status, text = _server_status(out)
    finally:
        pilot.close()

    assert status["state"] == "stopped", status
    for i in (0, 1):
        site = f"site-{i}"
        rows = ledger_rows(out / "ledger.sqlite", "SELECT sigma, sample_rate, steps_per_round, delta FROM sites"
                           " WHERE site = ?", (site,))
        sigma, q, steps, delta = rows[0]
        asked_once = epsilon_spent([StepRecord(sigma=sigma, sample_rate=q, steps=steps)], delta=delta,
                                   accountant="rdp")
        charged = _site_run(pilot, i, federation)
        own = epsilon_spent([StepRecord(sigma=r[1], sample_rate=r[2], steps=r[3]) for r in charged],
                            delta=delta, accountant="rdp") if charged else 0.0
        shown = status["sites"][site]["epsilon"]
        assert shown >= asked_once - 1e-9, (site, shown, asked_once, replied)
        assert shown >= own - 1e-9, (site, shown, own)
        assert f"{site}: eps {shown:.4f}" in text, text
        assert status["epsilon"] >= shown - 1e-9
