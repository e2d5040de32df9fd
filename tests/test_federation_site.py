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
from fedpose.client.policy import load_policy, min_sigma_for, sigma_shortfall, write_policy
from fedpose.client.site import handle_train
from fedpose.client.data import site_info
from support.federation import REPO, flower_env, start, stop, wait_for
from support.site import refusal_of, q_of, site_policy, spend_rows, train_request
from fedpose.shared.configuration.schema import dump_config, replace
from fedpose.shared.flower.messages import (
    ARRAYS,
    BASIS,
    METRICS,
    Refusal,
    RefusalCode,
    basis_record,
    record_tensors,
)
from fedpose.shared.privacy.accounting.accountant import StepRecord, epsilon_spent


@pytest.mark.invariant("P6")
def test_sigma_at_the_derived_minimum_is_accepted_and_below_it_refused(world_trainable, tmp_path):
    cfg, state, _, _ = world_trainable
    policy = site_policy(cfg, tmp_path)
    q = q_of(cfg)
    floor = min_sigma_for(policy)
    # The derived minimum spends at most the budget over its lifetime rounds; 1 % less noise spends more.
    lifetime_steps = policy.lifetime_rounds * policy.steps_per_round
    assert epsilon_spent([StepRecord(sigma=floor, sample_rate=q, steps=lifetime_steps)], delta=policy.delta) <= 2.0
    assert sigma_shortfall(policy, sigma=floor) is None
    assert sigma_shortfall(policy, sigma=0.99 * floor) is not None

    refusal = refusal_of(train_request(cfg, state, sigma=0.9 * floor), policy)
    assert refusal.code == RefusalCode.WEAKER_NOISE
    assert spend_rows(policy) == []  # nothing trained, nothing recorded


@pytest.mark.invariant("P6")
def test_a_round_beyond_the_budget_is_refused_and_the_ledger_is_unchanged(world_trainable, tmp_path):
    cfg, state, trainable, _ = world_trainable
    policy = site_policy(cfg, tmp_path, max_rounds=1)
    q = q_of(cfg)
    sigma = min_sigma_for(policy)

    reply = handle_train(train_request(cfg, state, sigma=sigma), policy)  # the one round it allows
    assert sorted(record_tensors(reply[ARRAYS])) == sorted(trainable)
    metrics = reply[METRICS]
    assert (metrics["sigma"], metrics["sample-rate"], metrics["steps"]) == (sigma, q, 1)
    fresh = epsilon_spent([StepRecord(sigma=sigma, sample_rate=q, steps=1)], delta=policy.delta)
    assert metrics["site-epsilon"] == pytest.approx(fresh, rel=1e-12)
    before = spend_rows(policy)
    assert len(before) == 1 and before[0]["epsilon"] == pytest.approx(fresh, rel=1e-12)

    refusal = refusal_of(train_request(cfg, state, sigma=sigma, round=2), policy)  # max_rounds reached
    assert refusal.code == RefusalCode.BUDGET
    assert spend_rows(policy) == before

    # Enough noise for the site's explicit floor, but the round would overspend its epsilon.
    tight = site_policy(cfg, tmp_path / "tight", epsilon=0.5, min_sigma=0.3, max_rounds=5)
    refusal = refusal_of(train_request(cfg, state, sigma=0.4, steps=2), tight)
    assert refusal.code == RefusalCode.BUDGET
    assert spend_rows(tight) == []
    assert site_info(tight).rounds_done == 0


def test_a_request_to_scale_tensors_from_the_public_split_is_refused_with_nothing_spent(world_trainable, tmp_path):
    """train.tensor_scales: public reads the public split at every refresh, which a site does not hold: refused
    before anything is charged, and a federation will not start with it."""
    from fedpose.server.run import run_federation
    from fedpose.shared.errors import ConfigError

    cfg, state, _, _ = world_trainable
    policy = site_policy(cfg, tmp_path)
    content = train_request(replace(cfg, **{"train.tensor_scales": "public"}), state, sigma=min_sigma_for(policy))
    refusal = refusal_of(content, policy)
    assert refusal.code == RefusalCode.BAD_REQUEST and "tensor_scales" in refusal.reason
    assert spend_rows(policy) == []
    with pytest.raises(ConfigError, match="train.tensor_scales: public is for centralized runs only"):
        run_federation(None, replace(cfg, **{"train.tensor_scales": "public"}), tmp_path / "never-written")


