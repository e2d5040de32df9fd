"""Results of a federation: rounds.jsonl (one line per round), report.md and a PNG plot.

A round record holds: round, PCKh mean on validation (and PCKh@0.1), the
counted epsilon per site (max of server recomputation and site report),
bytes sent to and received from each site (serialised record sizes), and
seconds spent in training (waiting for sites), basis computation on the
server, aggregation and evaluation.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def write_rounds(path: str | Path, records: Sequence[Mapping[str, Any]]) -> None:
    """Rewrite rounds.jsonl from the records (atomic; used on resume to match the checkpoint)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
    tmp.replace(path)


def append_round(path: str | Path, record: Mapping[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(record, sort_keys=True) + "\n")


def read_rounds(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


# How the plot marks what happened in a round (report.md lists each with its reason).
EVENT_MARKERS = {"missed": "x", "refused": "v", "rejected": "s", "error": "P", "resumed": "^", "policy-changed": "D",
                 "discarded": "*", "stopped": "|"}


def write_plot(path: str | Path, records: Sequence[Mapping[str, Any]], budgets: Mapping[str, float], *,
               initial_pckh: float | None = None, events: Sequence[Mapping[str, Any]] = ()) -> Path:
    """Two panels: PCKh mean over rounds; epsilon per site over rounds with each site's budget line.

    Round 0 is the starting model (public pretraining only): PCKh ``initial_pckh``, nothing spent.
    ``events`` (the ledger's: round, site, kind) are marked along the bottom of the PCKh panel, one
    row per kind: missed rounds, refusals, rejected replies, errors, resumes, policy changes.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    from matplotlib.ticker import MaxNLocator

    rounds = [r["round"] for r in records]
    pckh = [r["pckh_mean"] for r in records]
    if initial_pckh is not None:
        rounds, pckh = [0, *rounds], [initial_pckh, *pckh]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(rounds, pckh, marker="o")
    ax1.set_xlabel("round")
    ax1.set_ylabel("PCKh@0.5 mean (validation)")
    ax1.set_title("global model")
    ax1.grid(alpha=0.3)
    kinds = [k for k in EVENT_MARKERS if any(e["kind"] == k for e in events)]
    for row, kind in enumerate(kinds):
        at = sorted({int(e["round"]) for e in events if e["kind"] == kind})
        count = sum(e["kind"] == kind for e in events)
        ax1.scatter(at, [0.03 + 0.05 * row] * len(at), marker=EVENT_MARKERS[kind], color="0.3",
                    transform=ax1.get_xaxis_transform(), label=f"{kind} ({count})", clip_on=False, zorder=3)
    if kinds:
        ax1.legend(fontsize=8, loc="upper left")
    sites = sorted({s for r in records for s in r["epsilon"]} | set(budgets))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, site in enumerate(sites):
        colour = colours[i % len(colours)]
        xs = [0] + [r["round"] for r in records if site in r["epsilon"]]
        ys = [0.0] + [r["epsilon"][site] for r in records if site in r["epsilon"]]
        ax2.plot(xs, ys, marker="o", color=colour, label=f"{site} (this run)")
        lifetime = [(r["round"], r["epsilon_lifetime"][site]) for r in records if site in r.get("epsilon_lifetime", {})]
        if lifetime and lifetime[-1][1] > ys[-1] + 1e-9:  # the site had spent in earlier federations
            ax2.plot(*zip(*lifetime), linestyle=":", marker=".", color=colour, label=f"{site} (lifetime)")
        if site in budgets:
            ax2.axhline(budgets[site], color=colour, linestyle="--", linewidth=1)
    ax2.set_xlabel("round")
    ax2.set_ylabel("epsilon spent (cumulative)")
    ax2.set_title("privacy spent per site (dashed: budget; dotted: lifetime)", fontsize=10)
    ax2.grid(alpha=0.3)
    for ax in (ax1, ax2):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if sites:
        ax2.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_report(path: str | Path, *, records: Sequence[Mapping[str, Any]], metrics: Mapping[str, Any],
                 plans: Mapping[str, Mapping[str, Any]], events: Sequence[Mapping[str, Any]], plot: str) -> Path:
    """A markdown summary: claim, final accuracy, per-site plan and spend, per-round table, events."""
    lines = ["# Federation report", ""]
    lines += [f"- federation: `{metrics['federation']}`", f"- rounds completed: {metrics['rounds']}",
              f"- method: {metrics['method']} ({metrics['strategy']}), basis mode: {metrics['basis_mode']}",
              f"- PCKh@0.5 mean (validation): {metrics['pckh_mean']:.2f} after the federation, "
              f"{metrics['initial_pckh_mean'] if metrics.get('initial_pckh_mean') is not None else float('nan'):.2f} "
              "before (public pretraining only)",
              f"- global claim (max over sites): {metrics['claim']}", ""]
    lines += ["## Sites", "", "Run eps: this federation (server recomputation, the site's own report, and the larger, "
              "which counts); lifetime eps: the site's whole ledger, every federation it joined.", "",
              "| site | sigma | q | steps/round | planned rounds | budget eps | delta | "
              "run eps (server) | run eps (site) | run eps (counted) | lifetime eps (site) | status |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for site, plan in sorted(plans.items()):
        spent = metrics["sites"].get(site, {})
        lines.append(
            f"| {site} | {plan['sigma']:.4f} | {plan['sample_rate']:.4f} | {plan['steps_per_round']} | "
            f"{plan['rounds']} | {plan['epsilon']:g} | {plan['delta']:g} | {spent.get('epsilon_server', 0):.4f} | "
            f"{spent.get('epsilon_site_run', 0):.4f} | {spent.get('epsilon', 0):.4f} | "
            f"{spent.get('epsilon_lifetime', 0):.4f} | {spent.get('status', '')} |"
        )
    basis_note = ("the server computes V (basis mode broadcast)" if metrics["basis_mode"] == "broadcast" else
                  "0 here: each site computes V itself (basis mode site) and reports no timings, which would track "
                  "its n (P10); a site's own log has them")
    lines += ["", "## Rounds", "", f"s server basis: {basis_note}. MB down counts nothing sent to a node that was "
              "offline. Update bound: every site's update is scaled to at most this norm (the round's lower-median "
              "update norm) before the sites are combined; the sites in brackets were scaled.", "",
              "| round | PCKh mean | " + " | ".join(f"eps {s}" for s in sorted(plans))
              + " | missed / offline | update bound (scaled) | MB down | MB up | s round | s server basis | "
              "s aggregate |", "|---" * (9 + len(plans)) + "|"]
    for r in records:
        eps = " | ".join(f"{r['epsilon'].get(s, 0):.4f}" for s in sorted(plans))
        down = sum(r["bytes_down"].values()) / 1e6
        up = sum(r["bytes_up"].values()) / 1e6
        sec = r["seconds"]
        absent = ", ".join(sorted(set(r.get("missed", [])) | set(r.get("offline", [])))) or "-"
        bound = "-" if r.get("update_bound") is None else (
            f"{r['update_bound']:.3g} ({', '.join(r.get('bounded', [])) or 'none'})")
        if r.get("aggregated") is False:  # the sites that trained for it paid for nothing
            bound = f"not aggregated ({', '.join(r.get('discarded', [])) or 'nobody'} paid)"
        lines.append(f"| {r['round']} | {r['pckh_mean']:.2f} | {eps} | {absent} | {bound} | {down:.2f} | {up:.2f} | "
                     f"{sec['train']:.1f} | {sec['basis']:.1f} | {sec['aggregation']:.2f} |")
    lines += ["", f"![PCKh and privacy per round]({plot})", ""]
    if events:
        lines += ["## Events: missed rounds, refusals, rejected replies, discarded updates, resumes, policy changes, "
                  "stops", "", "A discarded update was trained and paid for by its site, then thrown away: its round "
                  "had fewer valid replies than federation.min_sites.", "", "| round | site | kind | code | reason |",
                  "|---|---|---|---|---|"]
        for e in events:
            reason = str(e["reason"]).replace("|", "/").replace("\n", " ")[:200]
            lines.append(f"| {e['round']} | {e['site']} | {e['kind']} | {e['code']} | {reason} |")
        lines.append("")
    path = Path(path)
    path.write_text("\n".join(lines) + "\n")
    return path
