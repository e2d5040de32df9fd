"""The server side: plans, reply validation, the ledger (P5), resume reconciliation, transport, certs."""

from __future__ import annotations

import dataclasses
import os
import math

import pytest
import torch
from flwr.app import ArrayRecord, MetricRecord, RecordDict

from fedpose.server.ledger import Event, Report, ServerLedger, Spend, reconcile
from fedpose.server.plan import SitePlan, can_afford, plan_site
from fedpose.server.replies import Reply, process_replies
from fedpose.server.aggregate import aggregate
from support.federation import REPO
from fedpose.shared.configuration.schema import config_from_dict
from fedpose.shared.flower.messages import (
    ARRAYS,
    METRICS,
    REPLY_METRICS,
    RefusalCode,
    SiteInfo,
    TrainRequest,
    basis_record,
    record_basis,
    weights_record,
)
from fedpose.shared.privacy.accounting.accountant import StepRecord, epsilon_spent
from fedpose.shared.privacy.step.subspace import check_orthonormal

SHAPES = {"a.weight": torch.Size([3, 2]), "b.bias": torch.Size([4])}


def _plan(site: str, *, sigma: float = 1.2, q: float = 0.2, steps: int = 2, rounds: int = 3, eps: float = 2.0):
    return SitePlan(site=site, epsilon=eps, delta=1e-3, sample_rate=q, steps_per_round=steps, rounds=rounds,
                    sigma=sigma, accountant="rdp", site_min_sigma=0.0)


def _reply(site: str, *, weights: dict | None = None, drop: str | None = None, sigma: float = 1.2,
           site_eps: float = 0.5) -> Reply:
    weights = weights if weights is not None else {k: torch.ones(s) for k, s in SHAPES.items()}
    metrics = {"sigma": sigma, "sample-rate": 0.2, "steps": 2, "site-epsilon": site_eps, "run-epsilon": site_eps,
               "site-delta": 1e-3, "site-rounds": 1, "seeded": 0}
    assert set(metrics) == set(REPLY_METRICS)
    if drop:
        metrics.pop(drop)
    return Reply(site=site, content=RecordDict({ARRAYS: weights_record(weights), METRICS: MetricRecord(metrics)}))


def test_malformed_replies_are_rejected_never_averaged_and_refusals_mark_the_site():
    plans = {s: _plan(s) for s in ("good", "nan", "shape", "nometric", "budget", "noise")}
    nan = {k: torch.ones(s) for k, s in SHAPES.items()}
    nan["b.bias"][1] = math.nan
    shape = {"a.weight": torch.ones(2, 3), "b.bias": torch.ones(4)}
    replies = [
        _reply("good", weights={k: torch.full(s, 3.0) for k, s in SHAPES.items()}),
        _reply("nan", weights=nan),
        _reply("shape", weights=shape),
        _reply("nometric", drop="site-epsilon"),
        Reply(site="budget", error_code=int(RefusalCode.BUDGET), error_reason="would exceed eps"),
        Reply(site="noise", error_code=int(RefusalCode.WEAKER_NOISE), error_reason="sigma too low"),
    ]
    out = process_replies(replies, expected=SHAPES, plans=plans)
    assert out.accepted == ["good"] and len(out.updates) == 1
    assert torch.equal(out.updates[0]["a.weight"], torch.full((3, 2), 3.0))
    rejected = {e.site for e in out.events if e.kind == "rejected"}
    assert rejected == {"nan", "shape", "nometric"}
    # NaN / wrong-shape replies still describe what ran: that spend is recorded; a reply without its metrics,
    # and refusals without the site's spend, say nothing of what ran: counted at the plan (P13).
    assert {s.site: (s.aggregated, s.state) for s in out.spends} == {
        "good": (True, "completed"), "nan": (False, "completed"), "shape": (False, "completed"),
        "nometric": (False, "attempted"), "budget": (False, "attempted"), "noise": (False, "attempted")}
    assert out.statuses == {"budget": ("exhausted", "would exceed eps"), "noise": ("refused", "sigma too low")}