@pytest.mark.parametrize("sigma", [0.0, 5.0])
def test_a_request_naming_its_own_noise_multiplier_is_refused_with_nothing_spent(world_trainable, tmp_path, sigma):
    """privacy.noise_multiplier is a centralized diagnostic (0: clipped without noise, no guarantee at all): a
    site plans its noise from its own budget, so a request naming one is refused before anything is charged, and
    a federation will not start with it."""
    from fedpose.server.run import run_federation
    from fedpose.shared.errors import ConfigError

    cfg, state, _, _ = world_trainable
    policy = site_policy(cfg, tmp_path)
    asked = replace(cfg, **{"privacy.noise_multiplier": sigma})
    refusal = refusal_of(train_request(asked, state, sigma=min_sigma_for(policy)), policy)
    assert refusal.code == RefusalCode.BAD_REQUEST and "noise_multiplier" in refusal.reason
    assert spend_rows(policy) == []
    with pytest.raises(ConfigError, match="privacy.noise_multiplier"):
        run_federation(None, asked, tmp_path / "never-written")


def test_a_request_to_train_low_rank_adapters_is_refused_with_nothing_spent(world_trainable, tmp_path):
    """train.strategy: lora makes and merges its adapters inside one centralized run; a round's request names no
    adapters to train: refused before anything is charged, and a federation will not start with it."""
    from fedpose.server.run import run_federation
    from fedpose.shared.errors import ConfigError

    cfg, state, _, _ = world_trainable
    policy = site_policy(cfg, tmp_path)
    refusal = refusal_of(train_request(replace(cfg, **{"train.strategy": "lora"}), state, sigma=min_sigma_for(policy)),
                       policy)
    assert refusal.code == RefusalCode.BAD_REQUEST and "lora" in refusal.reason
    assert spend_rows(policy) == []
    with pytest.raises(ConfigError, match="train.strategy: lora is for centralized runs only"):
        run_federation(None, replace(cfg, **{"train.strategy": "lora"}), tmp_path / "never-written")


def test_a_request_whose_raw_and_psi_pair_would_not_be_one_records_bound_is_refused_with_nothing_spent(world_trainable,
                                                                                                      tmp_path):
    """train.images: raw+psi clips a record's image and psi of its crop as one: with fdp / fpdp (their psi term is
    added unclipped) or augmentation multiplicity the run would refuse it after the charge; the site refuses it
    before, and a federation will not start with it."""
    from fedpose.server.run import run_federation
    from fedpose.shared.errors import ConfigError

    cfg, state, _, _ = world_trainable
    policy = site_policy(cfg, tmp_path)
    for method, change in (("fpdp", {}), ("proj", {"privacy.augment_multiplicity": 2})):
        asked = replace(cfg, **{"train.images": "raw+psi", "train.method": method, **change})
        refusal = refusal_of(train_request(asked, state, sigma=min_sigma_for(policy), method=method), policy)
        assert refusal.code == RefusalCode.BAD_REQUEST and "raw+psi" in refusal.reason
        assert spend_rows(policy) == []
        with pytest.raises(ConfigError, match="train.images: raw"):
            run_federation(None, asked, tmp_path / "never-written")


def test_bad_basis_and_missing_basis_are_refused(world_trainable, tmp_path):
    cfg, state, _, p = world_trainable
    policy = site_policy(cfg, tmp_path)
    k = cfg.privacy.k
    sigma = min_sigma_for(policy)
    orthonormal, _ = torch.linalg.qr(torch.randn(p, k, dtype=torch.float64))

    content = train_request(cfg, state, sigma=sigma, method="proj", basis_version=1)
    content[BASIS] = basis_record(orthonormal[:-1].float(), version=1, dtype="float32")  # wrong shape
    assert refusal_of(content, policy).code == RefusalCode.BAD_BASIS

    content = train_request(cfg, state, sigma=sigma, method="proj", basis_version=1)
    content[BASIS] = basis_record((1.5 * orthonormal).float(), version=1, dtype="float16")  # not orthonormal
    assert refusal_of(content, policy).code == RefusalCode.BAD_BASIS

    content = train_request(cfg, state, sigma=sigma, method="proj", basis_version=1)
    assert refusal_of(content, policy).code == RefusalCode.NEED_BASIS  # nothing cached for version 1
    assert spend_rows(policy) == []

    # A valid V on a request refused at the ledger (it would overspend) is not cached: refused requests under
    # new federation ids cannot fill the site's disk with p x k bases.
    tight = site_policy(cfg, tmp_path / "tight", epsilon=0.5, min_sigma=0.3, max_rounds=5)
    for federation in ("probe-a", "probe-b"):
        content = train_request(cfg, state, sigma=0.4, steps=2, method="proj", basis_version=1, federation=federation)
        content[BASIS] = basis_record(orthonormal.float(), version=1, dtype="float16")
        assert refusal_of(content, tight).code == RefusalCode.BUDGET
    assert spend_rows(tight) == []
    assert not (tmp_path / "tight" / "basis-cache").exists()


