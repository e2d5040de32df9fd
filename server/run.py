"""The server's round loop over a Flower Grid (docs/explanation/design.md: one federated round).

Per round: choose the sites that can still afford a planned round, refresh
V if due, send each site the global weights (+ V if it lacks that version)
and its own request, validate replies, record every spend in the ledger
(server-recomputed epsilon next to the site's own, and the spend every
refusal reports), aggregate the valid replies (if at least ``min_sites``;
uniform over sites, each update norm-bounded, optionally median or trimmed
mean: one hostile site cannot dominate), evaluate on the validation split and
checkpoint weights + ledger + round atomically.

The loop is here (``run_federation``, ``finish``), in named phases (``_run_federation``
lists them); what it calls lives beside it: ``fedpose.server.exchange`` (the Grid),
``fedpose.server.replies`` (sorting replies), ``fedpose.server.aggregate`` (bounding,
combining, the server optimizer).
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fedpose.server.aggregate import ServerOptimizer, aggregate, bound_updates, server_optimizer
from fedpose.server.basis import BasisKeeper
from fedpose.server.checkpoint import ServerState, load_state, save_state
from fedpose.server.federable import refuse_centralized_only
from fedpose.server.exchange import describe_sites, exchange, sites_for_round
from fedpose.server.ledger import Event, ServerLedger, reconcile
from fedpose.server.outcome import (FederationStopped, clear_outcome, discarded_events, final_statuses, record_failure,
                            sole_server)
from fedpose.server.plan import SitePlan, left_out, plan_site
from fedpose.server.policy_watch import watch
from fedpose.server.prepare import require_prepared
from fedpose.server.replies import Reply, RoundOutcome, node_unavailable, process_replies
from fedpose.server.report import append_round, write_plot, write_report, write_rounds
from fedpose.shared.configuration.schema import Config, dump_config
from fedpose.shared.flower.messages import ARRAYS, BASIS, CONFIG, TrainRequest, payload_bytes, weights_record
from fedpose.shared.training.provenance import configure_numerics, provenance
from fedpose.shared.configuration.methods import WITH_PUBLIC

if TYPE_CHECKING:  # the model module is imported where it is used
    from fedpose.shared.data.records import PoseRecord
    from fedpose.shared.model.posenet import PoseNet

log = logging.getLogger(__name__)


def federation_release(cfg: Config) -> str:
    """What a federation releases to the server besides the DP-noised weights (named in the claim, P10, P13)."""
    combine = ("every site's update is scaled to at most the round's median update norm, then sites are averaged "
               "uniformly" if cfg.federation.update_bound == "median" else
               "sites are averaged uniformly with no bound on one site's update")
    return ("the server sees each site's DP-noised weights and what its policy declares public (sample rate q and "
            "expected batch B, which tell the size of its data when the policy was written; steps, clip, psi, "
            "privacy unit, records cap, budget, spend), whether its files changed since its operator checked "
            "them, and how long a round took unless the site's policy sets round_seconds (a fixed reply time); "
            "never n itself or anything else that depends on private data; " + combine)


@dataclass(frozen=True)
class Paths:
    out: Path

    @property
    def ledger(self) -> Path:
        return self.out / "ledger.sqlite"

    @property
    def checkpoint(self) -> Path:
        return self.out / "checkpoint.pt"

    @property
    def rounds(self) -> Path:
        return self.out / "rounds.jsonl"


def run_federation(grid: Any, cfg: Config, out: str | Path, *, resume: bool = False) -> dict[str, Any]:
    """Run (or resume) the federation of ``cfg`` over ``grid``; writes everything into ``out`` (one server at a time).

    A run that cannot go on raises ``FederationStopped`` (one line); why any run failed is kept in
    ``out/outcome.json`` for ``fedpose server status`` and ``fedpose server run``.
    """
    out = Path(out)
    with sole_server(out):
        clear_outcome(out)
        try:
            return _run_federation(grid, cfg, out, resume=resume)
        except Exception as err:
            record_failure(out, err)
            raise


@dataclass(frozen=True)
class Opened:
    """A federation's folder, data, initial model and ledger, before it is known to be new or resumed."""

    paths: Paths
    ledger: ServerLedger
    model: PoseNet
    trainable: list[str]
    public: list[PoseRecord]
    val: list[PoseRecord]


