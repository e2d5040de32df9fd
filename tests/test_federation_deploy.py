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

import json
from pathlib import Path

import pytest

from support.federation import Pilot, app_snapshot, bin_path, ledger_rows, prepare_world, start, stop, world_root
from fedpose.shared.configuration.schema import dump_config
from fedpose.shared.privacy.accounting.accountant import StepRecord, epsilon_spent

pytestmark = pytest.mark.slow


def _hostile_bundle(dst: Path, marker: Path) -> Path:
    """This app with a ClientApp that ignores the site's policy and leaves ``marker`` if it is ever imported."""
    app_snapshot(dst)
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


def test_tls_auth_deployment_two_rounds_and_unregistered_node_refused(tmp_path: Path, tmp_path_factory) -> None:
    # Broadcast V, refreshed every 2 rounds: sent in round 1, cached by the sites for round 2.
    cfg = prepare_world(world_root(tmp_path_factory), rounds=2,
                        federation={"local_steps": 1, "basis_mode": "broadcast"}, privacy={"basis_every": 2})
    config_path = tmp_path / "federation.yaml"
    dump_config(cfg, config_path)
    pilot = Pilot(tmp_path, cfg, lifetime_rounds=2)
    try:
        pilot.start_superlink()
        pilot.register(1, 2)
        for i in (0, 1):
            pilot.start_site(i)

        # A node whose key was never registered cannot join: it exits with status 1 (activation refused).
        rogue_log = tmp_path / "supernode-unregistered.log"
        rogue = start([
            bin_path("flower-supernode"), "--root-certificates", str(pilot.certs / "ca.crt"),
            "--superlink", f"127.0.0.1:{pilot.link}", "--auth-supernode-private-key", str(pilot.certs / "node-3"),
            "--node-config", "partition-id=2", "--host", "127.0.0.1", "--port", str(pilot.ports[2]),
        ], rogue_log, pilot.env)
        try:
            code = rogue.wait(timeout=90)
        finally:
            stop(rogue)
        assert code == 1, rogue_log.read_text()[-3000:]
        assert "2004" in rogue_log.read_text()

        out = tmp_path / "out"
        run_id = pilot.submit(pilot.app, f"config='{config_path}' out='{out}'")
        status = pilot.wait_finished(run_id, 420)
        if status != "finished:completed":
            pytest.fail(f"run status {status}:\n{pilot.run_log(run_id)[-6000:]}")

        # The operator submits an altered bundle to the same SuperNodes: both sites refuse to run it.
        ledgers = {i: ledger_rows(pilot.site_ledger(i)) for i in (0, 1)}
        marker = tmp_path / "hostile-ran"
        hostile = _hostile_bundle(tmp_path / "hostile-app", marker)
        run_id = pilot.submit(hostile, f"config='{config_path}' out='{tmp_path / 'out-hostile'}'")
        assert pilot.wait_finished(run_id, 240) != "finished:completed"
    finally:
        pilot.close()

    assert not marker.exists()  # the altered ClientApp was never imported at either site
    for i in (0, 1):
        assert ledger_rows(pilot.site_ledger(i)) == ledgers[i]
        assert "is not approved by this site" in (tmp_path / f"supernode-{i}.log").read_text()

    rounds = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1, 2]
    assert all(r["accepted"] == ["site-0", "site-1"] for r in rounds)
    assert all(r["basis_version"] == 1 for r in rounds)
    from fedpose.shared.model.posenet import build_model
    from fedpose.shared.model.strategy import apply_strategy

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
