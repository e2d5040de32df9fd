"""Pilot operations (issue #9): ledger reconciliation, provisioning kits, policy files as people write them."""

from __future__ import annotations

import json
import stat
import zipfile
from importlib import metadata
import subprocess
import sys
from pathlib import Path

import pytest

from fedpose.client.ledger import Mechanism, SiteLedger
from support.federation import REPO
from fedpose.server.ledger import Report, ServerLedger, Spend
from fedpose.server.plan import SitePlan
from fedpose.shared.privacy.accounting.accountant import StepRecord, epsilon_spent
from fedpose.shared.privacy.accounting.inspection import reconcile

WHEEL = f"fedpose-{metadata.version('fedpose')}-py3-none-any.whl"  # the wheel a kit carries
MECH = Mechanism(method="fpdp", psi="blur(0.06)", clip_norm=1.0, augment=True)


def _site_ledger(path: Path, site: str, rounds: list[int], federation: str) -> None:
    with SiteLedger(path, site=site) as ledger:
        for r in rounds:
            with ledger.round() as open_round:
                open_round.record(site=site, federation=federation, round=r, sigma=1.2, sample_rate=0.2, steps=2,
                                  delta=1e-3, budget=5.0, accountant="rdp", mechanism=MECH)


def _site_ledger_at(path: Path, site: str, rounds: list[int], federation: str, *, delta: float,
                    accountant: str = "rdp") -> None:
    with SiteLedger(path, site=site) as ledger:
        for r in rounds:
            with ledger.round() as open_round:
                open_round.record(site=site, federation=federation, round=r, sigma=1.2, sample_rate=0.2, steps=2,
                                  delta=delta, budget=5.0, accountant=accountant, mechanism=MECH)


def _server_ledger(path: Path, sites: list[str], rounds: int, *, reports: dict[str, float] | None = None,
                   delta: float = 1e-3) -> str:
    ledger = ServerLedger(path)
    ledger.set_meta("federation", "fed1")
    ledger.save_plans([SitePlan(site=s, epsilon=5.0, delta=delta, sample_rate=0.2, steps_per_round=2, rounds=3,
                                sigma=1.2, accountant="rdp", site_min_sigma=1.0) for s in sites])
    for r in range(1, rounds + 1):
        ledger.record_round(r, [Spend(site=s, sigma=1.2, sample_rate=0.2, steps=2, site_epsilon=None,
                                      aggregated=True) for s in sites], [])
    for site, eps in (reports or {}).items():
        ledger.record_round(rounds + 1, [], [], None, [Report(site=site, source="refusal", site_epsilon=eps,
                                                               run_epsilon=eps, site_rounds=rounds + 1)])
    ledger.close()
    return "fed1"