def test_a_basis_narrower_than_k_is_used_and_a_wider_one_refused(world_trainable, tmp_path):
    """The public gradients can span fewer than k directions (the server's V then has fewer columns): projecting
    onto fewer orthonormal directions is still post-processing of the noised sum, so the site trains with it; a V
    wider than k would let noise into more directions than the site agreed to, and is refused."""
    cfg, state, _, p = world_trainable
    policy = site_policy(cfg, tmp_path)
    sigma = min_sigma_for(policy)
    k = cfg.privacy.k
    narrow, _ = torch.linalg.qr(torch.randn(p, k - 1, dtype=torch.float64))
    content = train_request(cfg, state, sigma=sigma, method="proj", basis_version=1)
    content[BASIS] = basis_record(narrow.float(), version=1, dtype="float32")
    handle_train(content, policy)
    assert len(spend_rows(policy)) == 1
    wide, _ = torch.linalg.qr(torch.randn(p, k + 1, dtype=torch.float64))
    content = train_request(cfg, state, sigma=sigma, method="proj", basis_version=2, round=2)
    content[BASIS] = basis_record(wide.float(), version=2, dtype="float32")
    assert refusal_of(content, policy).code == RefusalCode.BAD_BASIS


def test_the_basis_cache_holds_one_basis_during_a_federation_and_none_after_its_last_round(world_trainable, tmp_path):
    """A basis is p x k floats (180 MB per site for the default model): a site keeps the latest of a federation
    while it runs (a later round of the same version reuses it) and none once the federation's last round is done."""
    cfg, state, _, p = world_trainable
    assert cfg.federation.rounds == 2
    policy = site_policy(cfg, tmp_path)
    sigma = min_sigma_for(policy)
    cache = tmp_path / "basis-cache"
    for rnd in (1, 2):
        basis, _ = torch.linalg.qr(torch.randn(p, cfg.privacy.k, dtype=torch.float64))
        content = train_request(cfg, state, sigma=sigma, method="proj", basis_version=rnd, round=rnd)
        content[BASIS] = basis_record(basis.float(), version=rnd, dtype="float32")
        handle_train(content, policy)
        held = sorted(x.name for x in cache.glob("*.npy"))
        assert held == (["fed-test-v1.npy"] if rnd == 1 else []), (rnd, held)


@pytest.mark.invariant("P2")
def test_site_checks_its_public_set_itself_and_handles_overlap_locally(world_trainable, tmp_path):
    """P2 is the site's own check against the public set its operator approved (finding 8.1); a private image in
    the public set is left out of training with an alert for the operator, never a visible refusal (P13)."""
    import shutil

    from fedpose.client.data import check_site, prepare_site, site_ready

    cfg, state, _, _ = world_trainable
    policy = site_policy(cfg, tmp_path)
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
        check_site(site_policy(cfg, tmp_path / "a", public_path=str(public), prepare=False))
    # ... and approving that set anyway leaves the overlapping private record out, with an alert, locally.
    from fedpose.client.data import load_split_dir
    from fedpose.shared.data.split import manifest_digest as public_digest

    approved = site_policy(cfg, tmp_path / "b", public_path=str(public),
                       public_digest=public_digest(load_split_dir(public, "public")), prepare=False)
    checked = check_site(approved)
    assert len(checked.private) == 39 and len(checked.dropped) == 1
    assert any("also in the public set" in alert for alert in checked.alerts)
    # Before its operator ran the checks the site refuses generically; after, it answers as any site.
    with pytest.raises(Refusal) as refused:
        site_ready(approved)
    assert refused.value.code == RefusalCode.MISCONFIGURED and "private" not in refused.value.reason
    refused = refusal_of(train_request(cfg, state, sigma=min_sigma_for(approved)), approved)
    assert refused.code == RefusalCode.MISCONFIGURED
    assert spend_rows(approved) == []
    prepare_site(approved)
    assert site_info(approved).site == info.site
    reply = handle_train(train_request(cfg, state, sigma=min_sigma_for(approved)), approved)
    assert sorted(reply[METRICS].keys()) == sorted(["sigma", "sample-rate", "steps", "site-epsilon", "run-epsilon",
                                                    "site-delta", "site-rounds", "seeded"])


def test_policy_file_is_validated(world_trainable, tmp_path):
    cfg, _, _, _ = world_trainable
    policy = site_policy(cfg, tmp_path)
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
        site_policy(cfg, tmp_path, methods=["nonprivate"])


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
def test_site_killed_mid_round_has_paid_for_it_and_replays_it_once(world_trainable, tmp_path):
    """P13: a round is charged before its first private record is read; a kill -9 while it trains keeps the
    charge (a failure is never free), and the round asked again is replayed on its own seed, not spent twice."""
    cfg, _, _, _ = world_trainable
    config_path = tmp_path / "site.yaml"
    dump_config(cfg, config_path)
    policy = site_policy(cfg, tmp_path, max_rounds=10, epsilon=8.0)
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