def test_aggregation_is_uniform_and_the_robust_aggregators_bound_one_site():
    """No site's weight comes from a number it reports (finding 15.4): uniform mean, median, trimmed mean."""
    updates = [{"w": torch.zeros(2)}, {"w": torch.ones(2)}]
    assert torch.allclose(aggregate(updates, "mean")["w"], torch.full((2,), 0.5))
    hostile = [{"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([1.2, 2.2])}, {"w": torch.tensor([1e30, -1e30])}]
    assert torch.allclose(aggregate(hostile, "median")["w"], torch.tensor([1.2, 2.0]))
    assert torch.allclose(aggregate(hostile, "trimmed-mean")["w"], torch.tensor([1.2, 2.0]))
    assert torch.allclose(aggregate(hostile[:2] + [hostile[0]], "median")["w"], torch.tensor([1.0, 2.0]))
    assert torch.allclose(aggregate(hostile[:2], "median")["w"], torch.tensor([1.1, 2.1]))
    with pytest.raises(ValueError, match="at least 3"):
        aggregate(hostile[:2], "trimmed-mean")


def test_by_default_no_single_site_can_plant_weights_in_the_average():
    """#21 finding 2: a site answering 2 x crafted - global made the uniform mean exactly the crafted model
    (planting a trigger in every other site's next round). The default bound scales every update to the
    round's lower-median norm first, so the hostile site moves the model no more than an honest one."""
    from fedpose.server.aggregate import bound_updates
    from fedpose.shared.configuration.schema import Config

    assert Config().federation.update_bound == "median"
    current = {"w": torch.zeros(4)}
    crafted = torch.tensor([1e6, -1e6, 3e5, 0.0])
    honest = [{"w": torch.tensor([0.1, 0.0, 0.0, 0.0])}, {"w": torch.tensor([0.0, 0.2, 0.0, 0.0])}]
    hostile = {"w": 2 * crafted - current["w"] - honest[1]["w"]}  # so that the plain mean of 2 is crafted
    unbounded = aggregate([honest[1], hostile], "mean")["w"]
    assert torch.allclose(unbounded, crafted)  # the attack, without the bound
    bounded, tau, scaled = bound_updates([*honest, hostile], current, "median")
    assert tau == pytest.approx(0.2) and scaled == [2]
    mean = aggregate(bounded, "mean")["w"]
    assert float(mean.norm()) <= 0.2 + 1e-6  # no more than an honest step, whatever the hostile site sent
    for two in ([honest[1], hostile], [hostile, honest[0]]):  # with two sites the bound is the smaller norm
        bounded, tau, _ = bound_updates(two, current, "median")
        assert all(float(u["w"].norm()) <= tau + 1e-6 for u in bounded)
    same, tau, scaled = bound_updates(honest, current, "none")
    assert same is honest and tau is None and scaled == []


def test_a_hostile_site_reply_is_rejected_by_the_bounds(tmp_path):
    """num-examples 10^12, weights of 1e30, site-delta 5: none of them reaches the aggregate (finding 15.4)."""
    plans = {s: _plan(s) for s in ("huge", "delta", "count", "fine")}
    global_weights = {k: torch.zeros(s) for k, s in SHAPES.items()}
    count = _reply("count")
    count.content["metrics"]["num-examples"] = 10**12  # an extra metric: replies carry exactly REPLY_METRICS
    delta = _reply("delta")
    delta.content["metrics"]["site-delta"] = 5.0
    replies = [_reply("huge", weights={k: torch.full(s, 1e30) for k, s in SHAPES.items()}), delta, count,
               _reply("fine", weights={k: torch.full(s, 0.1) for k, s in SHAPES.items()})]
    out = process_replies(replies, expected=SHAPES, plans=plans, global_weights=global_weights, max_update_norm=1.0)
    assert out.accepted == ["fine"]
    assert {e.site for e in out.events if e.kind == "rejected"} == {"huge", "delta", "count"}
    assert {s.site: (s.aggregated, s.state) for s in out.spends} == {  # every spend still counts
        "huge": (False, "completed"), "fine": (True, "completed"),
        "delta": (False, "attempted"), "count": (False, "attempted")}  # unreadable: at the plan


def test_a_refusal_carries_the_site_spend_and_the_run_claim_never_falls_below_it(tmp_path):
    """Finding 9.1: a site that spent a round the server never saw reports it in its next refusal."""
    from fedpose.shared.flower.messages import spend_suffix

    ledger = ServerLedger(tmp_path / "ledger.sqlite")
    plans = {"a": _plan("a"), "b": _plan("b")}
    ledger.save_plans(list(plans.values()))
    one = epsilon_spent([StepRecord(sigma=1.2, sample_rate=0.2, steps=2)], delta=1e-3)
    out = process_replies([_reply("a", site_eps=one), _reply("b", site_eps=one)], expected=SHAPES, plans=plans)
    ledger.record_round(1, out.spends, out.events, out.statuses, out.reports)
    # b trained round 2 and committed it, the server crashed before its reply; after resume b refuses.
    two = epsilon_spent([StepRecord(sigma=1.2, sample_rate=0.2, steps=4)], delta=1e-3)
    reason = "already took part" + spend_suffix(site_epsilon=two + 0.5, run_epsilon=two, site_rounds=3)
    out = process_replies([Reply(site="b", error_code=int(RefusalCode.BUDGET), error_reason=reason)],
                          expected=SHAPES, plans=plans)
    assert out.reports == [Report(site="b", source="refusal", site_epsilon=two + 0.5, run_epsilon=two, site_rounds=3)]
    assert out.events[0].reason == "already took part"  # the suffix is parsed off
    ledger.record_round(2, out.spends, out.events, out.statuses, out.reports)
    assert ledger.server_epsilon("b") == pytest.approx(one)
    assert ledger.counted_epsilon("b") == pytest.approx(two)  # never below the site's own ledger
    assert ledger.site_epsilon("b") == pytest.approx(two + 0.5)  # lifetime, named apart
    ledger.close()


@pytest.mark.invariant("P13")
def test_a_request_that_got_no_answer_counts_until_the_sites_own_report_covers_it(tmp_path):
    """P13: a site charges a round before reading a private record, so a node that died (or a reply that was
    lost) after a request may have spent it. The server counts the planned spend at once; the site's next own
    report (from its ledger) replaces it. Before: nothing counted, and a lost last reply left the claim below
    the site's ledger."""
    from flwr.common.constant import ErrorCode

    ledger = ServerLedger(tmp_path / "ledger.sqlite")
    plans = {"a": _plan("a")}
    ledger.save_plans(list(plans.values()))
    one = epsilon_spent([StepRecord(sigma=1.2, sample_rate=0.2, steps=2)], delta=1e-3)
    two = epsilon_spent([StepRecord(sigma=1.2, sample_rate=0.2, steps=4)], delta=1e-3)
    lost = Reply(site="a", error_code=int(ErrorCode.NODE_UNAVAILABLE), error_reason="no reply")
    out = process_replies([lost], expected=SHAPES, plans=plans)
    assert [(s.site, s.state, s.aggregated) for s in out.spends] == [("a", "attempted", False)]
    ledger.record_round(1, out.spends, out.events, out.statuses, out.reports)
    assert ledger.counted_epsilon("a") == pytest.approx(one)  # counted although nothing came back
    # the site came back: its reply reports its ledger (round 1 was never charged there: one round in all)
    out = process_replies([_reply("a", site_eps=one)], expected=SHAPES, plans=plans)
    ledger.record_round(2, out.spends, out.events, out.statuses, out.reports)
    assert [r["state"] for r in ledger.rows()] == ["resolved", "completed"]
    assert ledger.counted_epsilon("a") == pytest.approx(one)  # not two: its own report covers the lost request
    # a lost reply in the last round is never covered, and stays counted
    out = process_replies([lost], expected=SHAPES, plans=plans)
    ledger.record_round(3, out.spends, out.events, out.statuses, out.reports)
    assert ledger.counted_epsilon("a") == pytest.approx(two)
    ledger.close()


@pytest.mark.invariant("P13")
def test_every_error_without_the_sites_spend_counts_as_attempted():
    """P13: only a site's own report says it spent nothing. A SuperNode killed mid-round may come back as
    Flower's "ClientApp crashed" or "reply unavailable" instead of "node unavailable", and a reply the server
    cannot read says nothing of what ran: each counts at the plan, like a request that got no answer. A
    refusal that carries the site's spend, and a site asking for V (sent again this round), do not."""
    from flwr.common.constant import ErrorCode

    from fedpose.shared.flower.messages import spend_suffix

    flower = {"crashed": ErrorCode.CLIENT_APP_CRASHED, "expired": ErrorCode.REPLY_MESSAGE_UNAVAILABLE,
              "lost": ErrorCode.MESSAGE_UNAVAILABLE, "raised": ErrorCode.CLIENT_APP_RAISED_EXCEPTION}
    plans = {s: _plan(s) for s in (*flower, "bare", "unread", "told", "basis")}
    replies = [Reply(site=s, error_code=int(code), error_reason="Flower says so") for s, code in flower.items()]
    replies += [
        Reply(site="bare", error_code=int(RefusalCode.SITE_ERROR), error_reason="the site failed"),  # no spend
        _reply("unread", drop="steps"),
        Reply(site="told", error_code=int(RefusalCode.ALREADY_SPENT),
              error_reason="already" + spend_suffix(site_epsilon=0.4, run_epsilon=0.4, site_rounds=1)),
        Reply(site="basis", error_code=int(RefusalCode.NEED_BASIS), error_reason="send V"),
    ]
    out = process_replies(replies, expected=SHAPES, plans=plans)
    attempted = sorted(s.site for s in out.spends if s.state == "attempted")
    assert attempted == sorted([*flower, "bare", "unread"])
    assert all((s.sigma, s.sample_rate, s.steps, s.aggregated) == (1.2, 0.2, 2, False) for s in out.spends)
    assert [r.site for r in out.reports] == ["told"] and out.need_basis == ["basis"]


@pytest.mark.invariant("P13")
def test_a_request_sent_before_the_server_died_counts_on_resume_until_the_site_reports(tmp_path):
    """P13: the ServerApp sent round 2 and died before any reply; the site charged it. On resume the ledger
    counts it at the plan (once, however often it was sent), until the site's own report of round 2 covers it;
    before, a site that never answered the resumed server again was claimed one round short."""
    from flwr.common.constant import ErrorCode

    ledger = ServerLedger(tmp_path / "ledger.sqlite")
    plans = {"a": _plan("a"), "b": _plan("b")}
    ledger.save_plans(list(plans.values()))
    one = epsilon_spent([StepRecord(sigma=1.2, sample_rate=0.2, steps=2)], delta=1e-3)
    two = epsilon_spent([StepRecord(sigma=1.2, sample_rate=0.2, steps=4)], delta=1e-3)
    out = process_replies([_reply("a", site_eps=one), _reply("b", site_eps=one)], expected=SHAPES, plans=plans)
    ledger.record_sent(1, ["a", "b"])
    ledger.record_round(1, out.spends, out.events, out.statuses, out.reports)
    snapshot = ledger.snapshot()
    for _ in range(2):  # sent twice (the first resume died too): a site charges a round once
        ledger.record_sent(2, ["a", "b"])
        reconcile(ledger, snapshot, through_round=1)
    assert [(r["site"], r["round"], r["state"]) for r in ledger.rows()][2:] == [("a", 2, "attempted"),
                                                                              ("b", 2, "attempted")]
    assert ledger.counted_epsilon("a") == ledger.counted_epsilon("b") == pytest.approx(two)
    # asking round 2 again costs at most that one round: planning it leaves its own attempted row out
    assert ledger.history("a", asking=2) == ledger.history("a")[:1]
    assert ledger.counted_epsilon("a", asking=2) == pytest.approx(one)
    # the resumed round 2: a answers (its report covers its round 2), b is never heard from again
    ledger.record_sent(2, ["a", "b"])
    lost = Reply(site="b", error_code=int(ErrorCode.NODE_UNAVAILABLE), error_reason="no reply")
    out = process_replies([_reply("a", site_eps=two), lost], expected=SHAPES, plans=plans)
    ledger.record_round(2, out.spends, out.events, out.statuses, out.reports)
    assert ledger.counted_epsilon("a") == pytest.approx(two)  # not three rounds: its report covers the send
    assert [r["epsilon"] for r in ledger.rows() if r["site"] == "a"][-1] == pytest.approx(two)  # and its row says so
    assert ledger.counted_epsilon("b") == pytest.approx(two)  # never below what b's own ledger may hold
    ledger.close()


@pytest.mark.invariant("P13")
def test_a_round_rerun_after_an_interrupted_checkpoint_counts_once(tmp_path):
    """P13: round 2's spend was committed, then the server died before its checkpoint; the resumed server asks round 2
    again and the site replays that one charge. The ledger counts round 2 once: planning it again leaves its
    interrupted row out, and the site's reply of the rerun replaces that row (before, the rerun counted 3 rounds)."""
    ledger = ServerLedger(tmp_path / "ledger.sqlite")
    plans = {"a": _plan("a")}
    ledger.save_plans(list(plans.values()))
    one, two = (epsilon_spent([StepRecord(sigma=1.2, sample_rate=0.2, steps=2 * n)], delta=1e-3) for n in (1, 2))
    for rnd, eps in ((1, one), (2, two)):
        ledger.record_sent(rnd, ["a"])
        out = process_replies([_reply("a", site_eps=eps)], expected=SHAPES, plans=plans)
        ledger.record_round(rnd, out.spends, out.events, out.statuses, out.reports)
        if rnd == 1:
            snapshot = ledger.snapshot()
    assert reconcile(ledger, snapshot, through_round=1) == 1
    assert ledger.counted_epsilon("a") == pytest.approx(two)  # the interrupted round was spent
    assert ledger.history("a", asking=2) == ledger.history("a")[:1]
    assert ledger.server_epsilon("a", asking=2) == pytest.approx(one)
    ledger.record_sent(2, ["a"])
    out = process_replies([_reply("a", site_eps=two)], expected=SHAPES, plans=plans)  # the replayed release
    ledger.record_round(2, out.spends, out.events, out.statuses, out.reports)
    assert ledger.counted_epsilon("a") == ledger.server_epsilon("a") == pytest.approx(two)
    assert [(r["round"], r["state"]) for r in ledger.rows()] == [(1, "completed"), (2, "resolved"), (2, "completed")]
    assert ledger.rows()[-1]["epsilon"] == pytest.approx(two)
    ledger.close()


@pytest.mark.invariant("P5")
def test_ledger_recomputes_epsilon_counts_the_larger_and_resume_keeps_interrupted_spend(tmp_path):
    ledger = ServerLedger(tmp_path / "ledger.sqlite")
    plan = _plan("s0")
    ledger.save_plans([plan])
    ledger.record_round(1, [Spend(site="s0", sigma=1.2, sample_rate=0.2, steps=2, site_epsilon=None,
                                  aggregated=True)], [])
    one = epsilon_spent([StepRecord(sigma=1.2, sample_rate=0.2, steps=2)], delta=1e-3)
    assert ledger.server_epsilon("s0") == pytest.approx(one, rel=1e-12)
    # Round 2: the site reports more than the server recomputes (it spent elsewhere): the larger counts.
    rows = ledger.record_round(2, [Spend(site="s0", sigma=1.2, sample_rate=0.2, steps=2, site_epsilon=5.0,
                                         run_epsilon=5.0, aggregated=True)],
                               [Event(site="s0", kind="rejected", code=0, reason="x")])
    two = epsilon_spent([StepRecord(sigma=1.2, sample_rate=0.2, steps=4)], delta=1e-3)
    assert rows[0]["epsilon"] == pytest.approx(two, rel=1e-12) and rows[0]["mismatch"] == 1
    assert ledger.counted_epsilon("s0") == 5.0
    assert not can_afford(plan, ledger.history("s0"), site_epsilon=ledger.counted_epsilon("s0"))

    snapshot = ledger.snapshot()
    # A 3rd round is committed but the server dies before its checkpoint: on resume the rows
    # checkpointed stay identical and the uncheckpointed spend is kept (it happened), marked.
    ledger.record_round(3, [Spend(site="s0", sigma=1.2, sample_rate=0.2, steps=2, site_epsilon=None,
                                  aggregated=True)], [])
    assert reconcile(ledger, snapshot, through_round=2) == 1
    states = [(r["round"], r["state"]) for r in ledger.rows()]
    assert states == [(1, "completed"), (2, "completed"), (3, "interrupted")]
    assert len(ledger.history("s0")) == 3
    with pytest.raises(ValueError):  # validated before anything is written
        ledger.record_round(4, [Spend(site="s0", sigma=-1.0, sample_rate=0.2, steps=2, site_epsilon=None,
                                      aggregated=True)], [])
    assert len(ledger.rows()) == 3
    ledger.close()


def test_unanswered_counts_the_attempted_rows_history_counts_at_the_plan(tmp_path):
    ledger = ServerLedger(tmp_path / "ledger.sqlite")
    ledger.save_plans([_plan("s0")])

    def spend(state):
        return Spend(site="s0", sigma=1.2, sample_rate=0.2, steps=2, site_epsilon=None, aggregated=False,
                     state=state)

    ledger.record_round(1, [spend("completed")], [])
    ledger.record_round(2, [spend("attempted")], [])
    ledger.record_round(3, [spend("attempted")], [])
    assert ledger.unanswered("s0") == 2 and len(ledger.history("s0")) == 3
    # asking round 3 again: its own attempted row is not counted, round 2's is
    assert ledger.unanswered("s0", asking=3) == 1 and len(ledger.history("s0", asking=3)) == 2
    assert ledger.unanswered("s0", asking=2) == 0 and len(ledger.history("s0", asking=2)) == 1
    ledger.close()


def test_plan_meets_the_budget_and_stops_sampling_after_it():
    cfg = config_from_dict({"privacy": {"epsilon": 1.0, "delta": 1e-5}, "train": {"batch_size": 32},
                            "federation": {"rounds": 4, "local_steps": 5}})
    info = SiteInfo(site="s", epsilon=3.0, delta=1e-5, lifetime_rounds=10, rounds_per_federation=10, rounds_done=0,
                    epsilon_spent=0.0, min_sigma=0.5, sample_rate=0.08, steps_per_round=5, clip_norm=1.0, psi="blur",
                    psi_min=0.03, augment=True, accountant="rdp", methods=("dpsgd", "proj", "fdp", "fpdp"))
    plan = plan_site(info, cfg)
    assert plan.epsilon == 1.0 and plan.rounds == 4 and plan.sample_rate == pytest.approx(0.08)
    history: list[StepRecord] = []
    for _ in range(plan.rounds):
        assert can_afford(plan, history)
        history.append(plan.step_record())
    assert epsilon_spent(history, delta=1e-5) <= 1.0
    assert not can_afford(plan, history)
    stricter = plan_site(dataclasses.replace(info, min_sigma=50.0), cfg)
    assert stricter.sigma == 50.0  # the site's own minimum wins over the server's calibration
    # A site whose policy the config cannot satisfy is left out (it would refuse anyway).
    for change in ({"steps_per_round": 4}, {"clip_norm": 0.5}, {"psi_min": 0.1}, {"augment": False},
                   {"methods": ("dpsgd",)}):
        assert plan_site(dataclasses.replace(info, **change), cfg) is None, change


def test_basis_travels_as_float16_with_its_version_and_stays_orthonormal():
    v, _ = torch.linalg.qr(torch.randn(20000, 16, dtype=torch.float64))
    record = basis_record(v.float(), version=7, dtype="float16")
    assert record["V"].dtype == "float16"
    assert record.count_bytes() < 20000 * 16 * 2 + 1000  # half of float32
    version, back = record_basis(record)
    assert version == 7 and back.dtype == torch.float32
    check_orthonormal(back, tol=1e-3)
    bad = ArrayRecord({"V": record["V"]})
    with pytest.raises(ValueError):
        record_basis(bad)


def test_basis_is_resent_only_for_a_new_version_or_to_a_site_that_lost_it(tmp_path):
    from fedpose.server.basis import BasisKeeper

    cfg = config_from_dict({"privacy": {"basis_every": 3}, "federation": {"basis_mode": "broadcast"}})
    keeper = BasisKeeper(cfg, public=[])
    keeper.version, keeper.record = 1, "V1"  # as after refresh(1, ...)
    assert keeper.attach_for("s") == "V1"
    keeper.mark_held("s")
    assert keeper.attach_for("s") is None  # unchanged V: not re-sent
    assert not keeper.due(2) and not keeper.due(3) and keeper.due(4)
    keeper.forget("s")  # the site answered NEED_BASIS (lost its cache)
    assert keeper.attach_for("s") == "V1"
    site_mode = BasisKeeper(config_from_dict({"federation": {"basis_mode": "site"}}), public=[])
    site_mode.version = 1
    assert site_mode.attach_for("s") is None  # sites compute V themselves


def test_weights_travel_as_one_array_whatever_the_number_of_tensors_and_malformed_records_are_refused():
    """Flower moves each array as objects of its own, each fetched with a signed request: the weights of a model of
    any number of tensors are a handful of objects per message, and read back exactly."""
    import numpy as np
    from flwr.app import Array
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

    from fedpose.shared.configuration.schema import ModelConfig
    from fedpose.shared.flower.messages import record_tensors
    from fedpose.shared.model.posenet import build_model

    state = build_model(ModelConfig(variant="tinyvit-5m"), (32, 32)).state_dict()
    assert len(state) > 190
    record = weights_record(state)
    back = record_tensors(record)
    assert list(back) == list(state) and all(torch.equal(back[k], state[k]) for k in state)
    assert len(get_all_nested_objects(record)) < 12  # the objects Flower moves for 197 tensors (23 MB)

    good = {k: v.numpy() for k, v in record.items()}
    layout = good["layout"]
    bad_records = {
        "one array per tensor": ArrayRecord({k: Array(v.numpy()) for k, v in list(state.items())[:3]}),
        "values of another dtype": {"values": good["values"].astype(np.float64), "layout": layout},
        "layout not JSON": {"values": good["values"], "layout": np.frombuffer(b"[[", np.uint8).copy()},
        "layout not names and shapes": {"values": good["values"],
                                        "layout": np.frombuffer(b'[["a", [-1]]]', np.uint8).copy()},
        "sizes that do not add up": {"values": good["values"][:-1], "layout": layout},
        "a name twice": {"values": np.zeros(2, np.float32),
                         "layout": np.frombuffer(b'[["a", [1]], ["a", [1]]]', np.uint8).copy()},
    }
    for what, rec in bad_records.items():
        if not isinstance(rec, ArrayRecord):
            rec = ArrayRecord({k: Array(v) for k, v in rec.items()})
        with pytest.raises(ValueError):
            record_tensors(rec)
        assert what
    with pytest.raises(ValueError, match="float32"):
        weights_record({"a": torch.zeros(2, dtype=torch.int64)})


def test_train_request_round_trips_and_rejects_missing_fields():
    cfg = config_from_dict({})
    request = TrainRequest(federation="f", round=2, site="s", sigma=1.5, sample_rate=0.1, steps=3, basis_version=1,
                           basis_mode="site", config=cfg)
    record = request.to_record()
    assert TrainRequest.from_record(record) == request
    record["public-hashes"] = ["abc"]  # nothing the site does not know is accepted
    with pytest.raises(ValueError, match="unknown field 'public-hashes'"):
        TrainRequest.from_record(record)
    del record["public-hashes"]
    del record["sigma"]
    with pytest.raises(ValueError, match="sigma"):
        TrainRequest.from_record(record)


def test_certs_are_usable_by_flower(tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key, load_ssh_public_key

    from fedpose.server.kits.certs import make_certs

    make_certs(tmp_path, nodes=2, hosts=["localhost", "127.0.0.1"], days=2)
    ca = x509.load_pem_x509_certificate((tmp_path / "ca.crt").read_bytes())
    server = x509.load_pem_x509_certificate((tmp_path / "server.pem").read_bytes())
    server.verify_directly_issued_by(ca)
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "localhost" in san.get_values_for_type(x509.DNSName)
    # 127.0.0.1 as asked, and ::1 always (with localhost, the names the SuperLink's own SuperExec dials)
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1", "::1"]
    for i in (1, 2):
        key = load_ssh_private_key((tmp_path / f"node-{i}").read_bytes(), password=None)
        pub = load_ssh_public_key((tmp_path / f"node-{i}.pub").read_bytes())
        assert key.public_key().public_numbers() == pub.public_numbers()
        assert oct((tmp_path / f"node-{i}").stat().st_mode & 0o777) == "0o600"
    with pytest.raises(ValueError, match="already holds"):
        make_certs(tmp_path, nodes=1, hosts=["localhost"], days=2)
    # --force rewrites every file as a new inode: a key left at 0644 comes back 0600 (before: the old mode stayed)
    for name in ("ca.key", "server.key", "node-1"):
        os.chmod(tmp_path / name, 0o644)
    old = (tmp_path / "node-1").read_bytes()
    make_certs(tmp_path, nodes=1, hosts=["localhost"], days=2, force=True)
    for name in ("ca.key", "server.key", "node-1"):
        assert oct((tmp_path / name).stat().st_mode & 0o777) == "0o600", name
    assert (tmp_path / "node-1").read_bytes() != old
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_site_makes_its_own_key_pair_and_only_the_public_key_leaves(tmp_path, capsys):
    """#21 finding 9: the operator no longer holds a site's node private key, so node authentication tells a
    site from the operator. ``fedpose site keygen`` writes the pair at the site; Flower reads both."""
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key, load_ssh_public_key

    from fedpose.cli.main import main

    site = tmp_path / "hospital-a"
    assert main(["site", "keygen", "--out", str(site)]) == 0
    key = load_ssh_private_key((site / "node.key").read_bytes(), password=None)
    pub = load_ssh_public_key((site / "node.key.pub").read_bytes())
    assert key.public_key().public_numbers() == pub.public_numbers()
    assert oct((site / "node.key").stat().st_mode & 0o777) == "0o600"
    assert "send node.key.pub" in capsys.readouterr().out
    assert main(["site", "keygen", "--out", str(site)]) == 3  # never silently replaces a registered key
    assert "already holds" in capsys.readouterr().err
    assert main(["site", "keygen", "--out", str(REPO / "keys-here")]) == 3  # never inside a git work tree
    assert not (REPO / "keys-here").exists()