@dataclass(frozen=True)
class Begun:
    """Where the federation starts: a new one at round 1, or the resumed one after its last checkpoint."""

    federation: str  # the id sent to the sites
    history: list[dict[str, Any]]  # rounds.jsonl records so far; each round appends its own
    start: int  # the first round to run
    optimizer_state: dict[str, Any] | None  # the server optimizer's moments from the checkpoint
    resumed: bool


@dataclass
class Federation:
    """What travels between the phases of a running federation.

    Fixed once the sites are planned, except ``node_of`` (each site's node, refreshed every round), ``recheck``
    (the sites to ask again what their policy declares), ``noticed`` (events not recorded in the ledger yet) and
    ``history`` (one record per round).
    """

    grid: Any
    cfg: Config
    paths: Paths
    ledger: ServerLedger
    model: PoseNet
    trainable: list[str]
    val: list[PoseRecord]
    federation: str
    history: list[dict[str, Any]]
    plans: dict[str, SitePlan]
    node_of: dict[str, int]
    keeper: BasisKeeper
    server_opt: ServerOptimizer  # server/aggregate.py; its moments are in the checkpoint
    noticed: list[Event]
    recheck: set[str] = field(default_factory=set)  # sites to ask again what their policy declares
    paces: list[float] = field(default_factory=list)  # wall seconds of each round this process ran: the estimate
    mark: float = field(default_factory=time.monotonic)  # when the last of them ended (or the run began here)


@dataclass(frozen=True)
class Chosen:
    """The sites asked to train in a round, and the planned sites whose SuperNode is offline."""

    active: list[str]
    offline: list[str]


@dataclass(frozen=True)
class Exchanged:
    """A round's requests and replies: the replies and what they sort into, the bytes sent to each site, and the
    seconds the basis refresh and the exchange took."""

    replies: list[Reply]
    outcome: RoundOutcome
    down: dict[str, int]
    seconds_basis: float
    seconds_train: float


@dataclass(frozen=True)
class Aggregated:
    """Whether a round's updates moved the global model, the bound on their norm, and which were scaled to it."""

    aggregated: bool
    tau: float | None
    scaled: list[int]  # indices into the round's accepted sites, in site order
    seconds: float


@dataclass(frozen=True)
class Evaluated:
    """The global model's score on the validation split after a round."""

    report: dict[str, Any]
    seconds: float


def _run_federation(grid: Any, cfg: Config, out: str | Path, *, resume: bool) -> dict[str, Any]:
    """The federation in phases: open its folder, data, model and ledger; begin it (new, or resumed from its
    checkpoint); plan the sites. Then per round: choose the sites that can take part, exchange the requests and
    replies, aggregate the valid updates, evaluate the global model, record the round in the ledger, checkpoint
    it. Last, ``finish``: the final model, the metrics and the claim, the report."""
    t_start = time.perf_counter()
    opened = _open(cfg, Path(out))
    begun = _begin(cfg, opened, resume=resume)
    run = _plan(grid, cfg, opened, begun)
    for rnd in range(begun.start, cfg.federation.rounds + 1):
        chosen = _choose(run, rnd)
        if chosen is None:
            break
        sent = _exchange(run, rnd, chosen.active)
        aggregated = _aggregate(run, sent.outcome)
        evaluated = _evaluate(run)
        _record(run, rnd, sent, aggregated)
        _checkpoint(run, rnd, _round_record(run, rnd, chosen, sent, aggregated, evaluated))
    metrics = finish(cfg, run.paths, run.model, run.val, run.ledger, run.plans, run.history, run.federation,
                     seconds=time.perf_counter() - t_start)
    run.ledger.close()
    return metrics


def _open(cfg: Config, out: Path) -> Opened:
    """The run folder, the public and validation splits, the initial model and the server ledger; a config only a
    centralized run can honour, or a server that is not prepared, is refused first."""
    from fedpose.shared.data.mpii import load_split
    from fedpose.shared.model.strategy import apply_train_strategy
    from fedpose.shared.training.runs import initial_model

    configure_numerics(cfg.runtime.threads, deterministic=cfg.runtime.deterministic)
    paths = Paths(out)
    paths.out.mkdir(parents=True, exist_ok=True)
    refuse_centralized_only(cfg)
    require_prepared(cfg)  # server/prepare.py: public data and pretrained weights exist (no silent generation)
    root = Path(cfg.data.root)
    public = load_split(root, cfg.data.public_split)
    val = load_split(root, cfg.data.val_split)
    model = initial_model(cfg, progress=False)  # present: checked above
    trainable = apply_train_strategy(model, cfg.train)
    return Opened(paths=paths, ledger=ServerLedger(paths.ledger), model=model, trainable=trainable, public=public,
                  val=val)


