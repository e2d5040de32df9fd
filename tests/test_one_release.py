"""P16: a charged round is one release.

The attack this closes: a round that fails after its charge (its final weights are not finite, say) kept its
ledger row ``charged`` with its noise seed, so the server could ask the same (federation, round) again with new
weights, learning rate, basis or config and the site re-ran it on the same Poisson sample, the same noise and the
same crops. The first failure is one bit about the noise (the server arranges an overflow iff the noise at one
coordinate passes a threshold); the second request evaluates another function of that same noise. No (eps, delta)
survives two functions of one noise draw.

Now the charged row is bound to a digest of the whole request (weights, basis, every config field, the app
bundle). A failure after the charge is final: it is stored as the round's answer and every later request for that
round gets it back, with nothing trained. Only a crash (the site process died mid-round) leaves the round open,
and only the identical request replays it.

A crash is a real one (``crash_mid_round``): the site's process is killed with SIGKILL once training has read its
first private batch, so no handler of the site runs, as none would after a power cut.

Real files throughout: the tiny synthetic world, real SQLite ledgers, ``fedpose.client.site.handle_train``.
"""

from __future__ import annotations

import pytest
import torch

from fedpose.client.policy import min_sigma_for
from fedpose.client.site import SiteFailure, handle_train
from fedpose.shared.configuration.schema import replace
from fedpose.shared.flower.messages import ARRAYS, Refusal, RefusalCode, record_tensors
from support.site import count_training, crash_mid_round, site_policy, spend_rows, train_request


def _overflowing(cfg):
    """w <- w - lr (g + wd w): with wd = 1e38 every weight leaves the float32 range in two steps."""
    return replace(cfg, **{"train.optimizer": "sgd", "train.lr": 1.0, "train.momentum": 0.0,
                           "train.weight_decay": 1e38})


@pytest.mark.invariant("P16")
def test_a_failed_round_is_final_whatever_is_asked_next(world_weights, tmp_path, monkeypatch):
    cfg, state = world_weights
    policy = site_policy(cfg, tmp_path)
    sigma = min_sigma_for(policy)
    with pytest.raises(SiteFailure, match="not finite"):
        handle_train(train_request(_overflowing(cfg), state, sigma=sigma, steps=2), policy)
    (row,) = spend_rows(policy)
    assert row["state"] == "failed" and row["noise_seed"] is None and row["epsilon"] > 0
    trained = count_training(monkeypatch)
    sane = replace(cfg, **{"train.lr": 1e-4})  # the replay attack: new settings, same round
    for asked in (sane, _overflowing(cfg)):
        request = train_request(asked, state, sigma=sigma, steps=2)
        with pytest.raises(SiteFailure, match="failed after its charge"):
            handle_train(request, policy)
    assert trained == []  # nothing ran again on the round's noise
    assert [(r["state"], r["epsilon"]) for r in spend_rows(policy)] == [("failed", row["epsilon"])]


@pytest.mark.invariant("P16")
def test_an_unfinished_round_replays_only_the_identical_request(world_weights, tmp_path, monkeypatch):
    cfg, state = world_weights
    crashed = site_policy(cfg, tmp_path / "crashed", seed=11)
    clean = site_policy(cfg, tmp_path / "clean", seed=11)
    sigma = min_sigma_for(crashed)
    crash_mid_round(train_request(cfg, state, sigma=sigma, steps=2), crashed)
    trained = count_training(monkeypatch)
    other_lr = train_request(replace(cfg, **{"train.lr": cfg.train.lr * 2}), state, sigma=sigma, steps=2)
    other_weights = train_request(cfg, {k: (v + 1e-3 if v.is_floating_point() else v) for k, v in state.items()},
                             sigma=sigma, steps=2)
    for request in (other_lr, other_weights):
        with pytest.raises(Refusal) as refused:
            handle_train(request, crashed)
        assert refused.value.code == RefusalCode.ALREADY_SPENT
    assert trained == []
    assert [r["state"] for r in spend_rows(crashed)] == ["charged"]
    replayed = handle_train(train_request(cfg, state, sigma=sigma, steps=2), crashed)  # the identical request
    uninterrupted = handle_train(train_request(cfg, state, sigma=sigma, steps=2), clean)
    a, b = record_tensors(replayed[ARRAYS]), record_tensors(uninterrupted[ARRAYS])
    assert all(torch.equal(a[k], b[k]) for k in a)  # the same release: same seed, same data, same request
    assert [(r["state"], r["noise_seed"]) for r in spend_rows(crashed)] == [("done", None)]
    assert spend_rows(crashed)[0]["epsilon"] == spend_rows(clean)[0]["epsilon"]


@pytest.mark.invariant("P16")
def test_an_unfinished_round_does_not_replay_under_another_app_bundle(world_weights, tmp_path, monkeypatch):
    cfg, state = world_weights
    policy = site_policy(cfg, tmp_path, seed=3)
    sigma = min_sigma_for(policy)
    monkeypatch.setenv("FEDPOSE_APP_DIGEST", "a" * 64)
    crash_mid_round(train_request(cfg, state, sigma=sigma), policy)
    trained = count_training(monkeypatch)
    monkeypatch.setenv("FEDPOSE_APP_DIGEST", "b" * 64)  # the same request, run by other code
    with pytest.raises(Refusal) as refused:
        handle_train(train_request(cfg, state, sigma=sigma), policy)
    assert refused.value.code == RefusalCode.ALREADY_SPENT and trained == []
    monkeypatch.setenv("FEDPOSE_APP_DIGEST", "a" * 64)
    handle_train(train_request(cfg, state, sigma=sigma), policy)
    assert trained == [1] and [r["state"] for r in spend_rows(policy)] == ["done"]


@pytest.mark.invariant("P16")
def test_a_done_round_answers_any_request_with_its_stored_reply(world_weights, tmp_path, monkeypatch):
    cfg, state = world_weights
    policy = site_policy(cfg, tmp_path)
    sigma = min_sigma_for(policy)
    first = record_tensors(handle_train(train_request(cfg, state, sigma=sigma), policy)[ARRAYS])
    trained = count_training(monkeypatch)
    again = handle_train(train_request(replace(cfg, **{"train.lr": 0.5}), state, sigma=sigma), policy)
    assert trained == [] and all(torch.equal(record_tensors(again[ARRAYS])[k], first[k]) for k in first)
