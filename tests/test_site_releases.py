"""P13 at the site: nothing it releases (reply, refusal, their timing, a failure) depends on private data except
through the DP-noised update.

- a round is charged before its first private record is read: a failure after that is paid for;
- resources are the site's: its chunk size, its model and input bounds, whatever the request says;
- a failure after the charge is final (P16); a round whose process died is replayed on its own seed for the
  identical request (never spent twice), and refused on changed data (tests/test_one_release.py: other requests);
- queries and refused requests read no private record (the site's checks ran once, by its operator);
- with ``round_seconds`` a charged round's answer leaves at a fixed deadline.

Real files throughout: the tiny synthetic world, real SQLite ledgers, ``fedpose.client.site.handle_train``.
"""

from __future__ import annotations

import math
import shutil
import time
from pathlib import Path

import pytest
import torch

from fedpose.client.ledger import SiteLedger
from fedpose.client.policy import min_sigma_for
from fedpose.client.site import SiteFailure, handle_train
from fedpose.client.data import prepare_site, site_info
from fedpose.shared.configuration.schema import replace
from fedpose.shared.flower.messages import ARRAYS, Refusal, RefusalCode, record_tensors
from support.site import crash_mid_round, cut_split, site_policy, spend_rows, subset_split, train_request


def _fail_after_reading(monkeypatch) -> list[int]:
    """Make local training read its first private batch, then fail (an out-of-memory error, say)."""
    import fedpose.shared.training.loop as train_module

    real = train_module.local_train
    seen: list[int] = []

    def failing(model, data, run, **kwargs):
        seen.append(len(data.private.batch([0])["image"]))  # a private record was read
        raise MemoryError("out of memory on the realised batch")

    monkeypatch.setattr(train_module, "local_train", failing)
    return seen, real


@pytest.mark.invariant("P13")
def test_a_failure_after_private_data_was_read_is_already_paid_for(world_weights, tmp_path, monkeypatch):
    cfg, state = world_weights
    policy = site_policy(cfg, tmp_path)
    seen, _ = _fail_after_reading(monkeypatch)
    with pytest.raises(MemoryError):
        handle_train(train_request(cfg, state, sigma=min_sigma_for(policy)), policy)
    assert seen == [1]
    (row,) = spend_rows(policy)  # before: the transaction rolled back and the failure was free
    assert row["state"] == "failed" and row["epsilon"] > 0
    assert site_info(policy).epsilon_spent == pytest.approx(row["epsilon"])


@pytest.mark.invariant("P13")
def test_an_unfinished_round_replays_on_its_own_seed_and_is_never_spent_twice(world_weights, tmp_path, monkeypatch):
    cfg, state = world_weights
    crashed = site_policy(cfg, tmp_path / "crashed", seed=11)
    clean = site_policy(cfg, tmp_path / "clean", seed=11)
    sigma = min_sigma_for(crashed)
    crash_mid_round(train_request(cfg, state, sigma=sigma, steps=2), crashed)
    replayed = handle_train(train_request(cfg, state, sigma=sigma, steps=2), crashed)
    uninterrupted = handle_train(train_request(cfg, state, sigma=sigma, steps=2), clean)
    a, b = record_tensors(replayed[ARRAYS]), record_tensors(uninterrupted[ARRAYS])
    assert all(torch.equal(a[k], b[k]) for k in a)  # the same release: same seed, same data
    assert [(r["round"], r["state"], r["noise_seed"]) for r in spend_rows(crashed)] == [(1, "done", None)]
    assert spend_rows(crashed)[0]["epsilon"] == spend_rows(clean)[0]["epsilon"]
    again = handle_train(train_request(cfg, state, sigma=sigma, steps=2), crashed)  # asked once more: the stored reply
    assert all(torch.equal(record_tensors(again[ARRAYS])[k], a[k]) for k in a)
    assert len(spend_rows(crashed)) == 1


@pytest.mark.invariant("P13")
def test_a_charged_round_is_not_replayed_on_changed_data(world_weights, tmp_path, monkeypatch):
    cfg, state = world_weights
    data = subset_split(cfg, tmp_path / "site-0", 40)
    policy = site_policy(cfg, tmp_path, data_path=str(data))
    sigma = min_sigma_for(policy)
    crash_mid_round(train_request(cfg, state, sigma=sigma), policy)
    cut_split(data, 39)  # one record fewer
    # until its operator checks the changed data the site refuses everything, generically
    with pytest.raises(Refusal) as refused:
        handle_train(train_request(cfg, state, sigma=sigma), policy)
    assert refused.value.code == RefusalCode.MISCONFIGURED
    prepare_site(policy)
    with pytest.raises(Refusal) as refused:  # the same noise on other data would cancel in the difference
        handle_train(train_request(cfg, state, sigma=sigma), policy)
    assert refused.value.code == RefusalCode.ALREADY_SPENT
    assert [r["state"] for r in spend_rows(policy)] == ["charged"]