def _begin(cfg: Config, opened: Opened, *, resume: bool) -> Begun:
    """A new federation (a fresh id, the initial model's score kept), or the resumed one: from its checkpoint
    (weights, history, the server optimizer's moments; the ledger reconciled with its snapshot), or from round 1
    under the same id when the server died before its first checkpoint. Writes rounds.jsonl and config.yaml."""
    from fedpose.shared.metrics.evaluation import evaluate

    paths, ledger, model = opened.paths, opened.ledger, opened.model
    optimizer_state = None
    history: list[dict[str, Any]]
    if resume and not paths.checkpoint.exists() and (known := ledger.get_meta("federation")) is not None:
        # The server died before its first checkpoint: the sites may already have charged round 1 of this
        # federation, so it starts again under the SAME id (a site then replays or resends, never spends twice).
        federation, history, start = known, [], 1
        reconcile(ledger, {"spend": [], "events": [], "reports": [], "sites": [], "meta": {}}, through_round=0)
        write_rounds(paths.rounds, [])
        log.info("resuming federation %s before its first checkpoint: from round 1", federation)
    elif resume:
        state = load_state(paths.checkpoint)
        model.load_state_dict(state.weights)
        federation, history, start = state.federation, state.history, state.round + 1
        optimizer_state = state.optimizer
        reconcile(ledger, state.ledger, through_round=state.round)
        write_rounds(paths.rounds, history)
        log.info("resuming federation %s at round %d", federation, start)
    else:
        if paths.checkpoint.exists() or ledger.rows():
            raise ValueError(f"{paths.out} already holds a federation (checkpoint or ledger): "
                             "resume it with --resume or choose another --out")
        federation, history, start = uuid.uuid4().hex[:12], [], 1
        ledger.set_meta("federation", federation)
        initial, _, _ = evaluate(model, opened.val)
        ledger.set_meta("initial_pckh_mean", repr(float(initial["pckh"]["mean"])))
        write_rounds(paths.rounds, [])
    dump_config(cfg, paths.out / "config.yaml")
    return Begun(federation=federation, history=history, start=start, optimizer_state=optimizer_state,
                 resumed=resume)


def _plan(grid: Any, cfg: Config, opened: Opened, begun: Begun) -> Federation:
    """Ask the sites who they are, plan each new one once (its sigma, q and steps for its budget), keep what each
    declares against what it declared before this server (re)started (issue #9), and stop when fewer than
    ``min_sites`` can take part. Then the basis keeper and the server optimizer (its moments restored on resume);
    a resumed federation says so in the ledger, with what was noticed."""
    ledger = opened.ledger
    sites = describe_sites(grid, cfg)
    plans = ledger.plans()
    new_plans = [p for s, (_, info) in sorted(sites.items()) if s not in plans and (p := plan_site(info, cfg))]
    if new_plans:
        ledger.save_plans(new_plans)
        plans = ledger.plans()
    for site, (_, info) in sites.items():  # what each site's policy states, for the claim (issue #11)
        ledger.set_meta(f"max_records_per_patient/{site}", str(info.max_records_per_patient or 0))
    node_of = {s: nid for s, (nid, _) in sites.items()}
    # What each site declares, against what it declared before this server (re)started (issue #9).
    noticed = watch(ledger, plans, {s: info for s, (_, info) in sites.items()}, cfg)
    usable = sorted(s for s in plans if s in node_of)
    if len(usable) < cfg.federation.min_sites:
        why = [f"{s} {left_out(info, cfg) or 'has no plan'}" for s, (_, info) in sorted(sites.items())
               if s not in usable]
        why += [f"{s} did not describe itself" for s in sorted(plans) if s not in node_of]
        head = f"only {len(usable)} site(s) can take part ({', '.join(usable)})" if usable else \
            "no site can take part"
        raise FederationStopped(f"{head}, fewer than federation.min_sites={cfg.federation.min_sites}: "
                                + ("; ".join(why) or "no site described itself (see the sites' logs)"))
    keeper = BasisKeeper(cfg, opened.public)
    server_opt = server_optimizer(cfg)  # server/aggregate.py; its moments are in the checkpoint
    if begun.optimizer_state is not None:
        server_opt.load_state_dict(begun.optimizer_state)

    if begun.resumed:
        start = begun.start
        ledger.record_round(start - 1, [], [Event(site="(server)", kind="resumed", code=0,
                                                  reason=f"server resumed from the checkpoint of round {start - 1}"),
                                            *noticed])
        noticed = []
    return Federation(grid=grid, cfg=cfg, paths=opened.paths, ledger=ledger, model=opened.model,
                      trainable=opened.trainable, val=opened.val, federation=begun.federation, history=begun.history,
                      plans=plans, node_of=node_of, keeper=keeper, server_opt=server_opt, noticed=noticed)


