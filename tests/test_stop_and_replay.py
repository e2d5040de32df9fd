"""The stop-and-replay attack through real processes on 127.0.0.1 (P16): a server stops a charged round.

A hostile operator needs nothing but its own tools: ``flwr stop`` on its SuperLink while a site's round is under
way, then the same request again. Before, Flower's SIGINT reached the site's ClientApp as ``SystemExit``; the
round stayed charged (or, when training had ended, ``done`` with its reply kept, answered at once) and the
identical request replayed it on the same Poisson sample, so stopping at increasing times read off the round's
training time, which tracks the realised batch. Now the stop makes the round final at the site: stored as failed,
its seed erased, a held reply dropped, nothing sent. What every later request for the round then gets (the stored
failure, on the clock, nothing trained) is ``tests/test_stopped_round.py``.

One site (TLS, node authentication, ``fedpose site start`` with its warm start), its policy holding each answer
for ``round_seconds`` so that the stop lands while the round is held. Flower stops a ClientApp with SIGINT, whose
handler ends in ``sys.exit``. With Flower 1.41's SuperNode that signal comes only once the SuperNode drops the
stopped run's task, which may be after the hold; so after ``flwr stop`` the test delivers the same SIGINT at once
to the process running the round (the one holding the site's round lock), and Flower's own handler runs there.
Every wait is bounded; every process is stopped in ``finally``.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import yaml

from fedpose.shared.configuration.schema import dump_config, replace
from support.federation import Pilot, ledger_rows, prepare_world, wait_for, world_root

pytestmark = [pytest.mark.slow, pytest.mark.invariant("P16")]

HOLD = 45.0  # seconds an answer is held: longer than a round plus the ClientApp's heartbeat after a stop


def _rows(pilot: Pilot) -> list[tuple]:
    return ledger_rows(pilot.site_ledger(0), "SELECT round, state, noise_seed, outcome, attempts FROM spend "
                                             "ORDER BY id")


def _round_processes(lock: Path) -> list[int]:
    """The pids of the processes running a round of the site: those holding its round lock open (``site_lock``),
    which is the ClientApp process Flower started for the message, whatever its command line."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if any(fd.readlink() == lock for fd in (entry / "fd").iterdir()):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def test_a_round_the_server_stops_is_final_at_the_site(tmp_path: Path, tmp_path_factory) -> None:
    cfg = prepare_world(world_root(tmp_path_factory), rounds=1,
                        federation={"local_steps": 1, "round_timeout": 240, "min_sites": 1})
    cfg = replace(cfg, **{"train.method": "proj"})
    config = tmp_path / "server.yaml"
    dump_config(cfg, config)
    pilot = Pilot(tmp_path, cfg, sites=1, lifetime_rounds=2)
    policy = yaml.safe_load(pilot.policy(0).read_text())
    policy["round_seconds"] = HOLD
    pilot.policy(0).write_text(yaml.safe_dump(policy, sort_keys=False))
    out = tmp_path / "out"
    try:
        pilot.start_superlink()
        pilot.register(1)
        pilot.start_site(0)
        run = pilot.submit(pilot.app, f"config='{config}' out='{out}'")
        wait_for(lambda: bool(_rows(pilot)), 240, "site-0 to charge round 1", poll=0.1)
        stopped = pilot.flwr("stop", str(run), "pilot", "--format", "json")
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        apps = _round_processes(pilot.site_ledger(0).with_suffix(".lock"))
        assert apps, "no process of the site is running its round"
        for pid in apps:
            os.kill(pid, signal.SIGINT)  # what Flower sends a ClientApp whose run was stopped
        try:
            wait_for(lambda: _rows(pilot)[0][1] == "failed", 90, "the stopped round to be final", poll=0.5)
        except TimeoutError:
            pytest.fail(f"the stopped round stayed {_rows(pilot)}: "
                        + pilot.log("supernode-0").read_text()[-3000:])
        (round_, _, seed, outcome, attempts), = _rows(pilot)
        assert (round_, seed, attempts) == (1, None, 1) and "interrupted" in outcome
        site_log = pilot.log("supernode-0").read_text()
    finally:
        pilot.close()
    assert "is final: interrupted before its answer left" in site_log, site_log[-3000:]
    assert not (out / "rounds.jsonl").exists() or not (out / "rounds.jsonl").read_text().strip()  # nothing came back