def test_reconcile_finds_a_round_the_server_never_saw_and_flags_under_reporting(tmp_path):
    """The SuperLink crash of issue #9: site B committed round 2, the server recorded round 1 only."""
    server = tmp_path / "server.sqlite"
    _server_ledger(server, ["a", "b"], rounds=1)
    _site_ledger(tmp_path / "a.sqlite", "a", [1], "fed1")
    _site_ledger(tmp_path / "b.sqlite", "b", [1, 2], "fed1")
    _site_ledger(tmp_path / "b.sqlite", "b", [1], "an-earlier-federation")  # lifetime, not this run
    result = reconcile(server, [tmp_path / "a.sqlite", tmp_path / "b.sqlite"])
    a, b = result.sites
    assert not a.under_reported and a.only_at_site == [] and a.only_at_server == []
    two = epsilon_spent([StepRecord(sigma=1.2, sample_rate=0.2, steps=4)], delta=1e-3)
    assert b.only_at_site == [2] and b.site_run == pytest.approx(two) and b.under_reported
    assert b.site_lifetime > b.site_run
    assert not result.ok and any("UNDER-REPORTED" in line for line in result.lines())
    # The CLI prints it and fails.
    run = subprocess.run([sys.executable, "-m", "fedpose.cli.main", "ledger", "--reconcile", str(server),
                          str(tmp_path / "a.sqlite"), str(tmp_path / "b.sqlite")], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 1 and "round 2: spent at the site" in run.stdout, run.stdout + run.stderr

    # Once B's refusal reported its spend, the server's claim covers it: reconciled.
    server2 = tmp_path / "server2.sqlite"
    _server_ledger(server2, ["a", "b"], rounds=1, reports={"b": two})
    result = reconcile(server2, [tmp_path / "a.sqlite", tmp_path / "b.sqlite"])
    assert result.ok and result.sites[1].only_at_site == [2]
    run = subprocess.run([sys.executable, "-m", "fedpose.cli.main", "ledger", "--reconcile", str(server2),
                          str(tmp_path / "b.sqlite"), "--json"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and json.loads(run.stdout)["ok"] is True


def test_reconcile_reads_each_sites_epsilon_at_its_own_delta_and_accountant(tmp_path):
    """#21 finding 6: a server ledger planning delta 0.2 made a site ledger worth a large eps at its own delta
    1e-5 read as a small one, and "reconciled". Each site's epsilon comes from its own rows' delta and
    accountant; a server (eps, delta) that does not dominate the site's is flagged."""
    server = tmp_path / "server.sqlite"
    _server_ledger(server, ["a"], rounds=3, delta=0.2)
    _site_ledger_at(tmp_path / "a.sqlite", "a", [1, 2, 3], "fed1", delta=1e-5)
    result = reconcile(server, [tmp_path / "a.sqlite"])
    (a,) = result.sites
    own = epsilon_spent([StepRecord(sigma=1.2, sample_rate=0.2, steps=6)], delta=1e-5)
    planned = epsilon_spent([StepRecord(sigma=1.2, sample_rate=0.2, steps=6)], delta=0.2)
    assert a.site_run == pytest.approx(own) and own > 2 * planned
    assert a.site_delta == 1e-5 and a.server_delta == 0.2
    assert a.under_reported and not result.ok
    assert any("delta" in line and "UNDER-REPORTED" in line for line in result.lines())
    # the same server ledger at the site's own delta reconciles
    fair = tmp_path / "fair.sqlite"
    _server_ledger(fair, ["a"], rounds=3, delta=1e-5)
    assert reconcile(fair, [tmp_path / "a.sqlite"]).ok


def test_reconcile_refuses_a_site_ledger_of_an_unknown_site(tmp_path):
    server = tmp_path / "server.sqlite"
    _server_ledger(server, ["a"], rounds=1)
    _site_ledger(tmp_path / "z.sqlite", "z", [1], "fed1")
    with pytest.raises(ValueError, match="not in the server ledger"):
        reconcile(server, [tmp_path / "z.sqlite"])
    with pytest.raises(ValueError, match="does not exist"):
        reconcile(server, [tmp_path / "missing.sqlite"])


def test_provision_writes_kits_without_any_site_private_key_and_refuses_a_git_tree(tmp_path):
    """Each site makes its own key pair (``fedpose site keygen``): the operator never holds a site's private key."""
    import shutil

    from fedpose.server.kits.provision import Federation, provision
    from fedpose.shared.configuration.schema import config_from_dict

    cfg = config_from_dict({})
    kits = provision(tmp_path / "kits", Federation(sites=("hospital-a", "hospital-b"), hosts=("server.example.org",),
                                                   port=8000), cfg)
    assert set(kits) == {"server", "hospital-a", "hospital-b"}
    for site in ("hospital-a", "hospital-b"):
        kit = kits[site]
        assert sorted(p.name for p in kit.iterdir()) == ["README.txt", "ca.crt", "constraints.txt",
                                                         WHEEL, "fedpose-supernode.service",
                                                         "kit.json", "policy.yaml", "start-supernode.sh"]
        # what the site installs from, and the README's command for it (tests/test_site_kit.py runs it)
        assert (kit / "constraints.txt").read_text() == (REPO / "constraints.txt").read_text()
        with zipfile.ZipFile(kit / WHEEL) as wheel:
            assert {"fedpose/server/server_app.py", "fedpose/configs/default.yaml"} <= set(wheel.namelist())
        readme = (kit / "README.txt").read_text()
        assert f"/opt/fedpose/venv/bin/pip install -c constraints.txt './{WHEEL}[train]'" in readme
        assert json.loads((kit / "kit.json").read_text())["superlink"] == "server.example.org:8000"
        assert "server.example.org:8000" in (kit / "start-supernode.sh").read_text()
        text = (kit / "policy.yaml").read_text()
        assert f"site: {site}" in text and f"steps_per_round: {cfg.federation.local_steps}" in text
        assert f"expected_batch: {cfg.train.batch_size}" in text and "ledger_path: /var/lib/fedpose/" in text
        readme = (kit / "README.txt").read_text()
        for step in ("fedpose site keygen --out .", "fedpose site set-data --policy policy.yaml",
                     "fedpose site approve-public --policy policy.yaml", "fedpose site check --policy policy.yaml",
                     "systemctl daemon-reload && systemctl enable --now", "journalctl -u", "fedpose site status"):
            assert step in readme, step
        unit = (kit / "fedpose-supernode.service").read_text()
        for line in ("User=fedpose", "StateDirectory=fedpose/" + site, "ExecStart=/opt/fedpose/" + site,
                     "Environment=FEDPOSE=/opt/fedpose/venv/bin/fedpose",
                     f"Environment=FLWR_HOME=/var/lib/fedpose/{site}/flwr"):
            assert line in unit, line
        if shutil.which("systemd-analyze"):  # systemd's own parser; else the keys above are what it would read
            done = subprocess.run(["systemd-analyze", "verify", str(kit / "fedpose-supernode.service")],
                                  capture_output=True, text=True, timeout=60)
            bad = [line for line in done.stderr.splitlines() if "fedpose-supernode.service" in line
                   and "is not executable" not in line and "No such file" not in line]
            assert not bad, done.stderr
    server = kits["server"]
    assert (server / WHEEL).is_file() and (server / "constraints.txt").is_file()
    for key in ("ca.key", "server.key"):
        assert stat.S_IMODE((server / key).stat().st_mode) == 0o600
    assert not list(server.glob("node-*")) and not list(tmp_path.rglob("node.key"))  # no private key of any site
    assert (server / "site-keys").is_dir()
    # The SuperLink's own SuperExec dials it on 127.0.0.1: without that name in the server certificate the
    # TLS handshake fails and every run stays "pending" (found by following the deployment guide).
    from cryptography import x509

    cert = x509.load_pem_x509_certificate((server / "server.pem").read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "server.example.org" in names.get_values_for_type(x509.DNSName)
    assert "localhost" in names.get_values_for_type(x509.DNSName)
    assert "127.0.0.1" in [str(ip) for ip in names.get_values_for_type(x509.IPAddress)]
    register = (server / "register-sites.sh").read_text()
    assert "--sites hospital-a hospital-b" in register and "site-nodes.tsv" in register
    # the sites' address caps request bodies at the federation's largest reply (tests/test_superlink_front.py)
    from fedpose.server.front import body_limit_mib

    assert f" --max-body-mib {body_limit_mib(cfg)} " in (server / "start-superlink.sh").read_text()

    with pytest.raises(ValueError, match="git work tree"):
        provision(REPO / "runs" / "kits-test", Federation(sites=("a",), hosts=("x",), port=8000), cfg)
    with pytest.raises(ValueError, match="not empty"):
        provision(tmp_path / "kits", Federation(sites=("a",), hosts=("x",), port=8000), cfg)
    with pytest.raises(ValueError, match="distinct"):
        provision(tmp_path / "kits2", Federation(sites=("a", "a"), hosts=("x",), port=8000), cfg)
    assert not (REPO / "runs" / "kits-test").exists()


def test_fedpose_certs_refuses_to_write_keys_into_the_repository(tmp_path):
    run = subprocess.run([sys.executable, "-m", "fedpose.cli.main", "certs", "--out", str(REPO / "certs-test"),
                          "--nodes", "1"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "git work tree" in run.stderr
    assert not (REPO / "certs-test").exists()


def test_policy_files_as_people_write_them(tmp_path):
    """Issue #9.10: `delta: 1e-5` written by hand is a number; a binary file's error names the file."""
    from fedpose.client.policy import load_policy

    text = """policy_version: 3
site: hospital-a
epsilon: 0.8
delta: 1e-5
lifetime_rounds: 5
rounds_per_federation: 5
sample_rate: 0.16
expected_batch: 64
steps_per_round: 10
clip_norm: 1
psi: blur
psi_min: 0.03
augment: true
data_path: data/site
ledger_path: ledger.sqlite
"""
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    policy = load_policy(path)
    assert policy.delta == 1e-5 and policy.clip_norm == 1.0
    assert policy.data_path == str((tmp_path / "data" / "site").resolve())
    binary = tmp_path / "policy.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ValueError, match="policy.bin"):
        load_policy(binary)


# ---------------------------------------------------------------------------
# item 8: the server's needs as explicit steps; evaluation at the sites
# ---------------------------------------------------------------------------


def test_an_unprepared_server_stops_at_once_naming_the_command_and_generates_nothing(tmp_path, monkeypatch):
    from support.federation import tiny_config
    from fedpose.server.prepare import require_prepared
    from fedpose.shared.errors import ConfigError
    from fedpose.shared.configuration.schema import replace

    cfg = tiny_config(tmp_path / "abs")
    with pytest.raises(ConfigError, match="fedpose server prepare") as info:
        require_prepared(cfg)
    assert str(tmp_path / "abs" / "data" / "public") in str(info.value)
    assert "no pretrained weights at" in str(info.value)
    assert not (tmp_path / "abs" / "data").exists() and not (tmp_path / "abs" / "pretrained").exists()
    # Relative paths would follow the SuperLink's working directory: refused, with that directory named.
    monkeypatch.chdir(tmp_path)
    relative = replace(cfg, **{"data.root": "runs/data", "pretrain.out": "runs/pretrained"})
    with pytest.raises(ConfigError, match=r"data.root = 'runs/data' is relative") as info:
        require_prepared(relative)
    assert str(tmp_path) in str(info.value)


def test_fedpose_server_prepare_makes_the_public_data_and_weights_in_steps(tmp_path, capsys):
    from fedpose.cli.main import main
    from support.federation import tiny_dict
    from fedpose.server.prepare import require_prepared
    from fedpose.shared.configuration.schema import load_config

    (tmp_path / "cfg.yaml").write_text(json.dumps(tiny_dict(tmp_path / "server")))
    assert main(["server", "prepare", "--config", str(tmp_path / "cfg.yaml"), "--out", str(tmp_path / "srv"),
                 "--quiet"]) == 0
    out = capsys.readouterr().out
    steps = [line for line in out.splitlines() if line.startswith("[")]
    assert [s[:5] for s in steps] == ["[1/3]", "[2/3]", "[3/3]"], out
    assert "generating the synthetic ward" in out and "pretraining on the public split only" in out
    assert f"{tmp_path / 'server' / 'data' / 'public'}: 60 records, digest " in out
    assert "validation split" in out and "must be public data" in out
    cfg = load_config(tmp_path / "srv" / "server.yaml")
    assert Path(cfg.data.root).is_absolute() and Path(cfg.pretrain.out).is_absolute()
    require_prepared(cfg)  # what the ServerApp checks first now passes
    # A second run finds everything in place and says so (no second pretraining).
    assert main(["server", "prepare", "--config", str(tmp_path / "srv" / "server.yaml"), "--out",
                 str(tmp_path / "srv"), "--quiet"]) == 0
    assert "present, made with this config" in capsys.readouterr().out


def test_a_site_evaluates_the_global_model_on_its_held_out_data_and_keeps_the_numbers(tmp_path, tmp_path_factory):
    import shutil

    from fedpose.client.site import handle_train
    from fedpose.client.evaluation import evaluation_log
    from support.federation import prepare_world, world_root
    from fedpose.shared.configuration.schema import replace
    from fedpose.shared.data.mpii import load_split
    from fedpose.shared.flower.messages import ARRAYS, CONFIG, METRICS, REPLY_METRICS, TrainRequest, weights_record
    from fedpose.shared.training.runs import initial_model
    from support.site import site_policy, q_of

    cfg = prepare_world(world_root(tmp_path_factory))
    state = {k: v.clone() for k, v in initial_model(cfg, progress=False).state_dict().items()}
    held_out = tmp_path / "held-out"
    shutil.copytree(Path(cfg.data.root) / "val", held_out)  # stands in for the site's own held-out split
    policy = site_policy(cfg, tmp_path, eval_path=str(held_out))
    from flwr.app import RecordDict

    cfg = replace(cfg, **{"train.method": "dpsgd"})
    replies = []
    for rnd in (1, 2):
        request = TrainRequest(federation="fed-eval", round=rnd, site="site-0", sigma=5.0, sample_rate=q_of(cfg),
                               steps=1, basis_version=0, basis_mode="broadcast", config=cfg)
        replies.append(handle_train(RecordDict({ARRAYS: weights_record(state), CONFIG: request.to_record()}), policy))
    rows = [json.loads(line) for line in evaluation_log(policy).read_text().splitlines()]
    assert [(r["federation"], r["round"]) for r in rows] == [("fed-eval", 1), ("fed-eval", 2)]
    assert rows[0]["records"] == len(load_split(held_out.parent, held_out.name))
    assert 0.0 <= rows[0]["pckh_mean"] <= 100.0
    assert rows[0]["pckh_mean"] == rows[1]["pckh_mean"]  # the same global weights were sent twice
    for reply in replies:  # nothing about the evaluation travels: the reply carries exactly what it did before
        assert set(reply[METRICS].keys()) == set(REPLY_METRICS)
        assert set(reply.keys()) == {ARRAYS, METRICS}
    # A refused request (here: past the policy's 2 rounds) is never evaluated: no work, no row.
    from fedpose.shared.flower.messages import Refusal

    request = TrainRequest(federation="fed-eval", round=3, site="site-0", sigma=5.0, sample_rate=q_of(cfg), steps=1,
                           basis_version=0, basis_mode="broadcast", config=cfg)
    with pytest.raises(Refusal):
        handle_train(RecordDict({ARRAYS: weights_record(state), CONFIG: request.to_record()}), policy)
    assert len(evaluation_log(policy).read_text().splitlines()) == 2


def _info(**changes):
    from fedpose.shared.flower.messages import SiteInfo

    base = dict(site="a", epsilon=2.0, delta=1e-3, lifetime_rounds=6, rounds_per_federation=6, rounds_done=0,
                epsilon_spent=0.0, min_sigma=0.9, sample_rate=0.2, steps_per_round=2, clip_norm=1.0, psi="blur",
                psi_min=0.03, augment=True, accountant="rdp", methods=("dpsgd", "fpdp"))
    return SiteInfo(**{**base, **changes})


def test_policy_changes_are_events_and_a_plan_that_no_longer_fits_is_not_asked_again(tmp_path):
    """Item 7: a site that edits its policy mid-federation (or while the server is down) shows up as a
    policy-changed event naming each field; a change the plan no longer satisfies marks it refused."""
    from support.federation import tiny_config
    from fedpose.server.policy_watch import watch
    from fedpose.server.report import write_plot, write_report

    cfg = tiny_config(tmp_path / "data", federation={"local_steps": 2})
    path = tmp_path / "server.sqlite"
    ledger = ServerLedger(path)
    ledger.save_plans([SitePlan(site=s, epsilon=2.0, delta=1e-3, sample_rate=0.2, steps_per_round=2, rounds=3,
                                sigma=1.2, accountant="rdp", site_min_sigma=0.9) for s in ("a", "b")])
    assert watch(ledger, ledger.plans(), {"a": _info(), "b": _info(site="b")}, cfg) == []  # first sight: stored
    # Spend moves every round: not a policy change.
    assert watch(ledger, ledger.plans(), {"a": _info(rounds_done=1, epsilon_spent=0.5)}, cfg) == []
    # A loosened policy (more budget, a smaller minimum sigma): an event; the plan still fits, the site stays.
    events = watch(ledger, ledger.plans(), {"a": _info(epsilon=3.0, min_sigma=0.7)}, cfg)
    assert [(e.site, e.kind) for e in events] == [("a", "policy-changed")]
    assert "epsilon: 2.0 -> 3.0" in events[0].reason and "min_sigma: 0.9 -> 0.7" in events[0].reason
    assert ledger.statuses()["a"][0] == "active"
    ledger.record_round(1, [], events)
    ledger.close()
    # The server restarts (resume): b raised its minimum sigma above the plan's while it was down.
    ledger = ServerLedger(path)
    events = watch(ledger, ledger.plans(),
                   {"a": _info(epsilon=3.0, min_sigma=0.7), "b": _info(site="b", min_sigma=1.5)}, cfg)
    assert [(e.site, e.kind) for e in events] == [("b", "policy-changed")]
    status, reason = ledger.statuses()["b"]
    assert status == "refused" and "needs sigma >= 1.5" in reason and "1.2" in reason
    ledger.record_round(2, [], events)
    # Asked again next round: nothing changed, so it stays out (a refusal its declaration cannot explain is not
    # retried); once it lowers the floor back it fits the plan again and rejoins.
    assert watch(ledger, ledger.plans(), {"b": _info(site="b", min_sigma=1.5)}, cfg) == []
    assert ledger.statuses()["b"][0] == "refused"
    events += watch(ledger, ledger.plans(), {"b": _info(site="b", min_sigma=0.9)}, cfg)
    assert ledger.statuses()["b"] == ("active", "its policy changed and fits the plan again")
    ledger.record_round(2, [], events[1:])
    # A method withdrawn is a change the plan cannot meet either.
    events = watch(ledger, ledger.plans(), {"a": _info(epsilon=3.0, min_sigma=0.7, methods=("dpsgd",))}, cfg)
    assert "methods: ['dpsgd', 'fpdp'] -> ['dpsgd']" in events[0].reason
    assert ledger.statuses()["a"] == ("refused", "its policy changed: does not allow method fpdp (allows ['dpsgd'])")
    ledger.record_round(3, [], events)
    # report.md lists the changes; the plot marks them (it differs from the same plot without events).
    rows = ledger.events()
    assert [r["kind"] for r in rows] == ["policy-changed"] * 4
    metrics = {"federation": "f", "rounds": 0, "method": "fpdp", "strategy": "full", "basis_mode": "site",
               "pckh_mean": 40.0, "initial_pckh_mean": 39.0, "claim": "c", "sites": {}}
    report = write_report(tmp_path / "report.md", records=[], metrics=metrics, events=rows, plot="p.png",
                          plans={s: p.to_dict() for s, p in ledger.plans().items()}).read_text()
    assert "| 2 | b | policy-changed | 0 | min_sigma: 0.9 -> 1.5 |" in report
    records = [{"round": r, "pckh_mean": 40.0 + r, "epsilon": {"a": 0.1 * r}} for r in (1, 2, 3)]
    plain = write_plot(tmp_path / "plain.png", records, {"a": 2.0}).read_bytes()
    marked = write_plot(tmp_path / "marked.png", records, {"a": 2.0}, events=rows).read_bytes()
    assert plain != marked
    ledger.close()


def test_an_unfilled_kit_policy_says_which_command_fills_it_in_one_line(tmp_path, capsys):
    """The kit's template leaves data_path, sample_rate, public_path and public_digest: each has a command."""
    from fedpose.cli.main import main
    from fedpose.server.kits.provision import Federation, provision
    from fedpose.shared.configuration.schema import config_from_dict

    kits = provision(tmp_path / "kits", Federation(sites=("a",), hosts=("127.0.0.1",), port=8000), config_from_dict({}))
    policy = kits["a"] / "policy.yaml"
    assert main(["site", "check", "--policy", str(policy)]) == 3
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "sample_rate, data_path, public_path, public_digest still say FILL-ME" in err
    assert f"fedpose site set-data --policy {policy} DATA_DIR" in err and "fedpose site approve-public" in err
    assert main(["site", "status", "--policy", str(policy)]) == 1  # unhealthy, and says why
    assert "FILL-ME" in capsys.readouterr().out


def test_a_lost_ledger_is_refused_not_silently_recreated(tmp_path, capsys):
    """Losing the ledger would reset the lifetime budget: once a site had one, its checks refuse a missing or
    replaced ledger until the backup is restored."""
    import shutil

    from fedpose.cli.main import main
    from support.federation import prepare_world
    from support.site import site_policy

    cfg = prepare_world(tmp_path / "world")
    policy = site_policy(cfg, tmp_path / "site", prepare=False)
    from fedpose.client.policy import write_policy

    path = write_policy(tmp_path / "site" / "policy.yaml", policy)
    assert main(["site", "check", "--policy", str(path)]) == 0
    assert (tmp_path / "site" / "ledger.id").is_file()
    ledger = Path(policy.ledger_path)
    shutil.copy(ledger, tmp_path / "backup.sqlite")
    ledger.unlink()
    capsys.readouterr()
    assert main(["site", "check", "--policy", str(path)]) == 4  # refused: a lost ledger
    assert "is missing, but this site had one" in capsys.readouterr().err
    assert not ledger.exists()  # not re-created
    shutil.copy(tmp_path / "backup.sqlite", ledger)  # restored from its backup
    assert main(["site", "check", "--policy", str(path)]) == 0
    other = tmp_path / "other.sqlite"
    from fedpose.client.ledger import SiteLedger

    with SiteLedger(other, site=policy.site) as fresh:
        fresh.ledger_id()
    shutil.copy(other, ledger)  # another ledger put in its place
    assert main(["site", "check", "--policy", str(path)]) == 4
    assert "is not the ledger this site had" in capsys.readouterr().err


def test_site_start_starts_again_a_supernode_that_gave_up_on_its_superlink_and_exited_cleanly(tmp_path):
    """Flower's SuperNode exits with 0 ("terminated gracefully") when it loses a SuperLink it had joined and
    gives up reconnecting; only a stop the site asked for ends the supervision, so it is started again."""
    runs = tmp_path / "runs"
    child = tmp_path / "supernode.py"
    # first run: the clean exit after giving up; second run: a usage error (2), which ends the supervision
    child.write_text("import pathlib, sys\n"
                     f"runs = pathlib.Path({str(runs)!r})\n"
                     "n = len(runs.read_text()) if runs.exists() else 0\n"
                     "runs.write_text('x' * (n + 1))\n"
                     "sys.exit(0 if n == 0 else 2)\n")
    code = ("import sys\nfrom fedpose.client.supernode import supervise\n"
            f"sys.exit(supervise([sys.executable, {str(child)!r}], {{}}, retry_for=30, pause=0))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert runs.read_text() == "xx", done.stdout + done.stderr
    assert done.returncode == 2
    assert "starting it again" in done.stdout


def test_the_operator_exports_the_public_split_and_a_site_approves_it_by_its_digest(tmp_path, tmp_path_factory):
    """How the public split reaches a site: ``fedpose server export-public`` writes it as one archive and prints its
    digest; the site unpacks the archive and approves the copy with ``site approve-public --digest``, which refuses
    a copy whose images differ from the digest the operator sent, leaving the policy as it was."""
    import re
    import shutil
    import tarfile

    import cv2
    import yaml

    from support.federation import prepare_world, world_root
    from support.site import public_digest_of
    from fedpose.shared.configuration.schema import dump_config

    cfg = prepare_world(world_root(tmp_path_factory))
    config = tmp_path / "server.yaml"
    dump_config(cfg, config)
    archive = tmp_path / "srv" / "public-split.tar.gz"

    def fedpose(*args: str, cwd: Path = tmp_path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "fedpose.cli.main", *args], cwd=cwd, capture_output=True,
                              text=True, timeout=300)

    done = fedpose("server", "export-public", "--config", str(config), "--out", str(archive))
    assert done.returncode == 0, done.stdout + done.stderr
    (digest,) = set(re.findall(r"digest ([0-9a-f]{64})", done.stdout))
    assert digest == public_digest_of(cfg)
    site = tmp_path / "site"
    site.mkdir()
    subprocess.run(["tar", "-xzf", str(archive), "-C", str(site)], check=True, timeout=60)  # as the kit says
    with tarfile.open(archive) as tar:
        assert all(name == "public-split" or name.startswith("public-split/") for name in tar.getnames())
    copy = site / "public-split"
    policy = site / "policy.yaml"
    data = Path(cfg.data.root)
    assert fedpose("site-policy", "--out", str(policy), "--site", "site-0", "--epsilon", "2.0", "--delta", "1e-3",
                   "--lifetime-rounds", "2", "--data-path", str(data / "site-0"), "--ledger-path",
                   str(site / "ledger.sqlite"), "--sample-rate", "0.2", "--expected-batch", "8",
                   "--steps-per-round", "2", "--psi-min", repr(cfg.privacy.psi_param),
                   "--public-path", str(data / "public")).returncode == 0

    # a copy whose images are not the operator's: refused, the policy untouched
    tampered = site / "tampered"
    shutil.copytree(copy, tampered)
    image = sorted((tampered / "images").iterdir())[0]
    pixels = cv2.imread(str(image))
    pixels[0, 0] = 255 - pixels[0, 0]
    cv2.imwrite(str(image), pixels)
    before = policy.read_text()
    done = fedpose("site", "approve-public", "--policy", str(policy), "--digest", digest, str(tampered))
    assert done.returncode == 3, done.stdout + done.stderr
    assert "does not match" in done.stderr and digest in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert policy.read_text() == before

    done = fedpose("site", "approve-public", "--policy", str(policy), "--digest", digest, str(copy))
    assert done.returncode == 0, done.stdout + done.stderr
    written = yaml.safe_load(policy.read_text())
    assert written["public_path"] == str(copy) and written["public_digest"] == digest
    done = fedpose("site", "check", "--policy", str(policy))
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_kit_site_names_itself_and_a_missing_data_folder_is_called_missing(tmp_path, capsys):
    """``site status`` of a kit whose policy is not filled in yet still names the site; ``site set-data`` with a
    folder that does not exist says so (exit 3), not that it is "not a split directory"; ``site keygen`` names
    the step the operator's kit uses to register the key."""
    from fedpose.cli.main import main
    from fedpose.server.kits.provision import Federation, provision
    from fedpose.shared.configuration.schema import config_from_dict

    kits = provision(tmp_path / "kits", Federation(sites=("hospital-a",), hosts=("127.0.0.1",), port=8000),
                     config_from_dict({}))
    policy = kits["hospital-a"] / "policy.yaml"
    capsys.readouterr()
    assert main(["site", "status", "--policy", str(policy)]) == 1
    assert capsys.readouterr().out.startswith("site hospital-a: NEEDS ATTENTION")
    missing = tmp_path / "no-such-split"
    assert main(["site", "set-data", "--policy", str(policy), str(missing)]) == 3
    err = capsys.readouterr().err
    assert "does not exist" in err and str(missing) in err and "not a split directory" not in err, err
    assert main(["site", "keygen", "--out", str(tmp_path / "key")]) == 0
    out = capsys.readouterr().out
    assert "register-sites" in out and "flwr supernode register" not in out, out


def test_a_loopback_federation_listens_on_loopback_and_no_kit_runs_its_site_as_root(tmp_path):
    """``provision --host 127.0.0.1`` (a pilot on one machine) puts the sites' address on 127.0.0.1 too, not on
    every interface; a public host name keeps 0.0.0.0. ``--user root`` is refused, naming the value, before any
    kit is written (a kit would otherwise tell the site to `useradd ... root` and run its SuperNode as root)."""
    from fedpose.server.kits.provision import Federation, Install, provision
    from fedpose.shared.configuration.schema import config_from_dict

    cfg = config_from_dict({})
    local = provision(tmp_path / "local", Federation(sites=("a",), hosts=("127.0.0.1",), port=8000), cfg)
    script = (local["server"] / "start-superlink.sh").read_text()
    assert "--listen 127.0.0.1:8000" in script and "0.0.0.0" not in script, script
    public = provision(tmp_path / "public", Federation(sites=("a",), hosts=("fed.example.org",), port=8000), cfg)
    assert "--listen 0.0.0.0:8000" in (public["server"] / "start-superlink.sh").read_text()
    with pytest.raises(ValueError, match="--user root"):
        provision(tmp_path / "root", Federation(sites=("a",), hosts=("fed.example.org",), port=8000), cfg,
                  install=Install(user="root"))
    assert not (tmp_path / "root").exists()


def test_a_running_federations_status_says_its_guarantee_and_the_console_rounds_as_the_cli(tmp_path):
    """Before a run finishes (no metrics.json, so no claim yet) ``fedpose server status`` says which guarantee the
    federation runs under, from the config the server wrote; and the console's number format (its own
    JavaScript, run by node) rounds a tie as the command line does (30.625 -> 30.62, never 30.63)."""
    import re
    import shutil

    from fedpose.shared.configuration.schema import config_from_dict, dump_config

    out = tmp_path / "run"
    out.mkdir()
    _server_ledger(out / "ledger.sqlite", ["site-0", "site-1"], 1)
    dump_config(config_from_dict({"train": {"method": "proj"}}), out / "config.yaml")
    done = subprocess.run([sys.executable, "-m", "fedpose.cli.main", "server", "status", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"^guarantee: record-level DP \(proj, record level\), each site within its own budget",
                     done.stdout, re.M), done.stdout

    node = shutil.which("node")
    if node is None:
        pytest.skip("node runs the console's formatter; not installed")
    page = (REPO / "shared" / "console.html").read_text()
    (fmt,) = re.findall(r"^const fmt = .*$", page, re.M)
    script = fmt + "\nconsole.log([30.625, 30.635, 0.125, 2.675, 1.5, -0.125].map((v) => fmt(v, 2)).join(' '));\n"
    js = subprocess.run([node, "-e", script], capture_output=True, text=True, timeout=60)
    assert js.returncode == 0, js.stderr
    want = " ".join(f"{v:.2f}" for v in (30.625, 30.635, 0.125, 2.675, 1.5, -0.125))
    assert js.stdout.strip() == want


def test_server_run_into_a_folder_that_holds_a_federation_says_so_before_submitting(tmp_path):
    """``fedpose server run`` with an --out whose federation ran before (and no --resume) stops at once, exit 3,
    naming --resume and another --out; it submits nothing and prints none of the old rounds as if they were new."""
    out = tmp_path / "run1"
    out.mkdir()
    _server_ledger(out / "ledger.sqlite", ["site-0", "site-1"], 1)
    (out / "rounds.jsonl").write_text(json.dumps({"round": 1, "pckh_mean": 30.0, "accepted": ["site-0"]}) + "\n")
    app = tmp_path / "app"
    app.mkdir()
    (app / "pyproject.toml").write_text("[project]\nname = 'app'\n")
    from support.federation import flower_env

    done = subprocess.run([sys.executable, "-m", "fedpose.cli.main", "server", "run", "--connection", "pilot",
                           "--out", str(out), "--app", str(app), "--config", str(tmp_path / "server.yaml")],
                          capture_output=True, text=True, timeout=300, env=flower_env(tmp_path / "flwr-home"))
    assert done.returncode == 3, done.stdout + done.stderr
    assert "already holds a federation" in done.stderr and "--resume" in done.stderr, done.stderr
    assert "round 1" not in done.stdout and "submitted" not in done.stdout, done.stdout