def _choose(run: Federation, rnd: int) -> Chosen | None:
    """The sites that take part in round ``rnd``, or None when fewer than ``min_sites`` can: no site is asked to
    train for a round that cannot count, and why the federation stops is recorded in the ledger's events."""
    cfg = run.cfg
    active, offline, changed, waiting = sites_for_round(run.grid, run.node_of, run.plans, run.ledger, cfg, rnd,
                                                        recheck=run.recheck)
    run.noticed += changed
    if len(active) >= cfg.federation.min_sites:
        return Chosen(active=active, offline=offline)
    if active or waiting:
        waits = "; ".join(f"{s}: {r}" for s, r in waiting.items()) or "the others have no rounds left"
        stopped = (f"round {rnd}: only {len(active)} site(s) can take part ({', '.join(active) or 'none'}), "
                   f"fewer than federation.min_sites={cfg.federation.min_sites} ({waits}); stopping")
        log.warning("%s", stopped)
        run.noticed.append(Event(site="(server)", kind="stopped", code=0, reason=stopped))
    else:
        log.info("round %d: every site's planned rounds or budget are done", rnd)
    if run.noticed:
        run.ledger.record_round(rnd, [], run.noticed)
    return None


def _content_for(run: Federation, rnd: int, arrays: Any, site: str, *, force_basis: bool = False) -> Any:
    """The train message of ``site`` in round ``rnd``: the global weights, its own request, and V when it lacks
    that version (``force_basis``: it lost its cached V, so V is sent whatever it held)."""
    from flwr.app import RecordDict

    plan = run.plans[site]
    request = TrainRequest(federation=run.federation, round=rnd, site=site, sigma=plan.sigma,
                           sample_rate=plan.sample_rate, steps=plan.steps_per_round,
                           basis_version=run.keeper.version, basis_mode=run.cfg.federation.basis_mode, config=run.cfg)
    content = RecordDict({ARRAYS: arrays, CONFIG: request.to_record()})
    if force_basis:
        run.keeper.forget(site)
    basis = run.keeper.attach_for(site)
    if basis is not None:
        content[BASIS] = basis
    return content


def _exchange(run: Federation, rnd: int, active: list[str]) -> Exchanged:
    """Refresh V if due, send each active site its train message, and sort the replies (``process_replies``); a
    site that lost its cached V is sent its message once more, with V. Every request is written down in the
    ledger before it is sent."""
    cfg, keeper = run.cfg, run.keeper
    seconds_basis = keeper.refresh(rnd, run.model, run.trainable)
    arrays = weights_record(run.model.state_dict())
    named = dict(run.model.named_parameters())
    expected = {name: named[name].shape for name in run.trainable}

    t0 = time.perf_counter()
    contents = {site: _content_for(run, rnd, arrays, site) for site in active}
    down = {site: payload_bytes(c) for site, c in contents.items()}
    run.ledger.record_sent(rnd, sorted(contents))  # before sending: a site may charge it even if we die now (P13)
    replies = exchange(run.grid, contents, run.node_of, rnd, cfg.federation.round_timeout)
    global_now = {name: named[name].detach().clone() for name in run.trainable}
    bound = cfg.federation.max_update_norm
    outcome = process_replies(replies, expected=expected, plans=run.plans, keeper=keeper, global_weights=global_now,
                              max_update_norm=bound)
    if outcome.need_basis:  # a site lost its cached V: send it once more, with V
        retry = {site: _content_for(run, rnd, arrays, site, force_basis=True) for site in outcome.need_basis}
        for site, c in retry.items():
            down[site] += payload_bytes(c)
        again = exchange(run.grid, retry, run.node_of, rnd, cfg.federation.round_timeout)
        more = process_replies(again, expected=expected, plans=run.plans, keeper=keeper, global_weights=global_now,
                               max_update_norm=bound)
        for name in ("updates", "spends", "events", "reports", "need_basis", "accepted"):
            getattr(outcome, name).extend(getattr(more, name))
        outcome.statuses.update(more.statuses)
        outcome.seeded = outcome.seeded or more.seeded
        replies += again
    return Exchanged(replies=replies, outcome=outcome, down=down, seconds_basis=seconds_basis,
                     seconds_train=time.perf_counter() - t0)


