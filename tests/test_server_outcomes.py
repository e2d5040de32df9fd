"""How a federation ends, as the server's operator sees it: which site paid for a round that was thrown away,
whether sites are asked to train when too few can take part, the sites' labels after a finish, the run's
state after a failure, and where ``server prepare --out`` writes.

The federations here run the server's real round loop over the sites' real handlers and SQLite ledgers, in
process (``support.federation.InProcessGrid``); a site that dies mid-round is a node that stays listed but
never answers again, as a SuperNode killed before its heartbeat lapsed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from support.federation import REPO, InProcessGrid, ledger_rows, prepare_world, world_root


class DyingGrid(InProcessGrid):
    """Node ``dies`` stops answering anything once it receives its train message of round ``at``; it stays listed."""

    def __init__(self, run_config: dict, sites: int, *, dies: int, at: int) -> None:
        super().__init__(run_config, sites)
        self.dies, self.at, self.dead = dies, at, False

    def push_messages(self, messages):
        from fedpose.shared.flower.messages import CONFIG

        live, ids = [], []
        for message in messages:
            if message.metadata.dst_node_id == self.dies:
                config = message.content.config_records.get(CONFIG)
                if config is not None and int(config.get("round", 0)) >= self.at:
                    self.dead = True
                if self.dead:
                    self.sent += 1
                    ids.append(f"lost{self.sent}")  # pushed, never answered
                    continue
            live.append(message)
        return ids + super().push_messages(live)


def _federation(tmp_path: Path, tmp_path_factory, **changes):
    from fedpose.cli.local_federation import prepare_simulation
    from fedpose.shared.configuration.schema import replace

    cfg = prepare_world(world_root(tmp_path_factory))
    out = tmp_path / "fed"
    cfg = replace(cfg, **{"federation.out": str(out), **changes})
    config_path = prepare_simulation(cfg, out, progress=False)
    return cfg, out, {"config": str(config_path), "overrides": "", "out": str(out), "resume": False}


def test_a_site_that_paid_for_a_discarded_round_is_named_and_nobody_trains_alone(tmp_path, tmp_path_factory, caplog):
    """site-1 dies in round 2: site-0's update of round 2 is charged and thrown away (fewer than min_sites);
    the rounds file, the server's log, its status and report.md name site-0 as having paid for nothing. In
    round 3 site-1 does not answer: site-0 is not asked to train alone; the run stops and says why."""
    import logging

    from fedpose.server.run import run_federation
    from fedpose.server.status import server_status

    cfg, out, run_config = _federation(tmp_path, tmp_path_factory, **{"federation.rounds": 3,
                                                                      "federation.round_timeout": 2.0})
    grid = DyingGrid(run_config, sites=2, dies=2, at=2)
    with caplog.at_level(logging.INFO, logger="fedpose.server"):
        run_federation(grid, cfg, out)
    rounds = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1, 2], rounds
    assert rounds[1]["aggregated"] is False and rounds[1]["discarded"] == ["site-0"], rounds[1]
    # site-0 trained (and spent) in rounds 1 and 2 only: never alone in round 3
    site0 = ledger_rows(out / "sites" / "site-0" / "ledger.sqlite", "SELECT round FROM spend ORDER BY round")
    assert [r[0] for r in site0] == [1, 2]
    text = caplog.text
    assert "round 2: not aggregated" in text and "site-0 paid for" in text, text[-3000:]
    assert "accepted ['site-0']" not in text
    assert "stopping" in text and "site-1" in text
    status = server_status(out)
    assert status["rounds"][1]["discarded"] == ["site-0"]
    kinds = [(e["round"], e["site"], e["kind"]) for e in status["events"]]
    assert (2, "site-0", "discarded") in kinds, kinds
    stopped = [e for e in status["events"] if e["kind"] == "stopped"]
    assert stopped and "site-1" in stopped[0]["reason"] and "min_sites" in stopped[0]["reason"], status["events"]
    report = (out / "report.md").read_text()
    assert "| 2 | site-0 | discarded |" in report, report
    # nobody is left 'active' after the finish: both sites stopped before their planned rounds
    assert {s: v["status"] for s, v in status["sites"].items()} == {"site-0": "stopped", "site-1": "stopped"}


def test_labels_after_a_finish_agree_and_a_spent_budget_ends_in_one_clear_line(tmp_path, tmp_path_factory, capsys):
    """Both sites run every round their policy allows: both read `finished`. A second federation with every
    lifetime round spent stops before training with one line naming each site's reason, and its folder then
    reads `failed` with that reason, never `running`."""
    from fedpose.server.run import run_federation
    from fedpose.server.status import server_status

    cfg, out, run_config = _federation(tmp_path, tmp_path_factory, **{"federation.rounds": 1})
    grid = InProcessGrid(run_config, sites=2)
    metrics = run_federation(grid, cfg, out)
    labels = {s: v["status"] for s, v in metrics["sites"].items()}
    assert labels == {"site-0": "finished", "site-1": "finished"}, metrics["sites"]
    status = server_status(out)
    assert status["state"] == "finished"
    assert {s: v["status"] for s, v in status["sites"].items()} == labels

    again = tmp_path / "again"
    from fedpose.server.outcome import FederationStopped

    with pytest.raises(FederationStopped) as info:
        run_federation(grid, cfg, again)
    message = str(info.value)
    assert "\n" not in message and "no site can take part" in message, message
    assert "site-0" in message and "site-1" in message and "lifetime rounds" in message, message
    status = server_status(again)
    assert status["state"] == "failed" and status["state_reason"] == message, status


def test_a_run_folder_no_server_holds_reads_stopped_not_running(tmp_path):
    """A server killed mid-run leaves no metrics.json: while a process holds the run folder it is `running`,
    once none does it is `stopped`."""
    from fedpose.server.ledger import ServerLedger
    from fedpose.server.status import server_status

    out = tmp_path / "run"
    out.mkdir()
    ledger = ServerLedger(out / "ledger.sqlite")
    ledger.set_meta("federation", "f1")
    ledger.close()
    code = ("import sys, time\nfrom pathlib import Path\nfrom fedpose.server.outcome import sole_server\n"
            f"with sole_server(Path({str(out)!r})):\n    print('held', flush=True)\n    time.sleep(60)\n")
    holder = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert server_status(out)["state"] == "running"
    finally:
        holder.kill()
        holder.wait(timeout=30)
    status = server_status(out)
    assert status["state"] == "stopped" and "no server process holds" in status["state_reason"], status


def test_server_prepare_out_holds_the_ward_and_the_weights(tmp_path, monkeypatch):
    """A config with relative paths (the shipped ones): `server prepare --out DIR` writes everything under DIR,
    nothing under the folder it was started from."""
    from fedpose.cli.main import main
    from support.federation import tiny_dict
    from fedpose.shared.configuration.schema import load_config

    config = tiny_dict(tmp_path)
    config["data"]["root"] = "data/ward"
    config["pretrain"]["out"] = "runs/pretrained"
    (tmp_path / "cfg.yaml").write_text(json.dumps(config))
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    srv = tmp_path / "srv"
    assert main(["server", "prepare", "--config", str(tmp_path / "cfg.yaml"), "--out", str(srv), "--quiet"]) == 0
    assert list(here.iterdir()) == []
    cfg = load_config(srv / "server.yaml")
    assert Path(cfg.data.root) == srv / "data" / "ward" and (srv / "data" / "ward" / "public").is_dir()
    assert Path(cfg.pretrain.out) == srv / "runs" / "pretrained"
    assert (srv / "runs" / "pretrained" / "model.pt").is_file()


def test_sites_that_ran_their_planned_rounds_read_alike_and_none_stays_active(tmp_path, tmp_path_factory):
    """After a finish: two sites that both ran their 2 planned rounds (one reporting a spend a hair above its
    budget, as its own accountant at its own delta may) read the same label; a site the federation left
    after 1 of its 2 rounds reads `stopped`, never `active`, and so does one whose 2nd request got no answer (counted
    as spent, not as done); each reason says what it spent."""
    from fedpose.server.ledger import Report, ServerLedger, Spend, attempted
    from fedpose.server.plan import SitePlan
    from fedpose.server.run import Paths, finish
    from fedpose.shared.data.mpii import load_split
    from fedpose.shared.training.runs import initial_model

    cfg = prepare_world(world_root(tmp_path_factory))
    paths = Paths(tmp_path / "run")
    paths.out.mkdir()
    ledger = ServerLedger(paths.ledger)
    ledger.set_meta("federation", "f1")
    plans = [SitePlan(site=s, epsilon=0.8, delta=1e-3, sample_rate=0.2, steps_per_round=2, rounds=2, sigma=3.0,
                      accountant="rdp", site_min_sigma=1.0) for s in ("a", "b", "c", "d")]
    ledger.save_plans(plans)
    for rnd, sites in ((1, "abcd"), (2, "ab")):
        ledger.record_round(rnd, [Spend(site=s, sigma=3.0, sample_rate=0.2, steps=2, site_epsilon=None,
                                        aggregated=True) for s in sites], [])
    ledger.record_round(2, [attempted(plans[3])], [])
    ledger.record_round(2, [], [], None, [Report(site="b", source="reply", site_epsilon=0.8000001,
                                                 run_epsilon=0.8000001, site_rounds=2)])
    val = load_split(Path(cfg.data.root), cfg.data.val_split)
    metrics = finish(cfg, paths, initial_model(cfg, progress=False), val, ledger, ledger.plans(), [], "f1", seconds=0.0)
    labels = {s: v["status"] for s, v in metrics["sites"].items()}
    assert labels == {"a": "finished", "b": "finished", "c": "stopped", "d": "stopped"}, labels
    reasons = {s: r for s, (_, r) in ledger.statuses().items()}
    assert "2 of 2 planned rounds" in reasons["a"] and "of 0.8" in reasons["a"], reasons
    assert "1 of its 2 planned rounds" in reasons["c"], reasons
    assert "1 of its 2 planned rounds" in reasons["d"] and "1 more asked without an answer" in reasons["d"], reasons
    ledger.close()
