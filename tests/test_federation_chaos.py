"""kill -9 at random points of a 3-site TLS federation on the deployment engine (P5, P6, P13).

Real processes on 127.0.0.1: a SuperLink with TLS, node authentication and a database file, three
registered SuperNodes started with ``fedpose site start``. One federation of four rounds; at a random
moment (the seed is printed and can be replayed with ``FEDPOSE_CHAOS_SEED``) the SuperLink and its
ServerApp are killed with SIGKILL, restarted, and the federation resumed; later, at another random
moment, a random site's SuperNode is killed and restarted. Whatever the timing, afterwards:

- no site spent a round twice (each (federation, round) once in its own ledger);
- the server's claim for every site is never below that site's own ledger;
- the federation finished all its rounds.

Every wait is bounded; everything is stopped by process group in ``finally``.
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import pytest

from support.federation import Pilot, kill_group, ledger_rows, prepare_world, wait_for, world_root
from fedpose.shared.configuration.schema import dump_config
from fedpose.shared.privacy.accounting.accountant import StepRecord, epsilon_spent

pytestmark = pytest.mark.slow

SITES = 3
ROUNDS = 4


def _rounds(out: Path) -> list[dict]:
    path = out / "rounds.jsonl"
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


@pytest.mark.invariant("P5", "P13")
def test_random_kills_never_spend_twice_nor_under_claim(tmp_path: Path, tmp_path_factory) -> None:
    seed = int(os.environ.get("FEDPOSE_CHAOS_SEED", time.time_ns() % 2**31))
    rng = random.Random(seed)
    why = f"chaos seed {seed} (replay with FEDPOSE_CHAOS_SEED={seed})"
    cfg = prepare_world(world_root(tmp_path_factory).with_name("fedpose-world-3"), sites=SITES, rounds=ROUNDS,
                        federation={"local_steps": 1, "round_timeout": 240, "min_sites": 2})
    config_path = tmp_path / "federation.yaml"
    dump_config(cfg, config_path)
    pilot = Pilot(tmp_path, cfg, sites=SITES, lifetime_rounds=2 * ROUNDS, database=True)
    out = tmp_path / "out"
    try:
        pilot.start_superlink()
        pilot.register(*range(1, SITES + 1))
        for i in range(SITES):
            pilot.start_site(i)
        pilot.submit(pilot.app, f"config='{config_path}' out='{out}'")

        # 1. the SuperLink and its ServerApp, at a random moment of round 1 or 2
        after = rng.choice([0, 1])
        wait_for(lambda: len(_rounds(out)) >= after and (out / "ledger.sqlite").exists(), 400,
                 f"round {after} ({why})", poll=0.2)
        time.sleep(rng.uniform(0.0, 8.0))
        kill_group(pilot.superlink)
        pilot.start_superlink("superlink-restarted")
        resumed = pilot.submit(pilot.app, f"out='{out}' resume=true")

        # 2. a random site's SuperNode, at a random moment of a later round, restarted after a random pause
        victim = rng.randrange(SITES)
        later = rng.choice([2, 3])
        wait_for(lambda: len(_rounds(out)) >= later or pilot.status(resumed).startswith("finished"), 600,
                 f"round {later} after the resume ({why})", poll=0.5)
        time.sleep(rng.uniform(0.0, 6.0))
        kill_group(pilot.supernodes[victim])
        time.sleep(rng.uniform(0.0, 5.0))
        pilot.start_site(victim, f"supernode-{victim}-restarted")
        status = pilot.wait_finished(resumed, 900)
        assert status == "finished:completed", why + "\n" + pilot.run_log(resumed)[-6000:]
    finally:
        pilot.close()

    rounds = _rounds(out)
    assert [r["round"] for r in rounds] == list(range(1, ROUNDS + 1)), (why, rounds)
    metrics = json.loads((out / "metrics.json").read_text())
    federation = metrics["federation"]
    for i in range(SITES):
        site = f"site-{i}"
        rows = ledger_rows(pilot.site_ledger(i), "SELECT round, sigma, sample_rate, steps, delta, state FROM spend"
                           " WHERE federation = ? ORDER BY id", (federation,))
        charged = [r[0] for r in rows]
        assert len(charged) == len(set(charged)), (why, site, "a round spent twice", charged)
        own = epsilon_spent([StepRecord(sigma=r[1], sample_rate=r[2], steps=r[3]) for r in rows],
                            delta=rows[0][4], accountant="rdp") if rows else 0.0
        claimed = metrics["sites"].get(site, {}).get("epsilon", 0.0)  # a site that never took part claims 0
        assert claimed >= own - 1e-9, (why, site, "claim below the site's own ledger", claimed, own, rows)
        assert metrics["epsilon"] >= own - 1e-9, (why, site)