def _aggregate(run: Federation, outcome: RoundOutcome) -> Aggregated:
    """With at least ``min_sites`` valid updates, in site order: bound each one, combine them, and let the server
    optimizer step the global model; with fewer the global model is unchanged."""
    cfg = run.cfg
    named = dict(run.model.named_parameters())
    t0 = time.perf_counter()
    aggregated = len(outcome.updates) >= cfg.federation.min_sites
    tau: float | None = None
    scaled: list[int] = []
    if aggregated:
        with torch.no_grad():
            current = {name: named[name].detach().clone() for name in run.trainable}
            # In site order, not arrival order: the same replies give the same float sums (reproducible runs).
            order = sorted(range(len(outcome.accepted)), key=lambda i: outcome.accepted[i])
            outcome.accepted[:] = [outcome.accepted[i] for i in order]
            outcome.updates[:] = [outcome.updates[i] for i in order]
            bounded, tau, scaled = bound_updates(outcome.updates, current, cfg.federation.update_bound)
            combined = aggregate(bounded, cfg.federation.aggregator)
            for name, value in run.server_opt.apply(current, combined).items():
                named[name].copy_(value)
    return Aggregated(aggregated=aggregated, tau=tau, scaled=scaled, seconds=time.perf_counter() - t0)


def _evaluate(run: Federation) -> Evaluated:
    """Score the global model on the validation split."""
    from fedpose.shared.metrics.evaluation import evaluate

    t0 = time.perf_counter()
    report, _, _ = evaluate(run.model, run.val)
    return Evaluated(report=report, seconds=time.perf_counter() - t0)


def _missed(replies: list[Reply]) -> list[str]:
    """The sites whose node did not answer (Flower's "node unavailable")."""
    return sorted({r.site for r in replies if r.error_code == node_unavailable()})


def _record(run: Federation, rnd: int, sent: Exchanged, aggregated: Aggregated) -> None:
    """Write the round into the ledger: its spends, the events noticed since the last round and the replies' own,
    the sites' statuses and reports; who paid for an update that was thrown away; a site's seeded noise. Then
    which sites to ask again what their policy declares (they missed the round or refused, now or before)."""
    cfg, ledger, outcome = run.cfg, run.ledger, sent.outcome
    before = {s: ledger.counted_epsilon(s) for s in outcome.accepted}
    ledger.record_round(rnd, outcome.spends, run.noticed + outcome.events, outcome.statuses, outcome.reports)
    run.noticed = []
    if not aggregated.aggregated and outcome.accepted:  # they paid for a round that was thrown away: say who
        cost = {s: (before[s], ledger.counted_epsilon(s), run.plans[s].epsilon) for s in outcome.accepted}
        ledger.record_round(rnd, [], discarded_events(rnd, len(outcome.updates), cfg.federation.min_sites, cost))
        log.warning("round %d: not aggregated (%d valid replies < min_sites %d): global model unchanged; %s",
                    rnd, len(outcome.updates), cfg.federation.min_sites,
                    "; ".join(f"{s} paid for an update that was thrown away (eps {b:.4f} -> {a:.4f})"
                              for s, (b, a, _) in sorted(cost.items())))
    if outcome.seeded and ledger.get_meta("seeded") != "1":
        log.warning("a site trained with seeded noise: the claim of this run is not for production (P7)")
        ledger.set_meta("seeded", "1")
    run.recheck |= set(_missed(sent.replies)) | {e.site for e in outcome.events if e.kind == "refused"}
    run.recheck |= {s for s, (status, _) in ledger.statuses().items() if status == "refused" and s in run.plans}


