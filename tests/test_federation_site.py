"""The site side (P6): its policy, its durable ledger and its refusals, on real files.

Every refusal must leave the ledger unchanged; a site process killed (SIGKILL) while it
trains must leave a consistent ledger that a restarted process continues.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fedpose.client.ledger import SiteLedger
from fedpose.client.policy import load_policy, min_sigma_for, policy_from_dict, sigma_shortfall, write_policy
from fedpose.client.site import handle_train
from fedpose.client.site_data import site_info
from federation_support import REPO, flower_env, prepare_world, start, stop, wait_for, world_root
from fedpose.shared.configuration.schema import dump_config, replace
from fedpose.shared.flower.messages import (
    ARRAYS,
    BASIS,
    CONFIG,
    METRICS,
    Refusal,
    RefusalCode,
    TrainRequest,
    basis_record,
    record_tensors,
    weights_record,
)
from fedpose.shared.privacy.accounting.accountant import StepRecord, epsilon_spent


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from fedpose.shared.model.strategy import apply_strategy
    from fedpose.shared.training.runs import initial_model

    cfg = prepare_world(world_root(tmp_path_factory))
    model = initial_model(cfg, progress=False)
    trainable = apply_strategy(model, cfg.train.strategy)
    named = dict(model.named_parameters())
    p = sum(named[n].numel() for n in trainable)
    return cfg, {k: v.clone() for k, v in model.state_dict().items()}, trainable, p


def _digest(cfg) -> str:
    from fedpose.client.site_data import load_split_dir
    from fedpose.shared.data.split import manifest_digest as public_digest

    return public_digest(load_split_dir(Path(cfg.data.root) / "public", "public set"))


def _policy(cfg, tmp_path: Path, *, max_rounds: int = 2, prepare: bool = True, **overrides):
    """A site policy over the tiny world's site-0; ``prepare``: run the site's own checks (its operator's step)."""
    from fedpose.client.site_data import prepare_site

    data = {
        "policy_version": 3, "site": "site-0", "epsilon": 2.0, "delta": 1e-3, "lifetime_rounds": max_rounds,
        "rounds_per_federation": max_rounds, "sample_rate": _q(cfg), "expected_batch": float(cfg.train.batch_size),
        "steps_per_round": 2,
        "clip_norm": cfg.privacy.clip_norm, "psi": cfg.privacy.psi, "psi_min": cfg.privacy.psi_param,
        "augment": cfg.data.augment,
        "data_path": str(Path(cfg.data.root) / "site-0"), "ledger_path": str(tmp_path / "ledger.sqlite"),
        "public_path": str(Path(cfg.data.root) / "public"), "public_digest": _digest(cfg),
        "release_blurred_images_and_labels": True, "public_batch_size": cfg.train.public_batch_size,
    }
    data.update(overrides)
    policy = policy_from_dict(data)
    if prepare:
        prepare_site(policy)
    return policy


def _request(cfg, state, *, sigma: float, steps: int = 1, round: int = 1, method: str = "dpsgd",
             basis_version: int = 0, basis_mode: str = "broadcast", site: str = "site-0", federation: str = "fed-test",
             sample_rate: float | None = None):
    from flwr.app import RecordDict

    cfg = replace(cfg, **{"train.method": method})
    request = TrainRequest(federation=federation, round=round, site=site, sigma=sigma,
                           sample_rate=_q(cfg) if sample_rate is None else sample_rate, steps=steps,
                           basis_version=basis_version, basis_mode=basis_mode, config=cfg)
    return RecordDict({ARRAYS: weights_record(state), CONFIG: request.to_record()})


def _rows(policy) -> list[dict]:
    with SiteLedger(policy.ledger_path) as ledger:
        return ledger.rows()


def _q(cfg, n: int = 40) -> float:
    return min(1.0, cfg.train.batch_size / n)


def _refusal(content, policy) -> Refusal:
    with pytest.raises(Refusal) as info:
        handle_train(content, policy)
    return info.value


@pytest.mark.invariant("P6")
def test_sigma_at_the_derived_minimum_is_accepted_and_below_it_refused(world, tmp_path):
    cfg, state, _, _ = world
    policy = _policy(cfg, tmp_path)
    q = _q(cfg)
    floor = min_sigma_for(policy)
    # The derived minimum spends at most the budget over its lifetime rounds; 1 % less noise spends more.
    lifetime_steps = policy.lifetime_rounds * policy.steps_per_round
    assert epsilon_spent([StepRecord(sigma=floor, sample_rate=q, steps=lifetime_steps)], delta=policy.delta) <= 2.0
    assert sigma_shortfall(policy, sigma=floor) is None
    assert sigma_shortfall(policy, sigma=0.99 * floor) is not None

    refusal = _refusal(_request(cfg, state, sigma=0.9 * floor), policy)
    assert refusal.code == RefusalCode.WEAKER_NOISE
    assert _rows(policy) == []  # nothing trained, nothing recorded


@pytest.mark.invariant("P6")
def test_a_round_beyond_the_budget_is_refused_and_the_ledger_is_unchanged(world, tmp_path):
    cfg, state, trainable, _ = world
    policy = _policy(cfg, tmp_path, max_rounds=1)
    q = _q(cfg)
    sigma = min_sigma_for(policy)

    reply = handle_train(_request(cfg, state, sigma=sigma), policy)  # the one round it allows
    assert sorted(record_tensors(reply[ARRAYS])) == sorted(trainable)
    metrics = reply[METRICS]
    assert (metrics["sigma"], metrics["sample-rate"], metrics["steps"]) == (sigma, q, 1)
    fresh = epsilon_spent([StepRecord(sigma=sigma, sample_rate=q, steps=1)], delta=policy.delta)
    assert metrics["site-epsilon"] == pytest.approx(fresh, rel=1e-12)
    before = _rows(policy)
    assert len(before) == 1 and before[0]["epsilon"] == pytest.approx(fresh, rel=1e-12)

    refusal = _refusal(_request(cfg, state, sigma=sigma, round=2), policy)  # max_rounds reached
    assert refusal.code == RefusalCode.BUDGET
    assert _rows(policy) == before

    # Enough noise for the site's explicit floor, but the round would overspend its epsilon.
    tight = _policy(cfg, tmp_path / "tight", epsilon=0.5, min_sigma=0.3, max_rounds=5)
    refusal = _refusal(_request(cfg, state, sigma=0.4, steps=2), tight)
    assert refusal.code == RefusalCode.BUDGET
    assert _rows(tight) == []
    assert site_info(tight).rounds_done == 0


def test_a_request_to_scale_tensors_from_the_public_split_is_refused_with_nothing_spent(world, tmp_path):
    """train.tensor_scales: public reads the public split at every refresh, which a site does not hold: refused
    before anything is charged, and a federation will not start with it."""
    from fedpose.server.run import run_federation
    from fedpose.shared.errors import ConfigError

    cfg, state, _, _ = world
    policy = _policy(cfg, tmp_path)
    content = _request(replace(cfg, **{"train.tensor_scales": "public"}), state, sigma=min_sigma_for(policy))
    refusal = _refusal(content, policy)
    assert refusal.code == RefusalCode.BAD_REQUEST and "tensor_scales" in refusal.reason
    assert _rows(policy) == []
    with pytest.raises(ConfigError, match="train.tensor_scales: public is for centralized runs only"):
        run_federation(None, replace(cfg, **{"train.tensor_scales": "public"}), tmp_path / "never-written")


def test_a_request_to_train_low_rank_adapters_is_refused_with_nothing_spent(world, tmp_path):
    """train.strategy: lora makes and merges its adapters inside one centralized run; a round's request names no
    adapters to train: refused before anything is charged, and a federation will not start with it."""
    from fedpose.server.run import run_federation
    from fedpose.shared.errors import ConfigError

    cfg, state, _, _ = world
    policy = _policy(cfg, tmp_path)
    refusal = _refusal(_request(replace(cfg, **{"train.strategy": "lora"}), state, sigma=min_sigma_for(policy)),
                       policy)
    assert refusal.code == RefusalCode.BAD_REQUEST and "lora" in refusal.reason
    assert _rows(policy) == []
    with pytest.raises(ConfigError, match="train.strategy: lora is for centralized runs only"):
        run_federation(None, replace(cfg, **{"train.strategy": "lora"}), tmp_path / "never-written")


def test_a_request_whose_raw_and_psi_pair_would_not_be_one_records_bound_is_refused_with_nothing_spent(world,
                                                                                                      tmp_path):
    """train.images: raw+psi clips a record's image and psi of its crop as one: with fdp / fpdp (their psi term is
    added unclipped) or augmentation multiplicity the run would refuse it after the charge; the site refuses it
    before, and a federation will not start with it."""
    from fedpose.server.run import run_federation
    from fedpose.shared.errors import ConfigError

    cfg, state, _, _ = world
    policy = _policy(cfg, tmp_path)
    for method, change in (("fpdp", {}), ("proj", {"privacy.augment_multiplicity": 2})):
        asked = replace(cfg, **{"train.images": "raw+psi", "train.method": method, **change})
        refusal = _refusal(_request(asked, state, sigma=min_sigma_for(policy), method=method), policy)
        assert refusal.code == RefusalCode.BAD_REQUEST and "raw+psi" in refusal.reason
        assert _rows(policy) == []
        with pytest.raises(ConfigError, match="train.images: raw"):
            run_federation(None, asked, tmp_path / "never-written")


def test_bad_basis_and_missing_basis_are_refused(world, tmp_path):
    cfg, state, _, p = world
    policy = _policy(cfg, tmp_path)
    k = cfg.privacy.k
    sigma = min_sigma_for(policy)
    orthonormal, _ = torch.linalg.qr(torch.randn(p, k, dtype=torch.float64))

    content = _request(cfg, state, sigma=sigma, method="proj", basis_version=1)
    content[BASIS] = basis_record(orthonormal[:-1].float(), version=1, dtype="float32")  # wrong shape
    assert _refusal(content, policy).code == RefusalCode.BAD_BASIS

    content = _request(cfg, state, sigma=sigma, method="proj", basis_version=1)
    content[BASIS] = basis_record((1.5 * orthonormal).float(), version=1, dtype="float16")  # not orthonormal
    assert _refusal(content, policy).code == RefusalCode.BAD_BASIS

    content = _request(cfg, state, sigma=sigma, method="proj", basis_version=1)
    assert _refusal(content, policy).code == RefusalCode.NEED_BASIS  # nothing cached for version 1
    assert _rows(policy) == []

    # A valid V on a request refused at the ledger (it would overspend) is not cached: refused requests under
    # new federation ids cannot fill the site's disk with p x k bases.
    tight = _policy(cfg, tmp_path / "tight", epsilon=0.5, min_sigma=0.3, max_rounds=5)
    for federation in ("probe-a", "probe-b"):
        content = _request(cfg, state, sigma=0.4, steps=2, method="proj", basis_version=1, federation=federation)
        content[BASIS] = basis_record(orthonormal.float(), version=1, dtype="float16")
        assert _refusal(content, tight).code == RefusalCode.BUDGET
    assert _rows(tight) == []
    assert not (tmp_path / "tight" / "basis-cache").exists()


# Following one train message through the code: the functions of ours it enters, per module (dunders and
# comprehensions left out). No module takes more than TRACE_STOPS of them, and the training loop's modules are
# on the path.
TRACE_STOPS = 5
TRAINING_LOOP = ("fedpose.shared.training.loop", "fedpose.shared.training.local_step",
                 "fedpose.shared.training.batches", "fedpose.shared.training.schedule")


def test_a_train_message_stops_at_few_functions_per_module(world, tmp_path):
    cfg, state, _, p = world
    policy = _policy(cfg, tmp_path)
    content = _request(cfg, state, sigma=min_sigma_for(policy), method="fpdp", basis_version=1)
    basis, _ = torch.linalg.qr(torch.randn(p, cfg.privacy.k, dtype=torch.float64))
    content[BASIS] = basis_record(basis.float(), version=1, dtype="float32")
    stops: set[tuple[str, str]] = set()

    def profile(frame, event, arg):
        if event == "call":
            module, name = frame.f_globals.get("__name__", ""), frame.f_code.co_name
            if module.startswith("fedpose.") and not name.startswith("<") and not (
                    name.startswith("__") and name.endswith("__")):
                stops.add((module, name))

    sys.setprofile(profile)
    try:
        handle_train(content, policy)
    finally:
        sys.setprofile(None)
    per_module: dict[str, list[str]] = {}
    for module, name in sorted(stops):
        per_module.setdefault(module, []).append(name)
    assert all(module in per_module for module in TRAINING_LOOP), sorted(per_module)
    over = {module: names for module, names in per_module.items()
            if len(names) > TRACE_STOPS}
    assert not over, over


def test_a_basis_narrower_than_k_is_used_and_a_wider_one_refused(world, tmp_path):
    """The public gradients can span fewer than k directions (the server's V then has fewer columns): projecting
    onto fewer orthonormal directions is still post-processing of the noised sum, so the site trains with it; a V
    wider than k would let noise into more directions than the site agreed to, and is refused."""
    cfg, state, _, p = world
    policy = _policy(cfg, tmp_path)
    sigma = min_sigma_for(policy)
    k = cfg.privacy.k
    narrow, _ = torch.linalg.qr(torch.randn(p, k - 1, dtype=torch.float64))
    content = _request(cfg, state, sigma=sigma, method="proj", basis_version=1)
    content[BASIS] = basis_record(narrow.float(), version=1, dtype="float32")
    handle_train(content, policy)
    assert len(_rows(policy)) == 1
    wide, _ = torch.linalg.qr(torch.randn(p, k + 1, dtype=torch.float64))
    content = _request(cfg, state, sigma=sigma, method="proj", basis_version=2, round=2)
    content[BASIS] = basis_record(wide.float(), version=2, dtype="float32")
    assert _refusal(content, policy).code == RefusalCode.BAD_BASIS


def test_the_basis_cache_holds_one_basis_during_a_federation_and_none_after_its_last_round(world, tmp_path):
    """A basis is p x k floats (180 MB per site for the default model): a site keeps the latest of a federation
    while it runs (a later round of the same version reuses it) and none once the federation's last round is done."""
    cfg, state, _, p = world
    assert cfg.federation.rounds == 2
    policy = _policy(cfg, tmp_path)
    sigma = min_sigma_for(policy)
    cache = tmp_path / "basis-cache"
    for rnd in (1, 2):
        basis, _ = torch.linalg.qr(torch.randn(p, cfg.privacy.k, dtype=torch.float64))
        content = _request(cfg, state, sigma=sigma, method="proj", basis_version=rnd, round=rnd)
        content[BASIS] = basis_record(basis.float(), version=rnd, dtype="float32")
        handle_train(content, policy)
        held = sorted(x.name for x in cache.glob("*.npy"))
        assert held == (["fed-test-v1.npy"] if rnd == 1 else []), (rnd, held)


@pytest.mark.invariant("P2")
def test_site_checks_its_public_set_itself_and_handles_overlap_locally(world, tmp_path):
    """P2 is the site's own check against the public set its operator approved (finding 8.1); a private image in
    the public set is left out of training with an alert for the operator, never a visible refusal (P13)."""
    import shutil

    from fedpose.client.site_data import check_site, prepare_site, site_ready

    cfg, state, _, _ = world
    policy = _policy(cfg, tmp_path)
    assert len(check_site(policy).private) == 40
    info = site_info(policy)
    assert info.rounds_done == 0 and not hasattr(info, "n")  # n is never released (P10)

    # A public copy holding one private image: its digest no longer matches what the operator approved ...
    public = tmp_path / "public-copy"
    shutil.copytree(Path(cfg.data.root) / "public", public)
    private_image = Path(cfg.data.root) / "site-0" / "images"
    first = sorted(private_image.iterdir())[0]
    victim = sorted((public / "images").iterdir())[0]
    shutil.copyfile(first, victim)
    with pytest.raises(ValueError, match="digest"):
        check_site(_policy(cfg, tmp_path / "a", public_path=str(public), prepare=False))
    # ... and approving that set anyway leaves the overlapping private record out, with an alert, locally.
    from fedpose.client.site_data import load_split_dir
    from fedpose.shared.data.split import manifest_digest as public_digest

    approved = _policy(cfg, tmp_path / "b", public_path=str(public),
                       public_digest=public_digest(load_split_dir(public, "public")), prepare=False)
    checked = check_site(approved)
    assert len(checked.private) == 39 and len(checked.dropped) == 1
    assert any("also in the public set" in alert for alert in checked.alerts)
    # Before its operator ran the checks the site refuses generically; after, it answers as any site.
    with pytest.raises(Refusal) as refused:
        site_ready(approved)
    assert refused.value.code == RefusalCode.MISCONFIGURED and "private" not in refused.value.reason
    assert _refusal(_request(cfg, state, sigma=min_sigma_for(approved)), approved).code == RefusalCode.MISCONFIGURED
    assert _rows(approved) == []
    prepare_site(approved)
    assert site_info(approved).site == info.site
    reply = handle_train(_request(cfg, state, sigma=min_sigma_for(approved)), approved)
    assert sorted(reply[METRICS].keys()) == sorted(["sigma", "sample-rate", "steps", "site-epsilon", "run-epsilon",
                                                    "site-delta", "site-rounds", "seeded"])


def test_policy_file_is_validated(world, tmp_path):
    cfg, _, _, _ = world
    policy = _policy(cfg, tmp_path)
    path = write_policy(tmp_path / "policy.yaml", policy)
    assert load_policy(path) == policy
    text = path.read_text()
    for bad, needle in ((text + "epsilom: 1.0\n", "epsilom"),
                        (text.replace("lifetime_rounds: 2", "lifetime_rounds: two"), "lifetime_rounds"),
                        (text.replace("delta: 0.001", "delta: 2.0"), "delta"),
                        (text.replace("policy_version: 3\n", ""), "policy version 2.*sample_rate.*psi_min"),
                        (text.replace("policy_version: 3\n", "policy_version: 2\n"), "version-2.*expected_batch")):
        path.write_text(bad)
        with pytest.raises(ValueError, match=needle):
            load_policy(path)
    with pytest.raises(ValueError, match="nonprivate"):
        _policy(cfg, tmp_path, methods=["nonprivate"])


# ---------------------------------------------------------------------------
# a site process killed mid-round
# ---------------------------------------------------------------------------

CHILD = """
import sys
from fedpose.client.policy import load_policy
from fedpose.client.site import handle_train
from fedpose.shared.configuration.schema import load_config
from fedpose.shared.flower.messages import ARRAYS, CONFIG, TrainRequest, weights_record
from fedpose.shared.training.runs import initial_model
from flwr.app import RecordDict

cfg = load_config(sys.argv[1], {"train.method": "dpsgd"})
policy = load_policy(sys.argv[2])
sigma, steps = float(sys.argv[3]), int(sys.argv[4])
state = initial_model(cfg, progress=False).state_dict()
for rnd in range(int(sys.argv[5]), int(sys.argv[6]) + 1):
    request = TrainRequest(federation="fed-kill", round=rnd, site=policy.site, sigma=sigma,
                           sample_rate=policy.sample_rate, steps=steps, basis_version=0, basis_mode="broadcast",
                           config=cfg)
    print("start", rnd, flush=True)
    handle_train(RecordDict({ARRAYS: weights_record(state), CONFIG: request.to_record()}), policy)
    print("done", rnd, flush=True)
"""


def _rows_ro(db: Path) -> list[dict]:
    """The ledger's rows read without taking any lock (a reader beside the running site)."""
    if not db.exists():
        return []
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
    conn.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in conn.execute("SELECT * FROM spend ORDER BY id")]
    except sqlite3.OperationalError:
        return []
    finally:
        conn.close()


