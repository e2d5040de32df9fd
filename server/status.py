"""The federation server's status, from its run folder: what ``fedpose server status`` prints and the console shows.

Everything comes from the files the server itself writes (``ledger.sqlite``, ``rounds.jsonl``,
``config.yaml``, ``metrics.json`` when finished), read-only, so the status never disagrees with them.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any


def _ro(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)
    conn.row_factory = sqlite3.Row
    return conn


def _rounds(out: Path) -> list[dict[str, Any]]:
    path = out / "rounds.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:  # a line being written right now
            continue
    return rows


def server_status(out: str | Path) -> dict[str, Any]:
    """The run in ``out``: rounds with PCKh, per-site epsilon against budget, events, resumes, and its state.

    A site's epsilon is never below what the server asked of it: a round it was asked and whose answer is not
    recorded (a killed server, a round under way) counts at the plan, whatever state the run is in."""
    from fedpose.server.ledger import unrecorded_requests
    from fedpose.shared.privacy.accounting.accountant import StepRecord, epsilon_spent

    out = Path(out)
    ledger = out / "ledger.sqlite"
    if not ledger.is_file():
        raise FileNotFoundError(f"{out} holds no federation (no ledger.sqlite): give the folder a run writes to")
    rounds = _rounds(out)
    metrics_path = out / "metrics.json"
    metrics = json.loads(metrics_path.read_text()) if metrics_path.is_file() else None
    planned = guarantee = None
    config = out / "config.yaml"
    if config.is_file():
        from fedpose.shared.configuration.schema import load_config

        cfg = load_config(config)
        planned, guarantee = cfg.federation.rounds, planned_guarantee(cfg)
    conn = _ro(ledger)
    try:
        meta = {r["key"]: r["value"] for r in conn.execute("SELECT key, value FROM meta")}
        plans = {r["site"]: dict(r) for r in conn.execute("SELECT * FROM sites ORDER BY site")}
        spend = [dict(r) for r in conn.execute("SELECT * FROM spend ORDER BY id")]
        events = [dict(r) for r in conn.execute("SELECT round, site, kind, code, reason FROM events ORDER BY id")]
        reports = [dict(r) for r in conn.execute("SELECT round, site, run_epsilon FROM reports")]
        try:
            unrecorded = unrecorded_requests(conn)
        except sqlite3.OperationalError:  # a ledger written before requests were written down
            unrecorded = []
    finally:
        conn.close()
    sites: dict[str, Any] = {}
    for site, plan in plans.items():
        rows = [r for r in spend if r["site"] == site and r["state"] != "resolved"]
        history = [StepRecord(sigma=r["sigma"], sample_rate=r["sample_rate"], steps=r["steps"]) for r in rows]
        # Asked, and no answer recorded (the server stopped, or the round is under way): the site may have charged
        # it, so it counts at the plan, as a resume would count it, unless the site's own later report covers it.
        own = [r["round"] for r in reports if r["site"] == site]
        own += [r["round"] for r in rows if r["site_run_epsilon"] is not None]
        asked = [rnd for rnd, s in unrecorded if s == site and not any(o >= rnd for o in own)]
        history += [StepRecord(sigma=plan["sigma"], sample_rate=plan["sample_rate"], steps=plan["steps_per_round"])
                    for _ in asked]
        server_eps = epsilon_spent(history, delta=plan["delta"], accountant=plan["accountant"]) if history else 0.0
        reported = [r["site_run_epsilon"] for r in rows if r["site_run_epsilon"] is not None]
        reported += [r["run_epsilon"] for r in reports if r["site"] == site]
        sites[site] = {"epsilon": max([server_eps, *reported]), "budget": plan["budget"], "delta": plan["delta"],
                       "rounds": sum(1 for r in rows if r["state"] in ("completed", "interrupted")),
                       "unanswered": len(asked) + sum(1 for r in rows if r["state"] == "attempted"),
                       "status": plan["status"], "reason": plan["reason"]}
    initial = meta.get("initial_pckh_mean")
    pckh = [r["pckh_mean"] for r in rounds]
    state, reason = run_state(out, metrics)
    return {
        "kind": "server",
        "out": str(out),
        "federation": meta.get("federation"),
        "state": state,
        "state_reason": reason,
        "rounds_planned": planned,
        "rounds": [{k: r.get(k) for k in ("round", "pckh_mean", "update_bound", "bounded")} | {
            "aggregated": r.get("aggregated", True)} | {
            k: r.get(k) or [] for k in ("accepted", "discarded", "refused", "rejected", "failed", "missed", "offline")}
            for r in rounds],
        "initial_pckh": float(initial) if initial is not None else None,
        "latest_pckh": pckh[-1] if pckh else None,
        "best_pckh": max(pckh) if pckh else None,
        "sites": sites,
        "events": events,
        "resumes": sum(1 for e in events if e["kind"] == "resumed"),
        "guarantee": guarantee,
        "claim": metrics["claim"] if metrics else None,
        "epsilon": metrics["epsilon"] if metrics else max((s["epsilon"] for s in sites.values()), default=0.0),
    }


def planned_guarantee(cfg: Any) -> str:
    """The kind of guarantee the run's config trains under, in one line: what the status says before the
    accountant's claim is written at the end (each site's epsilon so far is beside it)."""
    from fedpose.shared.configuration.methods import RECORD_LEVEL, WITH_PUBLIC

    method = cfg.train.method
    if method in RECORD_LEVEL:
        kind = f"record-level DP ({method}, {cfg.privacy.unit} level)"
    elif method in WITH_PUBLIC:
        kind = (f"Feature-DP ({method}): a blurred copy of each image ({cfg.privacy.psi} {cfg.privacy.psi_param:g}) "
                "and its pose labels are treated as public")
    else:
        return f"none: {method} is not private"
    return f"{kind}, each site within its own budget (its epsilon and delta are on its line)"


def run_state(out: Path, metrics: dict[str, Any] | None) -> tuple[str, str]:
    """``finished`` (metrics.json written), ``running`` (a server process holds the folder), ``failed`` (the
    server recorded why it could not go on) or ``stopped`` (no process holds it: killed, or its machine went
    down); with a reason for every state but running."""
    from fedpose.server.outcome import held, read_outcome

    if metrics is not None:
        return "finished", metrics.get("stopped") or ""
    if held(out):
        return "running", ""
    outcome = read_outcome(out)
    if outcome is not None and outcome.get("state") == "failed":
        return "failed", str(outcome.get("reason", ""))
    return "stopped", ("no server process holds this run folder and it has no metrics.json: the server stopped "
                       "before the end (killed, or its machine went down); resume it with fedpose server run --resume")


def server_metrics(status: dict[str, Any]) -> list[tuple[str, dict[str, str], float, str]]:
    """Prometheus samples of a server status."""
    fed = status.get("federation") or ""
    out: list[tuple[str, dict[str, str], float, str]] = [
        ("fedpose_server_rounds_done", {"federation": fed}, len(status["rounds"]), "rounds aggregated or attempted"),
        ("fedpose_server_finished", {"federation": fed}, float(status["state"] == "finished"), "1 once the run ended"),
        ("fedpose_server_resumes", {"federation": fed}, status["resumes"], "times the server resumed this run"),
    ]
    if status["latest_pckh"] is not None:
        out.append(("fedpose_server_pckh", {"federation": fed}, status["latest_pckh"],
                    "PCKh@0.5 of the global model on the validation split, latest round"))
    for site, s in status["sites"].items():
        labels = {"federation": fed, "site": site}
        out += [("fedpose_server_site_epsilon", labels, s["epsilon"], "epsilon counted for the site, this federation"),
                ("fedpose_server_site_budget", labels, s["budget"], "the site's declared epsilon budget")]
    kinds: dict[str, int] = {}
    for e in status["events"]:
        kinds[e["kind"]] = kinds.get(e["kind"], 0) + 1
    for kind, count in sorted(kinds.items()):
        out.append(("fedpose_server_events", {"federation": fed, "kind": kind}, count, "events by kind"))
    return out