def _round_record(run: Federation, rnd: int, chosen: Chosen, sent: Exchanged, aggregated: Aggregated,
                  evaluated: Evaluated) -> dict[str, Any]:
    """The round's line in rounds.jsonl and in the checkpoint's history: its score, who took part and how, the
    spend so far, the bytes each way and the seconds each phase took."""
    ledger, outcome, plans, report = run.ledger, sent.outcome, run.plans, evaluated.report
    up: dict[str, int] = {}
    for r in sent.replies:
        up[r.site] = up.get(r.site, 0) + r.bytes_up
    missed = _missed(sent.replies)
    down = {site: b for site, b in sent.down.items() if site not in missed}  # nothing reached a dead node
    return {
        "round": rnd,
        "pckh_mean": float(report["pckh"]["mean"]),
        "pckh@0.1_mean": float(report["pckh@0.1"]["mean"]),
        "aggregated": aggregated.aggregated,
        "sites": sorted(chosen.active),
        "accepted": sorted(outcome.accepted),
        "discarded": [] if aggregated.aggregated else sorted(outcome.accepted),  # charged, trained, thrown away
        "refused": sorted({e.site for e in outcome.events if e.kind == "refused"}),
        "rejected": sorted({e.site for e in outcome.events if e.kind == "rejected"}),
        "failed": sorted({e.site for e in outcome.events if e.kind == "error"}),
        "missed": missed,
        "offline": chosen.offline,
        "update_bound": aggregated.tau,
        "bounded": sorted(outcome.accepted[i] for i in aggregated.scaled),
        "epsilon": {s: ledger.counted_epsilon(s) for s in sorted(plans) if ledger.counted_epsilon(s) > 0},
        "epsilon_server": {s: ledger.server_epsilon(s) for s in sorted(plans) if ledger.history(s)},
        "epsilon_lifetime": {s: ledger.site_epsilon(s) for s in sorted(plans) if ledger.site_epsilon(s) > 0},
        "bytes_down": down,
        "bytes_up": up,
        "basis_version": run.keeper.version,
        "seconds": {"train": sent.seconds_train, "basis": sent.seconds_basis, "aggregation": aggregated.seconds,
                    "evaluation": evaluated.seconds},
    }


def _checkpoint(run: Federation, rnd: int, record: dict[str, Any]) -> None:
    """Keep the round: weights, ledger snapshot, history and the server optimizer's moments in one atomic file,
    then its line in rounds.jsonl and the log."""
    run.history.append(record)
    save_state(run.paths.checkpoint, ServerState(round=rnd, federation=run.federation, weights=run.model.state_dict(),
                                                 ledger=run.ledger.snapshot(), history=run.history,
                                                 optimizer=run.server_opt.state_dict()))
    append_round(run.paths.rounds, record)
    now = time.monotonic()
    run.paces.append(now - run.mark)
    run.mark = now
    log.info("round %d/%d: PCKh %.2f, eps %s, %s; %s", rnd, run.cfg.federation.rounds, record["pckh_mean"],
             {s: round(e, 4) for s, e in record["epsilon"].items()},
             f"accepted {record['accepted']}" if record["aggregated"] else "not aggregated",
             time_left(run.paces, run.cfg.federation.rounds - rnd))


def time_left(paces: list[float], rounds_left: int) -> str:
    """This round's time and the rest's estimate at the mean pace of the rounds run so far, in words."""
    this = f"{paces[-1]:.0f} s"
    if rounds_left <= 0:
        return f"{this}, the last round"
    left = sum(paces) / len(paces) * rounds_left
    return f"{this}; about {left:.0f} s left" if left < 90 else f"{this}; about {left / 60:.0f} min left"