@pytest.mark.invariant("P6", "P13")
def test_site_killed_mid_round_has_paid_for_it_and_replays_it_once(world, tmp_path):
    """P13: a round is charged before its first private record is read; a kill -9 while it trains keeps the
    charge (a failure is never free), and the round asked again is replayed on its own seed, not spent twice."""
    cfg, _, _, _ = world
    config_path = tmp_path / "site.yaml"
    dump_config(cfg, config_path)
    policy = _policy(cfg, tmp_path, max_rounds=10, epsilon=8.0)
    policy_path = write_policy(tmp_path / "policy.yaml", policy)
    steps = 2
    sigma = min_sigma_for(policy)
    db = Path(policy.ledger_path)
    env = flower_env(tmp_path / "flwr-home")
    args = [sys.executable, "-c", CHILD, str(config_path), str(policy_path), repr(sigma), str(steps)]

    log = tmp_path / "child.log"
    child = start([*args, "1", "5"], log, env)
    try:
        wait_for(lambda: "done 1" in log.read_text() or child.poll() is not None, 240, "round 1 at the site")
        wait_for(lambda: any(r["state"] == "charged" for r in _rows_ro(db)) or child.poll() is not None, 120,
                 "round 2 charged and training", poll=0.02)
        assert child.poll() is None, log.read_text()[-3000:]
        os.killpg(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        stop(child)
    done = log.read_text().count("done ")
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    conn.close()
    with SiteLedger(db) as ledger:
        rows = ledger.rows()
        # every finished round, plus the killed one: it was paid for before it read a private record
        assert [r["round"] for r in rows] == list(range(1, done + 2))
        assert [r["state"] for r in rows] == ["done"] * done + ["charged"]
        assert rows[-1]["noise_seed"] is not None and all(r["noise_seed"] is None for r in rows[:-1])
        charged_eps = rows[-1]["epsilon"]
        assert charged_eps == pytest.approx(epsilon_spent(ledger.history(), delta=policy.delta), rel=1e-12)

    # Asked again (a restarted site, the server retrying), the killed round is replayed: one row, same spend.
    restarted = subprocess.run([*args, str(done + 1), str(done + 2)], cwd=REPO, env=env, capture_output=True,
                               text=True, timeout=240)
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    with SiteLedger(db) as ledger:
        rows = ledger.rows()
        assert [r["round"] for r in rows] == list(range(1, done + 3))
        assert all(r["state"] == "done" and r["noise_seed"] is None for r in rows)
        assert rows[done]["epsilon"] == charged_eps  # the replay spent nothing more
        assert rows[-1]["epsilon"] == pytest.approx(epsilon_spent(ledger.history(), delta=policy.delta), rel=1e-12)
        assert rows[-1]["epsilon"] > rows[-2]["epsilon"]  # composed over all rounds, never reset