@pytest.mark.invariant("P13")
def test_the_site_pins_its_chunk_size_and_bounds_the_model_and_input(world_weights, tmp_path, monkeypatch):
    from fedpose.shared.privacy.step import fpdp

    cfg, state = world_weights
    policy = site_policy(cfg, tmp_path, chunk_size=3)
    chunks: list[int] = []
    real = fpdp.clipped_grad_sum

    def spy(*args, chunk_size, **kwargs):
        chunks.append(chunk_size)
        return real(*args, chunk_size=chunk_size, **kwargs)

    monkeypatch.setattr(fpdp, "clipped_grad_sum", spy)
    greedy = replace(cfg, **{"privacy.chunk_size": 100000})  # the server asks for every gradient at once
    handle_train(train_request(greedy, state, sigma=min_sigma_for(policy)), policy)
    assert chunks and set(chunks) == {3}

    small = site_policy(cfg, tmp_path / "small", max_parameters=10_000)
    with pytest.raises(Refusal) as refused:
        handle_train(train_request(cfg, state, sigma=min_sigma_for(small)), small)
    assert refused.value.code == RefusalCode.POLICY and "max_parameters" in refused.value.reason
    narrow = site_policy(cfg, tmp_path / "narrow", max_input_size=[32, 32])
    wide = replace(cfg, **{"data.input_size": [64, 32]})
    with pytest.raises(Refusal) as refused:
        handle_train(train_request(wide, state, sigma=min_sigma_for(narrow)), narrow)
    assert refused.value.code == RefusalCode.POLICY and "max_input_size" in refused.value.reason
    assert spend_rows(small) == [] and spend_rows(narrow) == []


@pytest.mark.invariant("P13")
def test_queries_and_refusals_read_no_private_record(world_weights, tmp_path, monkeypatch):
    """Before: every message (Flower starts a process per message) re-ran the start-up checks, decoding and
    hashing every private image, so even a refused request's latency tracked n."""
    import fedpose.shared.data.mpii as mpii
    import fedpose.shared.data.split as split

    cfg, state = world_weights
    policy = site_policy(cfg, tmp_path)  # the operator ran the checks
    reads: list[str] = []
    real_load, real_hash = mpii.load_mpii, split.content_hash

    def load(path, *args, **kwargs):
        reads.append(str(path))
        return real_load(path, *args, **kwargs)

    def digest(path):
        reads.append(str(path))
        return real_hash(path)

    monkeypatch.setattr(mpii, "load_mpii", load)
    monkeypatch.setattr(split, "content_hash", digest)
    monkeypatch.setattr("fedpose.client.data.content_hash", digest)
    info = site_info(policy)  # a query
    with pytest.raises(Refusal) as refused:  # a request below the site's noise floor
        handle_train(train_request(cfg, state, sigma=0.5 * min_sigma_for(policy)), policy)
    assert refused.value.code == RefusalCode.WEAKER_NOISE
    with pytest.raises(Refusal):  # a method the policy does not allow
        handle_train(train_request(cfg, state, sigma=min_sigma_for(policy), method="nonprivate"), policy)
    assert info.site == "site-0" and reads == []


@pytest.mark.invariant("P13")
def test_a_charged_rounds_answer_leaves_at_the_sites_deadline(world_weights, tmp_path, monkeypatch):
    cfg, state = world_weights
    policy = site_policy(cfg, tmp_path, round_seconds=4.0)
    t0 = time.monotonic()
    handle_train(train_request(cfg, state, sigma=min_sigma_for(policy)), policy)
    assert time.monotonic() - t0 >= 4.0
    _fail_after_reading(monkeypatch)
    t0 = time.monotonic()
    with pytest.raises(MemoryError):  # a failure leaves at the same deadline as a reply
        handle_train(train_request(cfg, state, sigma=min_sigma_for(policy), round=2), policy)
    assert time.monotonic() - t0 >= 4.0


@pytest.mark.invariant("P13")
def test_a_round_past_its_deadline_leaves_at_the_next_multiple_of_it(world_weights, tmp_path, monkeypatch):
    """Before: a round longer than round_seconds left when training ended, so its departure tracked the realised
    private batch (Pearson 0.92 in a review). Now it waits for the next multiple of the period."""
    import fedpose.shared.training.loop as train_module

    cfg, state = world_weights
    period = 2.0
    policy = site_policy(cfg, tmp_path, round_seconds=period)
    real = train_module.local_train

    def slow(*args, **kwargs):  # a round that runs past its deadline (a large realised batch, say)
        time.sleep(period * 1.3)
        return real(*args, **kwargs)

    monkeypatch.setattr(train_module, "local_train", slow)
    t0 = time.monotonic()
    handle_train(train_request(cfg, state, sigma=min_sigma_for(policy)), policy)
    elapsed = time.monotonic() - t0
    assert elapsed >= 2 * period
    assert elapsed - period * math.floor(elapsed / period) < 0.5  # within half a second after a multiple