def finish(cfg: Config, paths: Paths, model: PoseNet, val: list, ledger: ServerLedger,
           plans: dict[str, SitePlan], history: list[dict[str, Any]], federation: str, *,
           seconds: float) -> dict[str, Any]:
    """Final model, metrics.json (per-site spend, global claim = max over sites), report.md and the plot."""
    from fedpose.shared.model.posenet import save_checkpoint
    from fedpose.shared.data.digest import data_identity
    from fedpose.shared.privacy.accounting.claims import privacy_claim
    from fedpose.shared.metrics.evaluation import evaluate
    from fedpose.shared.configuration.yaml_io import write_json

    report, _, _ = evaluate(model, val)
    done = final_statuses(ledger, plans)  # finished, exhausted or stopped: no site stays 'active'
    if done:
        ledger.set_statuses(done)
    statuses = ledger.statuses()
    per_site: dict[str, dict[str, Any]] = {}
    for site, plan in sorted(plans.items()):
        rows = [r for r in ledger.rows() if r["site"] == site and r["state"] in ("completed", "interrupted")]
        per_site[site] = {
            "epsilon": ledger.counted_epsilon(site),  # this federation: max(server, every site report)
            "epsilon_server": ledger.server_epsilon(site),
            "epsilon_site_run": ledger.site_run_epsilon(site),
            "epsilon_lifetime": ledger.site_epsilon(site),  # the site's whole ledger, all federations
            "budget": plan.epsilon,
            "delta": plan.delta,
            "sigma": plan.sigma,
            "sample_rate": plan.sample_rate,
            "rounds": len(rows),
            "status": statuses.get(site, ("", ""))[0],
        }
    epsilon = max((s["epsilon"] for s in per_site.values()), default=0.0)
    delta = max((s["delta"] for s in per_site.values()), default=cfg.privacy.delta)
    from fedpose.shared.privacy.step.psi import psi_label_of

    psi = psi_label_of(cfg.privacy) if cfg.train.method in WITH_PUBLIC else None
    seeded = ledger.get_meta("seeded") == "1"
    caps = [int(ledger.get_meta(f"max_records_per_patient/{site}") or 0) for site in plans]
    patient_records = max(caps) if caps and min(caps) > 0 else None  # None: some site states no cap
    claim = privacy_claim(method=cfg.train.method, epsilon=epsilon, delta=delta, psi=psi, seeded=seeded,
                          accountant=cfg.privacy.accountant, released=federation_release(cfg), unit=cfg.privacy.unit,
                          records_per_patient=patient_records,
                          records_source="the largest cap the sites' policies state", face_tasks=cfg.model.face_tasks)
    initial = ledger.get_meta("initial_pckh_mean")
    stops = [e["reason"] for e in ledger.events() if e["kind"] == "stopped"]
    metrics = {
        "federation": federation,
        "rounds": len(history),
        "stopped": stops[-1] if stops else None,  # why it ended before federation.rounds, when it did
        "initial_pckh_mean": float(initial) if initial is not None else None,
        "method": cfg.train.method,
        "strategy": cfg.train.strategy,
        "basis_mode": cfg.federation.basis_mode,
        "pckh_mean": float(report["pckh"]["mean"]),
        **report,
        "sites": per_site,
        "epsilon": epsilon,
        "delta": delta,
        "accountant": cfg.privacy.accountant,
        "unit": cfg.privacy.unit,
        "seeded": seeded,
        "claim": claim,
        "seconds": round(seconds, 2),
        "data": data_identity(cfg.data.root, [cfg.data.public_split, cfg.data.val_split]),
        "provenance": provenance(command="federation"),
    }
    save_checkpoint(paths.out / "model.pt", model, {"kind": "federation", "federation": federation,
                                                    "rounds": len(history), "epsilon": epsilon, "delta": delta})
    write_json(paths.out / "metrics.json", metrics)
    plot = write_plot(paths.out / "federation.png", history, {s: p.epsilon for s, p in plans.items()},
                      initial_pckh=metrics["initial_pckh_mean"], events=ledger.events())
    write_report(paths.out / "report.md", records=history, metrics=metrics,
                 plans={s: p.to_dict() for s, p in plans.items()}, events=ledger.events(), plot=plot.name)
    log.info("federation %s done: %d rounds, PCKh %.2f, epsilon per site at most %.4f; the claim is in %s",
             federation, len(history), metrics["pckh_mean"], epsilon, paths.out / "metrics.json")
    return metrics
