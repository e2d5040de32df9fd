"""The server's round loop over a Flower Grid (docs/explanation/design.md: one federated round).

Per round: choose the sites that can still afford a planned round, refresh
V if due, send each site the global weights (+ V if it lacks that version)
and its own request, validate replies, record every spend in the ledger
(server-recomputed epsilon next to the site's own, and the spend every
refusal reports), aggregate the valid replies (if at least ``min_sites``;
uniform over sites, each update norm-bounded, optionally median or trimmed
mean: one hostile site cannot dominate), evaluate on the validation split and
checkpoint weights + ledger + round atomically.

The loop is here (``run_federation``, ``finish``); what it calls lives
beside it: ``fedpose.server.exchange`` (the Grid), ``fedpose.server.replies`` (sorting
replies), ``fedpose.server.combine`` (aggregation).
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fedpose.server.aggregate import server_optimizer
from fedpose.server.basis import BasisKeeper
from fedpose.server.checkpoint import ServerState, load_state, save_state
from fedpose.server.combine import aggregate, bound_updates
from fedpose.server.federable import refuse_centralized_only
from fedpose.server.exchange import describe_sites, exchange, sites_for_round
from fedpose.server.ledger import Event, ServerLedger
from fedpose.server.ledger_resume import reconcile
from fedpose.server.outcome import (FederationStopped, clear_outcome, discarded_events, final_statuses, record_failure,
                            sole_server)
from fedpose.server.plan import SitePlan, left_out, plan_site
from fedpose.server.policy_watch import watch
from fedpose.server.prepare import require_prepared
from fedpose.server.replies import _node_unavailable, process_replies
from fedpose.server.report import append_round, write_plot, write_report, write_rounds
from fedpose.shared.configuration.schema import Config, dump_config
from fedpose.shared.flower.messages import ARRAYS, BASIS, CONFIG, TrainRequest, payload_bytes, weights_record
from fedpose.shared.training.provenance import configure_numerics, provenance
from fedpose.shared.configuration.methods import WITH_PUBLIC

if TYPE_CHECKING:  # the model module is imported where it is used
    from fedpose.shared.model.posenet import PoseNet

log = logging.getLogger(__name__)

# What a federation releases to the server besides the DP-noised weights (named in the claim, P10).
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


def _run_federation(grid: Any, cfg: Config, out: str | Path, *, resume: bool) -> dict[str, Any]:
    from fedpose.shared.data.mpii import load_split
    from fedpose.shared.model.strategy import apply_strategy
    from fedpose.shared.training.runs import initial_model
    from fedpose.shared.metrics.evaluation import evaluate

    t_start = time.perf_counter()
    configure_numerics(cfg.runtime.threads, deterministic=cfg.runtime.deterministic)
    paths = Paths(Path(out))
    paths.out.mkdir(parents=True, exist_ok=True)
    refuse_centralized_only(cfg)
    require_prepared(cfg)  # server/prepare.py: public data and pretrained weights exist (no silent generation)
    root = Path(cfg.data.root)
    public = load_split(root, cfg.data.public_split)
    val = load_split(root, cfg.data.val_split)
    model = initial_model(cfg, progress=False)  # present: checked above
    trainable = apply_strategy(model, cfg.train.strategy)
    named = dict(model.named_parameters())
    expected = {name: named[name].shape for name in trainable}

    ledger = ServerLedger(paths.ledger)
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
        initial, _, _ = evaluate(model, val)
        ledger.set_meta("initial_pckh_mean", repr(float(initial["pckh"]["mean"])))
        write_rounds(paths.rounds, [])
    dump_config(cfg, paths.out / "config.yaml")

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
    recheck: set[str] = set()  # sites to ask again what their policy declares (refused, missed, offline)
    usable = sorted(s for s in plans if s in node_of)
    if len(usable) < cfg.federation.min_sites:
        why = [f"{s} {left_out(info, cfg) or 'has no plan'}" for s, (_, info) in sorted(sites.items())
               if s not in usable]
        why += [f"{s} did not describe itself" for s in sorted(plans) if s not in node_of]
        head = f"only {len(usable)} site(s) can take part ({', '.join(usable)})" if usable else \
            "no site can take part"
        raise FederationStopped(f"{head}, fewer than federation.min_sites={cfg.federation.min_sites}: "
                                + ("; ".join(why) or "no site described itself (see the sites' logs)"))
    keeper = BasisKeeper(cfg, public)
    server_opt = server_optimizer(cfg)  # server/aggregate.py; its moments are in the checkpoint
    if optimizer_state is not None:
        server_opt.load_state_dict(optimizer_state)

    if resume:
        ledger.record_round(start - 1, [], [Event(site="(server)", kind="resumed", code=0,
                                                  reason=f"server resumed from the checkpoint of round {start - 1}"),
                                            *noticed])
        noticed = []
    for rnd in range(start, cfg.federation.rounds + 1):
        active, offline, changed, waiting = sites_for_round(grid, node_of, plans, ledger, cfg, rnd, recheck=recheck)
        noticed += changed
        if len(active) < cfg.federation.min_sites:  # no site is asked to train for a round that cannot count
            if active or waiting:
                waits = "; ".join(f"{s}: {r}" for s, r in waiting.items()) or "the others have no rounds left"
                stopped = (f"round {rnd}: only {len(active)} site(s) can take part ({', '.join(active) or 'none'}), "
                           f"fewer than federation.min_sites={cfg.federation.min_sites} ({waits}); stopping")
                log.warning("%s", stopped)
                noticed.append(Event(site="(server)", kind="stopped", code=0, reason=stopped))
            else:
                log.info("round %d: every site's planned rounds or budget are done", rnd)
            if noticed:
                ledger.record_round(rnd, [], noticed)
            break

        seconds_basis = keeper.refresh(rnd, model, trainable)
        arrays = weights_record(model.state_dict())

        def content_for(site: str, force_basis: bool = False) -> Any:
            from flwr.app import RecordDict

            request = TrainRequest(federation=federation, round=rnd, site=site, sigma=plans[site].sigma,
                                   sample_rate=plans[site].sample_rate, steps=plans[site].steps_per_round,
                                   basis_version=keeper.version, basis_mode=cfg.federation.basis_mode, config=cfg)
            content = RecordDict({ARRAYS: arrays, CONFIG: request.to_record()})
            if force_basis:
                keeper.forget(site)
            basis = keeper.attach_for(site)
            if basis is not None:
                content[BASIS] = basis
            return content

        t0 = time.perf_counter()
        contents = {site: content_for(site) for site in active}
        down = {site: payload_bytes(c) for site, c in contents.items()}
        ledger.record_sent(rnd, sorted(contents))  # before sending: a site may charge it even if we die now (P13)
        replies = exchange(grid, contents, node_of, rnd, cfg.federation.round_timeout)
        global_now = {name: named[name].detach().clone() for name in trainable}
        bound = cfg.federation.max_update_norm
        outcome = process_replies(replies, expected=expected, plans=plans, keeper=keeper, global_weights=global_now,
                                  max_update_norm=bound)
        if outcome.need_basis:  # a site lost its cached V: send it once more, with V
            retry = {site: content_for(site, force_basis=True) for site in outcome.need_basis}
            for site, c in retry.items():
                down[site] += payload_bytes(c)
            again = exchange(grid, retry, node_of, rnd, cfg.federation.round_timeout)
            more = process_replies(again, expected=expected, plans=plans, keeper=keeper, global_weights=global_now,
                                   max_update_norm=bound)
            for name in ("updates", "spends", "events", "reports", "need_basis", "accepted"):
                getattr(outcome, name).extend(getattr(more, name))
            outcome.statuses.update(more.statuses)
            outcome.seeded = outcome.seeded or more.seeded
            replies += again
        seconds_train = time.perf_counter() - t0

        t0 = time.perf_counter()
        aggregated = len(outcome.updates) >= cfg.federation.min_sites
        if aggregated:
            with torch.no_grad():
                current = {name: named[name].detach().clone() for name in trainable}
                # In site order, not arrival order: the same replies give the same float sums (reproducible runs).
                order = sorted(range(len(outcome.accepted)), key=lambda i: outcome.accepted[i])
                outcome.accepted[:] = [outcome.accepted[i] for i in order]
                outcome.updates[:] = [outcome.updates[i] for i in order]
                bounded, tau, scaled = bound_updates(outcome.updates, current, cfg.federation.update_bound)
                combined = aggregate(bounded, cfg.federation.aggregator)
                for name, value in server_opt.apply(current, combined).items():
                    named[name].copy_(value)
        else:
            tau, scaled = None, []
        seconds_agg = time.perf_counter() - t0
        t0 = time.perf_counter()
        report, _, _ = evaluate(model, val)
        seconds_eval = time.perf_counter() - t0

        before = {s: ledger.counted_epsilon(s) for s in outcome.accepted}
        ledger.record_round(rnd, outcome.spends, noticed + outcome.events, outcome.statuses, outcome.reports)
        noticed = []
        if not aggregated and outcome.accepted:  # they paid for a round that was thrown away: say who
            cost = {s: (before[s], ledger.counted_epsilon(s), plans[s].epsilon) for s in outcome.accepted}
            ledger.record_round(rnd, [], discarded_events(rnd, len(outcome.updates), cfg.federation.min_sites, cost))
            log.warning("round %d: not aggregated (%d valid replies < min_sites %d): global model unchanged; %s",
                        rnd, len(outcome.updates), cfg.federation.min_sites,
                        "; ".join(f"{s} paid for an update that was thrown away (eps {b:.4f} -> {a:.4f})"
                                  for s, (b, a, _) in sorted(cost.items())))
        if outcome.seeded and ledger.get_meta("seeded") != "1":
            log.warning("a site trained with seeded noise: the claim of this run is not for production (P7)")
            ledger.set_meta("seeded", "1")
        up: dict[str, int] = {}
        for r in replies:
            up[r.site] = up.get(r.site, 0) + r.bytes_up
        missed = sorted({r.site for r in replies if r.error_code == _node_unavailable()})
        recheck |= set(missed) | {e.site for e in outcome.events if e.kind == "refused"}
        recheck |= {s for s, (status, _) in ledger.statuses().items() if status == "refused" and s in plans}
        down = {site: b for site, b in down.items() if site not in missed}  # nothing reached a dead node
        record: dict[str, Any] = {
            "round": rnd,
            "pckh_mean": float(report["pckh"]["mean"]),
            "pckh@0.1_mean": float(report["pckh@0.1"]["mean"]),
            "aggregated": aggregated,
            "sites": sorted(active),
            "accepted": sorted(outcome.accepted),
            "discarded": [] if aggregated else sorted(outcome.accepted),  # charged, trained, thrown away
            "refused": sorted({e.site for e in outcome.events if e.kind == "refused"}),
            "rejected": sorted({e.site for e in outcome.events if e.kind == "rejected"}),
            "failed": sorted({e.site for e in outcome.events if e.kind == "error"}),
            "missed": missed,
            "offline": offline,
            "update_bound": tau,
            "bounded": sorted(outcome.accepted[i] for i in scaled),
            "epsilon": {s: ledger.counted_epsilon(s) for s in sorted(plans) if ledger.counted_epsilon(s) > 0},
            "epsilon_server": {s: ledger.server_epsilon(s) for s in sorted(plans) if ledger.history(s)},
            "epsilon_lifetime": {s: ledger.site_epsilon(s) for s in sorted(plans) if ledger.site_epsilon(s) > 0},
            "bytes_down": down,
            "bytes_up": up,
            "basis_version": keeper.version,
            "seconds": {"train": seconds_train, "basis": seconds_basis, "aggregation": seconds_agg,
                        "evaluation": seconds_eval},
        }
        history.append(record)
        save_state(paths.checkpoint, ServerState(round=rnd, federation=federation, weights=model.state_dict(),
                                                 ledger=ledger.snapshot(), history=history,
                                                 optimizer=server_opt.state_dict()))
        append_round(paths.rounds, record)
        log.info("round %d: PCKh %.2f, eps %s, %s", rnd, record["pckh_mean"],
                 {s: round(e, 4) for s, e in record["epsilon"].items()},
                 f"accepted {record['accepted']}" if aggregated else "not aggregated")

    metrics = finish(cfg, paths, model, val, ledger, plans, history, federation,
                     seconds=time.perf_counter() - t_start)
    ledger.close()
    return metrics


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