@pytest.mark.invariant("P14")
def test_a_reply_is_checked_finite_before_it_leaves(world_weights, tmp_path):
    """A learning rate that overflows the weights: post-processing of the DP release, spent, never sent."""
    cfg, state = world_weights
    policy = site_policy(cfg, tmp_path)
    # w <- w - lr (g + wd w): with wd = 1e38 every weight leaves the float32 range in two steps
    huge = replace(cfg, **{"train.optimizer": "sgd", "train.lr": 1.0, "train.momentum": 0.0,
                           "train.weight_decay": 1e38})
    with pytest.raises(SiteFailure, match="not finite"):
        handle_train(train_request(huge, state, sigma=min_sigma_for(policy), steps=2), policy)
    assert [r["state"] for r in spend_rows(policy)] == ["failed"]
    with SiteLedger(policy.ledger_path) as ledger:
        assert ledger.rounds_done() == 1


@pytest.mark.invariant("P10")
def test_a_reply_carries_the_update_and_the_declared_spend_only_whatever_the_sites_size(world_weights, tmp_path):
    """P10: a reply holds the trained tensors and exactly the metrics of REPLY_METRICS, each from the request, the
    policy and the ledger: a site with half the records sends the same metrics (no n, no loss, no timing)."""
    from fedpose.shared.flower.messages import METRICS, REPLY_METRICS

    cfg, state = world_weights
    metrics = []
    for name, keep in (("full", 40), ("half", 20)):
        policy = site_policy(cfg, tmp_path / name, data_path=str(subset_split(cfg, tmp_path / name / "site-0", keep)))
        assert prepare_site(policy).records == keep
        reply = handle_train(train_request(cfg, state, sigma=min_sigma_for(policy)), policy)
        assert sorted(reply.keys()) == sorted([ARRAYS, METRICS])
        metrics.append({key: reply[METRICS][key] for key in reply[METRICS].keys()})
    assert sorted(metrics[0]) == sorted(REPLY_METRICS)
    assert metrics[0] == metrics[1]


@pytest.mark.invariant("P13")
def test_data_that_would_break_the_claim_is_handled_locally_not_in_the_answer(world_weights, tmp_path):
    """A private image present twice (or planted in the public set, or a patient past the cap) flipped every
    answer to MISCONFIGURED before: a bit the server could watch. Now the records are left out, the operator
    is alerted in the site's own check, and the server sees the site as any other."""
    cfg, state = world_weights
    data = subset_split(cfg, tmp_path / "site-0", 40)
    images = sorted((data / "images").iterdir())
    shutil.copyfile(images[0], images[1])  # a new private image equal to another
    policy = site_policy(cfg, tmp_path, data_path=str(data))
    check = prepare_site(policy)
    assert check.records == 39 and any("repeat another private image" in a for a in check.alerts)
    info = site_info(policy)
    clean = site_policy(cfg, tmp_path / "clean")
    assert info == site_info(clean)  # the same declaration, the same spend
    reply = handle_train(train_request(cfg, state, sigma=min_sigma_for(policy)), policy)
    assert sorted(reply.keys()) == sorted(handle_train(train_request(cfg, state, sigma=min_sigma_for(clean)),
                                                       clean).keys())


def test_stored_replies_and_cached_bases_are_cleaned_by_exact_id(tmp_path):
    """Federation ``a`` must not delete what federation ``a-r1`` (or ``a-v1``) stored: ids, not prefixes."""
    from fedpose.client.replies import store_reply, stored_reply
    from fedpose.client.basis import cache_basis, cached_basis

    policy = _policy_stub(tmp_path)
    weights = {"w": torch.zeros(2)}
    store_reply(policy, "a-r1", 2, weights, {"steps": 1})
    store_reply(policy, "a", 1, weights, {"steps": 1})
    store_reply(policy, "a", 2, weights, {"steps": 1})
    assert stored_reply(policy, "a-r1", 2) is not None  # before: deleted by federation a's clean-up
    assert stored_reply(policy, "a", 1) is None and stored_reply(policy, "a", 2) is not None
    basis = torch.eye(3)[:, :2]
    cache_basis(policy, "a-v1", 2, basis)
    cache_basis(policy, "a", 1, basis)
    cache_basis(policy, "a", 2, basis)
    assert cached_basis(policy, "a-v1", 2) is not None
    assert cached_basis(policy, "a", 1) is None and cached_basis(policy, "a", 2) is not None


def _policy_stub(tmp_path: Path):
    """A policy whose files need not exist (the reply store and basis cache only use its ledger folder)."""
    from fedpose.client.policy import policy_from_dict

    return policy_from_dict({"policy_version": 3, "site": "s", "epsilon": 1.0, "delta": 1e-5, "lifetime_rounds": 1,
                             "rounds_per_federation": 1, "sample_rate": 0.1, "expected_batch": 8,
                             "steps_per_round": 1, "clip_norm": 1.0, "psi": "blur", "psi_min": 0.03, "augment": True,
                             "data_path": str(tmp_path / "d"), "ledger_path": str(tmp_path / "ledger.sqlite")})
