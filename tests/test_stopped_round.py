"""P16: a stopped round is final, and every answer of a charged round leaves on the clock.

The attack this closes: when the server stops a run, Flower raises SIGINT in the site's ClientApp and its handler
ends in ``sys.exit``, so the round saw a ``SystemExit``, not an ``Exception``. Its row stayed ``charged`` and the
identical request replayed it on the same Poisson sample; a round that had finished answered its stored reply at
once, without the ``round_seconds`` hold. Stopping at increasing times on one charge then read off the round's
training time, which tracks the realised private batch.

Now any interruption after the charge (a stopped run's SIGINT, a KeyboardInterrupt) is final: the round is stored
as failed, its noise seed erased, a reply not yet sent is dropped. Every answer of a charged round (fresh, stored
reply, stored failure, the refusal of another request for it) leaves at the next multiple of ``round_seconds``
from its own request's arrival. Only a process that dies (``crash_mid_round``: SIGKILL) leaves the round open, and
the identical request replays it a bounded number of times.

The real stop through a SuperLink and a SuperNode on 127.0.0.1 is ``tests/test_stop_and_replay.py``.
"""

from __future__ import annotations

import pytest

from fedpose.client.ledger import MAX_ATTEMPTS
from fedpose.client.policy import min_sigma_for
from fedpose.client.replies import stored_reply
from fedpose.client.site import SiteFailure, handle_train
from fedpose.shared.configuration.schema import replace
from fedpose.shared.flower.messages import Refusal, RefusalCode
from support.site import count_training, crash_mid_round, site_policy, spend_rows, train_request


class _Clock:
    """The site module's ``time``: a monotonic clock that only ``sleep`` moves, so a test reads when an answer
    leaves relative to its request's arrival without depending on how long training took."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(0.0, seconds)


class _Stopped:
    """The site module's ``time`` while the server stops the run during the hold: Flower's SIGINT handler
    raises ``SystemExit`` in whatever the ClientApp is doing, here the wait before the answer leaves."""

    def monotonic(self) -> float:
        import time

        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        raise SystemExit(0)


@pytest.mark.invariant("P16")
def test_an_interrupted_round_is_final_and_is_never_trained_again(world_weights, tmp_path, monkeypatch):
    import fedpose.shared.training.loop as train_module

    cfg, state = world_weights
    policy = site_policy(cfg, tmp_path, seed=5)
    sigma = min_sigma_for(policy)

    def stopped(model, data, run, **kwargs):  # the run is stopped while the round reads its private data
        data.private.batch([0])
        raise SystemExit(0)

    monkeypatch.setattr(train_module, "local_train", stopped)
    with pytest.raises(SystemExit):
        handle_train(train_request(cfg, state, sigma=sigma, steps=2), policy)
    monkeypatch.undo()
    (row,) = spend_rows(policy)
    assert (row["state"], row["noise_seed"]) == ("failed", None) and row["epsilon"] > 0
    assert "interrupted" in row["outcome"]
    trained = count_training(monkeypatch)
    for asked in (cfg, replace(cfg, **{"train.lr": cfg.train.lr * 2})):  # the identical request, then another
        with pytest.raises(SiteFailure, match="failed after its charge"):
            handle_train(train_request(asked, state, sigma=sigma, steps=2), policy)
    assert trained == []
    assert [r["state"] for r in spend_rows(policy)] == ["failed"]


@pytest.mark.invariant("P16")
def test_a_stop_while_the_answer_is_held_drops_it_and_the_round_is_final(world_weights, tmp_path, monkeypatch):
    cfg, state = world_weights
    policy = site_policy(cfg, tmp_path, round_seconds=30.0)
    sigma = min_sigma_for(policy)
    monkeypatch.setattr("fedpose.client.site.time", _Stopped())
    with pytest.raises(SystemExit):
        handle_train(train_request(cfg, state, sigma=sigma), policy)
    monkeypatch.undo()
    (row,) = spend_rows(policy)
    assert (row["state"], row["noise_seed"]) == ("failed", None) and "interrupted" in row["outcome"]
    assert stored_reply(policy, "fed-test", 1) is None  # the reply that never left is not kept to be sent later
    trained = count_training(monkeypatch)
    monkeypatch.setattr("fedpose.client.site.time", _Clock())
    with pytest.raises(SiteFailure, match="failed after its charge"):
        handle_train(train_request(cfg, state, sigma=sigma), policy)
    assert trained == []


@pytest.mark.invariant("P18")
def test_every_answer_of_a_charged_round_leaves_on_its_own_requests_clock(world_weights, tmp_path, monkeypatch):
    """Fresh reply, stored reply, stored failure and the refusal of another request for a charged round: each
    leaves at the first multiple of round_seconds after its own request arrived, never at once."""
    cfg, state = world_weights
    period = 7.0
    policy = site_policy(cfg, tmp_path, round_seconds=period, max_rounds=3)
    sigma = min_sigma_for(policy)
    departures = []

    def answer(request) -> str:
        clock = _Clock()
        monkeypatch.setattr("fedpose.client.site.time", clock)
        arrived = clock.now
        try:
            handle_train(request, policy)
            kind = "reply"
        except SiteFailure:
            kind = "failure"
        except Refusal as refusal:
            kind = f"refusal {refusal.code.name}"
        departures.append((kind, clock.now - arrived))
        return kind

    assert answer(train_request(cfg, state, sigma=sigma)) == "reply"  # fresh
    assert answer(train_request(cfg, state, sigma=sigma)) == "reply"  # its stored reply
    huge = replace(cfg, **{"train.optimizer": "sgd", "train.lr": 1.0, "train.momentum": 0.0,
                           "train.weight_decay": 1e38})
    assert answer(train_request(huge, state, sigma=sigma, steps=2, round=2)) == "failure"  # fresh failure
    assert answer(train_request(huge, state, sigma=sigma, steps=2, round=2)) == "failure"  # its stored failure
    monkeypatch.undo()
    crash_mid_round(train_request(cfg, state, sigma=sigma, round=3), policy)
    other = train_request(replace(cfg, **{"train.lr": cfg.train.lr * 3}), state, sigma=sigma, round=3)
    assert answer(other) == f"refusal {RefusalCode.ALREADY_SPENT.name}"  # another request for a charged round
    assert [seconds for _, seconds in departures] == [period] * 5, departures


@pytest.mark.invariant("P16")
def test_a_round_whose_process_keeps_dying_replays_a_bounded_number_of_times(world_weights, tmp_path, monkeypatch):
    cfg, state = world_weights
    policy = site_policy(cfg, tmp_path, seed=9)
    sigma = min_sigma_for(policy)
    for _ in range(MAX_ATTEMPTS):  # the first run, then each replay of the identical request, killed mid-round
        crash_mid_round(train_request(cfg, state, sigma=sigma, steps=2), policy)
    (row,) = spend_rows(policy)
    assert (row["state"], row["attempts"]) == ("charged", MAX_ATTEMPTS)
    trained = count_training(monkeypatch)
    with pytest.raises(SiteFailure, match="failed after its charge"):
        handle_train(train_request(cfg, state, sigma=sigma, steps=2), policy)
    assert trained == []
    (row,) = spend_rows(policy)
    assert (row["state"], row["noise_seed"]) == ("failed", None) and row["epsilon"] > 0
