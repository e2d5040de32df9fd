"""Render the results pages' tables from the artefacts the measurements wrote (JSON and CSV files).

    python tools/render_results.py          # rewrite every rendered block
    python tools/render_results.py --check  # exit 1 when a page differs from its artefacts (CI runs this)

A page holds a rendered block as

    <!-- rendered:NAME -->
    ...
    <!-- /rendered:NAME -->

and NAME is one of ``RENDERERS`` below, each a function of one artefact under ``benchmarks/results/``. Nothing
between the markers is written by hand: a number on a results page is either rendered here from the file a
measurement wrote, or it is in the archive with the reason it is there. ``FIGURES`` are drawn the same way, from
an artefact, into docs/img/ (``--check`` only checks that they exist: PNG bytes differ between matplotlib builds).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any
from fedpose.shared.configuration.methods import PRIVATE, RECORD_LEVEL, WITH_PUBLIC

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
PAGES = (REPO / "docs" / "results", REPO / "docs" / "tutorials", REPO / "README.md")


def _provenance(p: dict[str, Any] | None) -> str:
    if not p:
        return "_Provenance: not recorded by this measurement._"
    versions = p.get("versions") or {}
    software = ", ".join(f"{k} {versions[k]}" for k in ("torch", "numpy", "opencv-python-headless", "flwr")
                         if versions.get(k))
    machine = f"{p.get('cpus')} CPUs" + (f" ({p['cpu']}, {p.get('cpu_capability')})" if p.get("cpu") else "")
    if p.get("gpu"):
        machine += f", GPU {p['gpu']}"
    commit = (p.get("commit") or "unknown")[:10] + (" with local changes" if p.get("dirty") else "")
    return (f"_Provenance: `{p.get('command', '')}`; commit {commit}; {str(p.get('date', ''))[:10]}; {machine}, "
            f"{p.get('threads')} torch threads; {software}._")


def render_main(data: dict[str, Any]) -> str:
    """benchmarks/results/main.json (benchmarks/main_seeds.py): the main command over seeds."""
    seed = "seed" if data.get("pretrain_seed") is None else "noise seed"
    rows = [f"| {seed} | start | best (round) | final | gain over the start | epsilon per site | minutes |",
            "|---|---|---|---|---|---|---|"]
    for r in data["seeds"]:
        minutes = f"{r['seconds'] / 60:.1f}" if r.get("seconds") else "-"
        rows.append(f"| {r['seed']} | {r['start']:.2f} | {r['best']:.2f} ({r['best_round']}) | {r['final']:.2f} | "
                    f"{r['gain']:+.2f} | {max(r['sites'].values()):.4f} | {minutes} |")
    s = data["summary"]
    start = (f"{s['start']['mean']:.2f}" if data.get("pretrain_seed") is not None  # one start, no spread
             else f"{s['start']['mean']:.2f} ± {s['start']['std']:.2f}")
    rows.append(f"| **mean ± std** | **{start}** | "
                f"{s['best']['mean']:.2f} ± {s['best']['std']:.2f} | **{s['final']['mean']:.2f} ± "
                f"{s['final']['std']:.2f}** | **{s['gain']['mean']:+.2f} ± {s['gain']['std']:.2f}** | | |")
    curves = ["", "PCKh@0.5 after each round (round 0 is the start):", ""]
    for r in data["seeds"]:
        curves.append(f"- seed {r['seed']}: " + ", ".join(f"{v:.2f}" for v in [r["start"], *r["curve"]]))
    return "\n".join(rows + curves + ["", _provenance(data.get("provenance"))])


def render_main_brief(data: dict[str, Any]) -> str:
    """One sentence of main.json for the README and the quickstart."""
    s, n = data["summary"], len(data["seeds"])
    minutes = [r["seconds"] / 60 for r in data["seeds"] if r.get("seconds")]
    cached = " (the data and the public pretraining already made, as on every run after a clone's first)" \
        if data.get("pretrain_seed") is not None else ""  # one pretraining, made by the first seed's run
    took = (f" The fastest of these runs{cached} took {min(minutes):.0f} minutes on "
            f"{data['provenance'].get('cpus')} CPU cores.") if minutes else ""
    p = data.get("provenance") or {}
    machine = f" on {p['cpu']} ({p.get('cpu_capability')})" if p.get("cpu") else ""
    end = (f"**{s['final']['mean']:.1f} ± {s['final']['std']:.1f}** (a gain of {s['gain']['mean']:+.1f} ± "
           f"{s['gain']['std']:.1f}), every site having spent at most epsilon "
           f"{max(max(r['sites'].values()) for r in data['seeds']):.2f}.{took}")
    if data.get("pretrain_seed") is not None:
        return (f"{'On ' + machine[4:] if machine else 'Here'} the main command's public-pretrained start scores "
                f"**{s['start']['mean']:.1f}** PCKh@0.5 on the validation split; over {n} runs from it, each with "
                f"its own privacy noise, the federated model ends at {end}")
    return (f"Over {n} seeds{machine}, the public-pretrained start scores "
            f"**{s['start']['mean']:.1f} ± {s['start']['std']:.1f}** "
            f"PCKh@0.5 on the validation split and the federated model ends at {end}")


def render_start_by_cpu(data: dict[str, Any]) -> str:
    """benchmarks/results/start_by_cpu.json (benchmarks/start_by_cpu.py): the main command's start per CPU, and the
    range a user should expect (the measured starts, widened to the next half point)."""
    import math

    machines = data["machines"]
    each = [f"{m['start']:.2f} on {m['cpu']} ({m['cpu_capability']} kernels, "
            f"{m['runs']} run{'s' if m['runs'] > 1 else ''})" for m in machines]
    listed = ", ".join(each[:-1]) + f" and {each[-1]}" if len(each) > 1 else each[0]
    starts = [m["start"] for m in machines]
    low, high = math.floor(2 * min(starts)) / 2, math.ceil(2 * max(starts)) / 2
    return (f"Pretraining is seeded, but its start moves with the CPU, whose kernels sum in their own order: the "
            f"main command's start was {listed}. So expect a start between {low:.1f} and {high:.1f} on a fresh "
            "run; a gain is over the run's own start.")


def render_pretraining(data: dict[str, Any]) -> str:
    """benchmarks/results/pretraining.json (benchmarks/pretrain_seeds.py): the start per recipe, seed and kernels."""
    recipes = data["recipes"]
    caps = sorted({r["capability"] for v in recipes.values() for r in v["runs"]})
    seeds = sorted({r["seed"] for v in recipes.values() for r in v["runs"]})
    head = [f"seed {s}, {c}" for c in caps for s in seeds]
    rows = ["| recipe | " + " | ".join(head) + " | mean ± std |", "|---|" + "---|" * (len(head) + 1)]
    for name, v in recipes.items():
        got = {(r["capability"], r["seed"]): r["start"] for r in v["runs"]}
        over = ", ".join(v["overrides"]) or "the config as shipped"
        cells = " | ".join(f"{got[(c, s)]:.2f}" if (c, s) in got else "-" for c in caps for s in seeds)
        rows.append(f"| {name} ({over}) | {cells} | **{v['mean']:.2f} ± {v['std']:.2f}** |")
    return "\n".join(rows + ["", _provenance(data.get("provenance"))])


def render_audits(data: dict[str, Any]) -> str:
    """benchmarks/results/privacy_attacks.json, "audit": one-run audits."""
    rows = ["| method | canaries | noise | claimed eps | eps lower bound (95%) | correct / guesses | steps |",
            "|---|---|---|---|---|---|---|"]
    for a in data["audit"]:
        kind = "input" if a["mode"] == "input" else ("in-span" if "span" in a["name"] else "Dirac")
        noise = ("calibrated" if a["noise_scale"] == 1.0
                 else f"{a['noise_scale']:g} x (control: eps {a['epsilon_ran']:.0f} ran)")
        method = a["method"] + (f", psi {a['psi']}" if a.get("psi") else "")
        if "-recipe-" in a["name"]:
            method += ", the site kits' recipe (each record clipped with its blurred copy, SGD with momentum)"
        rows.append(f"| {method} | {a['canaries']} {kind} | {noise} | {a['epsilon_claimed']:.3f} | "
                    f"**{a['epsilon_lb']:.3f}** | {a['v']} / {a['r']} | {a['steps']} |")
    return "\n".join(rows)


def render_mia(data: dict[str, Any]) -> str:
    """benchmarks/results/privacy_attacks.json, "mia": membership inference."""
    m = data["mia"]
    rows = [f"{m['models']} models per method, each on a random half of a {m['pool']}-record pool, {m['steps']} steps.",
            "", "| method | eps | attack | AUC | TPR @ 1% FPR | TPR @ 0.1% FPR |", "|---|---|---|---|---|---|"]
    for method, v in m["methods"].items():
        eps = "-" if v["epsilon"] is None else f"{v['epsilon']:.3f}"
        for attack, r in v["attacks"].items():
            rows.append(f"| {method} | {eps} | {attack.replace('_', ' ')} | {r['auc']:.3f} | {r['tpr@0.01fpr']:.3f} | "
                        f"{r['tpr@0.001fpr']:.3f} |")
    return "\n".join(rows)


def render_reid(data: dict[str, Any]) -> str:
    """benchmarks/results/privacy_attacks.json, "reid": re-identification of pixelized frames."""
    r = data["reid"]
    eps = sorted({p["eps"] for p in r["pixelized"]})
    rows = [f"{r['identities']} people, {r['query_frames']} queries, chance {r['chance']:.3f}; top-1 accuracy.", "",
            "| release | " + " | ".join(f"eps {e:g}" for e in eps) + " |", "|---|" + "---|" * len(eps)]
    rows.append(f"| clean (no redaction) | {r['clean']:.3f} |" + " |" * (len(eps) - 1))
    rows.append(f"| Gaussian blur sigma {r['blur_sigma']:g} px | {r['blur']:.3f} |" + " |" * (len(eps) - 1))
    for p in r.get("plain_pixelization", []):
        rows.append(f"| plain pixelization b = {p['b']} (no noise, not DP) | {p['top1']:.3f} |" + " |" * (len(eps) - 1))
    for b in sorted({p["b"] for p in r["pixelized"]}):
        for mode in ("uniform", "adaptive"):
            cells = {p["eps"]: p["top1"] for p in r["pixelized"] if p["b"] == b and p["mode"] == mode}
            if cells:
                rows.append(f"| DP b = {b} {mode} | " + " | ".join(f"{cells[e]:.3f}" for e in eps) + " |")
    return "\n".join(rows)


def render_reconstruction(data: dict[str, Any]) -> str:
    """benchmarks/results/feature_dp_reconstruction.json: what one Feature-DP reply gives a crafting server."""
    labels = f"{data['visible_joints']} visible joints within **{data['label_error_px']:.2g} px**"
    rows = [f"Site {data['site']} of `{data['config']}` ({data['records']} records, {data['input_size'][0]}x"
            f"{data['input_size'][1]} input, psi {data['psi']} {data['psi_param']:g}), {data['method']}, public batch "
            f"{data['public_batch_size']}, one reply.", "",
            f"| psi(x) rebuilt ({data['luma_block_px']}-px luminance, {data['colour_block_px']}-px colour) | "
            "same, against any other record of the site | labels | visibility |", "|---|---|---|---|",
            f"| **{data['psnr_db']:.1f} dB** PSNR | at most {data['best_other_record_psnr_db']:.1f} dB | {labels} | "
            f"{'exact' if data['visibility_match'] else 'wrong'} |"]
    pinned = data.get("pinned")
    if pinned:  # the public batch the kit pins: the mean of that many records' gradients
        rows += ["", f"With the public batch the kit pins ({pinned['public_batch_size']} records, "
                     f"{pinned['distinct_drawn']} distinct), one reply:", "",
                 "| labels of the records drawn | psi(x) read | closest single record |", "|---|---|---|",
                 f"| each joint's visible fraction (error {pinned['visible_fraction_error']:.2g}) and distribution "
                 f"of positions over them (error {pinned['position_distribution_error']:.2g}) | a blend: "
                 f"{pinned['psnr_vs_mean_of_drawn_db']:.1f} dB against their mean | "
                 f"{pinned['best_single_record_psnr_db']:.1f} dB |"]
    return "\n".join(rows + ["", _provenance(data.get("provenance"))])


def render_study(rows: list[dict[str, str]]) -> str:
    """benchmarks/results/study/results.csv (fedpose study): PCKh@0.5 per method, setting and epsilon."""
    private = [r for r in rows if r["epsilon"] and not r["ablation"]]
    cols = sorted({(r["setting"], float(r["epsilon"])) for r in private})
    table = ["| method | " + " | ".join(f"{s} eps {e:g}" for s, e in cols) + " |", "|---|" + "---|" * len(cols)]
    for method in PRIVATE:
        cells = []
        for setting, eps in cols:
            vals = [float(r["mean"]) for r in private if r["method"] == method and r["setting"] == setting
                    and float(r["epsilon"]) == eps]
            cells.append(f"{statistics.mean(vals):.2f}" + (f" ± {statistics.stdev(vals):.2f}" if len(vals) > 1 else "")
                         if vals else "-")
        table.append(f"| {method} | " + " | ".join(cells) + " |")
    base = {r["method"]: float(r["mean"]) for r in rows if not r["epsilon"] and not r["ablation"]}
    notes = ", ".join(f"{k} {v:.2f}" for k, v in sorted(base.items()))
    return "\n".join(table + ["", f"Baselines (no DP, centralized): {notes}."])


STUDY30 = "fedpose study --config configs/study-30.yaml --out runs/study-30 --record benchmarks/results/study-30"
WARD_RECORDS, SITE_BATCH = 1200, 64  # configs/default.yaml, which the study varies: 3 sites x 400 records, B = 64


def _stat(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.2f} (1 seed)"
    return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f} ({len(values)})"


def _records(records: list[dict[str, Any]], **point: Any) -> list[dict[str, Any]]:
    return [r for r in records if all(r["cell"].get(k) == v for k, v in point.items())]


def _pckh(records: list[dict[str, Any]], **point: Any) -> list[float]:
    return [float(r["metrics"]["pckh"]["mean"]) for r in _records(records, **point)]


def _one_start(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records, if every cell started from the same pretrained weights (its initial PCKh, or the pretrained
    cell's own); cells from two starts in one table would compare more than their methods."""
    starts: dict[float, list[str]] = {}
    for r in records:
        m = r["metrics"]
        value = m["pckh"]["mean"] if r["cell"]["method"] == "pretrained" else m.get("initial_pckh_mean")
        if value is not None:
            starts.setdefault(round(float(value), 6), []).append(r["cell"]["id"])
    if len(starts) > 1:
        found = "; ".join(f"start {v:.2f}: {len(ids)} cells (e.g. {ids[0]})" for v, ids in sorted(starts.items()))
        raise ValueError(f"the study's cells started from different pretrained weights ({found}): rerun the cells of "
                         "the start that is not the study's")
    return records


def _study_provenance(records: list[dict[str, Any]], command: str | None = None) -> str:
    provs = [r["metrics"]["provenance"] for r in records if r["metrics"].get("provenance")]
    if not provs:
        return "_No cell has finished yet._"
    dates = sorted(str(p["date"])[:10] for p in provs if p.get("date"))
    commits = sorted({(p.get("commit") or "unknown")[:10] for p in provs})
    text = _provenance({**provs[0], "command": command or STUDY30, "dirty": any(p.get("dirty") for p in provs)})
    first = (provs[0].get("commit") or "unknown")[:10]
    return (text.replace(f"commit {first}", f"commit{'s' if len(commits) > 1 else ''} {', '.join(commits)}")[:-2]
            + f"; {len(records)} cells finished, {dates[0]} to {dates[-1]}._")


def render_study30_methods(records: list[dict[str, Any]]) -> str:
    """benchmarks/results/study-30/ (fedpose study --record): the five methods at eps 0.8, 30 epochs per record."""
    records = _one_start(records)
    settings = ("centralized", "federated", "reference")
    lines = ["| method | centralized | federated | reference (pooled, the federation's noise) |", "|---|---|---|---|"]
    start = _pckh(records, method="pretrained")
    lines.append(f"| pretrained start (public data only) | {start[0]:.2f} | | |" if start else "| pretrained | - | | |")
    for method in ("psi-only", "nonprivate"):
        lines.append(f"| {method} (no DP) | {_stat(_pckh(records, method=method, variant=''))} | | |")
    variants = sorted({(r["cell"]["method"], r["cell"]["variant"]) for r in records if r["cell"]["variant"]})
    for method, variant in [(m, "") for m in PRIVATE] + variants:
        cells = [_stat(_pckh(records, method=method, setting=s, epsilon=0.8, variant=variant)) for s in settings]
        lines.append(f"| {method}{f' ({variant})' if variant else ''} | " + " | ".join(cells) + " |")
    notes = ["PCKh@0.5 mean ± std (seeds)."]
    nonprivate = _pckh(records, method="nonprivate", variant="")
    for setting in settings:
        dpsgd, fpdp = (_pckh(records, method=m, setting=setting, epsilon=0.8, variant="") for m in ("dpsgd", "fpdp"))
        if start and nonprivate and dpsgd and fpdp:
            share = {m: _gain_share(statistics.mean(v), start[0], statistics.mean(nonprivate))
                     for m, v in (("fpdp", fpdp), ("dpsgd", dpsgd))}
            notes.append(f"{setting.capitalize()}: fpdp keeps {share['fpdp']:.2f} of the gain, dpsgd "
                         f"{share['dpsgd']:.2f}.")
    return "\n".join(lines + ["", " ".join(notes), "", _study_provenance(records)])


RECORDLEVEL = ("fedpose study --config configs/study-recordlevel.yaml --out runs/study-recordlevel --threads 1 "
               "--record benchmarks/results/study-recordlevel")


def _guarantee(method: str) -> str:
    if method in RECORD_LEVEL:
        return "record-level DP"
    if method in WITH_PUBLIC:
        return "Feature-DP (psi(x) and labels public)"
    return "none (no DP)"


RECORDLEVEL_PROXY = ("fedpose study --config configs/study-recordlevel-proxy.yaml --out runs/study-recordlevel-proxy "
                     "--threads 1 --record benchmarks/results/study-recordlevel-proxy")


def render_recordlevel_proxy(records: list[dict[str, Any]]) -> str:
    """benchmarks/results/study-recordlevel-proxy/: the same recipes on the public proxy ward (hyperparameters)."""
    return render_recordlevel(records, command=RECORDLEVEL_PROXY)


def render_recordlevel_start(records: list[dict[str, Any]], command: str = RECORDLEVEL) -> str:
    """A record-level study's cells from starts pretrained on more public images (a variant naming its ward): one
    table per start, each row's share against that start and the non-private run from it."""
    wards = sorted({_scale_data(r) for r in records} - {""}, key=_natural)
    if not wards:
        return "_No cell from another start has finished yet._"
    return "\n\n".join(
        f"Ward: `{ward}`.\n\n" + render_recordlevel(
            [{**r, "cell": {**r["cell"], "variant": _recipe_part(r)}} for r in records if _scale_data(r) == ward],
            command=command, own_ward=False)
        for ward in wards)


def _natural(text: str) -> list[Any]:
    """Sort key that orders the numbers in a text by value (public=2400 before public=9600 before public=12000)."""
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", text)]


def render_recordlevel_proxy_start(records: list[dict[str, Any]]) -> str:
    """``render_recordlevel_start`` of the proxy."""
    return render_recordlevel_start(records, command=RECORDLEVEL_PROXY)


def render_recordlevel(records: list[dict[str, Any]], command: str = RECORDLEVEL, *, own_ward: bool = True,
                       strategy: str = "full", validation: str = "the 240-image validation split",
                       runs: str = "one torch thread") -> str:
    """benchmarks/results/study-recordlevel/: the record-level recipes beside the start, non-private, psi-only and
    the study's methods, centralized at eps 0.8; each row's share of the gain (non-private minus the start).
    ``own_ward``: leave out the cells of another ward (``render_recordlevel_start`` shows them). ``strategy``: the
    study's own (its non-private run is the gain's end; rows of another one name theirs); ``validation`` and
    ``runs`` are said in the note under the table."""
    records = _one_start(_own_ward(records) if own_ward else records)
    start = _pckh(records, method="pretrained")
    nonprivate = _pckh(records, method="nonprivate", strategy=strategy, variant="")
    if not start or not nonprivate:
        return "_The start and the non-private run have not finished yet._"
    low, gain = start[0], statistics.mean(nonprivate) - start[0]
    lines = ["| recipe | guarantee | PCKh@0.5 | share of the gain | epsilon (accountant) | sigma | steps | minutes |",
             "|---|---|---|---|---|---|---|---|",
             f"| pretrained start (public data only) | none needed | {low:.2f} | 0 | | | | |"]
    points = sorted({(r["cell"]["method"], r["cell"]["strategy"], r["cell"]["clip"], r["cell"]["variant"],
                      r["cell"]["setting"], r["cell"]["epsilon"]) for r in records
                     if r["cell"]["method"] != "pretrained"},
                    key=lambda p: (SETTING_ORDER.index(p[4]),
                                   ("nonprivate", "psi-only", "fpdp", "dpsgd", "proj").index(p[0]),
                                   p[1] != strategy, p[1], p[3], p[5] or 0.0, p[2] or 0.0))
    for method, strategy_of, clip, variant, setting, epsilon in points:
        rows = _records(records, method=method, strategy=strategy_of, clip=clip, variant=variant, setting=setting,
                        epsilon=epsilon)
        values = [float(r["metrics"]["pckh"]["mean"]) for r in rows]
        eps = [r["metrics"].get("epsilon") for r in rows]
        eps_text = f"{max(eps):.4f}" if all(e is not None for e in eps) else ""
        guarantee = _guarantee(method)
        if eps_text and math.isinf(max(eps)):  # clipped without noise: a ceiling, no guarantee
            eps_text, guarantee = "unbounded", "none (diagnostic; clipped, no noise)"
        sigma = {round(float(r["metrics"]["sigma"]), 4) for r in rows if r["metrics"].get("sigma")}
        steps = {int(r["metrics"]["steps"]) for r in rows if r["metrics"].get("steps")}
        minutes = statistics.mean(float(r["metrics"]["seconds"]) for r in rows) / 60
        share = (statistics.mean(values) - low) / gain
        label = ", ".join([*([SETTING_LABEL[setting]] if setting in SETTING_LABEL else []), method,
                           *([f"eps {epsilon:g}"] if epsilon not in (None, 0.8) else []),
                           *([strategy_of] if strategy_of != strategy else []),
                           *([f"C = {clip:g}"] if clip not in (None, 1.0) else []), *([variant] if variant else [])])
        lines.append(f"| {label} | {guarantee} | {_stat(values)} | {share:.2f} | {eps_text} | "
                     f"{', '.join(f'{v:g}' for v in sorted(sigma))} | {', '.join(map(str, sorted(steps)))} | "
                     f"{minutes:.1f} |")
    notes = [f"PCKh@0.5 on {validation}, mean ± std (seeds); the gain is non-private minus the "
             f"start ({statistics.mean(nonprivate):.2f} - {low:.2f} = {gain:.2f}); epsilon is the accountant's for the "
             f"(sigma, q, steps) that ran, the largest over seeds (delta 1e-5); minutes per run, {runs}."]
    return "\n".join(lines + ["", " ".join(notes), "", _study_provenance(records, command)])


RECORDLEVEL_DP = ("fedpose study --config configs/study-recordlevel-dp.yaml --out runs/study-recordlevel-dp "
                  "--threads 1 --record benchmarks/results/study-recordlevel-dp")
RECORDLEVEL_DP_PROXY = ("fedpose study --config configs/study-recordlevel-dp-proxy.yaml --out "
                        "runs/study-recordlevel-dp-proxy --threads 1 "
                        "--record benchmarks/results/study-recordlevel-dp-proxy")


def render_cells(records: list[dict[str, Any]], command: str) -> str:
    """A study's cells one row per setting (its variant: what the cell sets beside the study's base), sorted by
    method and variant: the guarantee the accountant gives the run that ran (a diagnostic's fixed sigma has none
    worth the name: its epsilon is said), sigma, PCKh@0.5 (mean ± std over its seeds where more than one ran) and
    the run's own start."""
    if not records:
        return "_No cell has finished yet._"
    lines = ["| method | cell (beside the study's base) | guarantee | sigma | PCKh@0.5 | start | minutes |",
             "|---|---|---|---|---|---|---|"]
    settings: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in records:
        settings.setdefault((r["cell"]["method"], r["cell"]["variant"]), []).append(r)
    for (method, variant), runs in sorted(settings.items(), key=lambda kv: (kv[0][0], _natural(kv[0][1]))):
        m = runs[0]["metrics"]
        eps = m.get("epsilon")
        if method not in RECORD_LEVEL:
            guarantee = "none (no DP)"
        elif _diagnostic(runs[0]):
            guarantee = ("none (diagnostic; eps unbounded)" if eps is None or not math.isfinite(float(eps))
                         else f"none (diagnostic; eps {float(eps):.3g})")
        else:
            guarantee = f"record-level, eps {float(eps):.2f}"
        sigma = f"{float(m['sigma']):.4g}" if m.get("sigma") is not None else ""
        starts = sorted({f"{float(r['metrics']['initial_pckh_mean']):.2f}" for r in runs
                         if r["metrics"].get("initial_pckh_mean") is not None})
        values = [float(r["metrics"]["pckh"]["mean"]) for r in runs]
        pckh = f"{values[0]:.2f}" if len(values) == 1 else _stat(values)
        minutes = statistics.mean(float(r["metrics"]["seconds"]) for r in runs) / 60
        lines.append(f"| {method} | {variant or '(the base)'} | {guarantee} | {sigma} | {pckh} | "
                     f"{', '.join(starts)} | {minutes:.1f} |")
    note = ("PCKh@0.5 on the validation split of the cell's ward, one seed unless the row gives mean ± std (seeds); "
            "minutes per run, one torch thread.")
    return "\n".join(lines + ["", note, "", _study_provenance(records, command)])


def render_recordlevel_dp(records: list[dict[str, Any]]) -> str:
    """benchmarks/results/study-recordlevel-dp/: full-dimension dpsgd on the ward, its diagnostics and ceilings."""
    return render_cells(records, RECORDLEVEL_DP)


def render_recordlevel_dp_proxy(records: list[dict[str, Any]]) -> str:
    """benchmarks/results/study-recordlevel-dp-proxy/: the same step's rates on the public proxy."""
    return render_cells(records, RECORDLEVEL_DP_PROXY)


RECORDLEVEL_EPS = ("fedpose study --config configs/study-recordlevel-eps.yaml --out runs/study-recordlevel-eps "
                   "--threads 1 --record benchmarks/results/study-recordlevel-eps")
TWO_THIRDS = 2 / 3


def _nonprivate_400() -> tuple[float, float] | None:
    """(start, non-private mean) at 400 records per site on the ward, from the data-scale study's records."""
    points = _scale_points(load_artefact("study-scale"))
    if len(points.get(("start", 400), [])) != 1:
        return None
    return _reference(points, 400)


def _diagnostic(record: dict[str, Any]) -> bool:
    """A cell at a fixed sigma (privacy.noise_multiplier): no guarantee worth the name, a ceiling or a probe."""
    return "privacy.noise_multiplier" in record["cell"]["variant"]


def render_recordlevel_eps(records: list[dict[str, Any]]) -> str:
    """benchmarks/results/study-recordlevel-eps/: the best record-level recipe at each epsilon, 400 records per
    site, with its share of the gain from the start to non-private training on the same ward; the same clipped step
    without noise (a diagnostic) last."""
    if not records:
        return "_No cell has finished yet._"
    reference = _nonprivate_400()
    lines = ["| epsilon: target (spent) | sigma | PCKh@0.5 | start | share of the gain |", "|---|---|---|---|---|"]
    kept = None
    for r in sorted(records, key=lambda r: (_diagnostic(r), float(r["cell"]["epsilon"]))):
        m = r["metrics"]
        value, start = float(m["pckh"]["mean"]), float(m["initial_pckh_mean"])
        share = _gain_share(value, start, reference[1]) if reference else float("nan")
        if _diagnostic(r):
            eps = "unbounded: clipped, no noise (diagnostic)"
        else:
            eps = f"{float(r['cell']['epsilon']):g} ({float(m['epsilon']):.3f})"
            if kept is None and share >= TWO_THIRDS:
                kept = float(r["cell"]["epsilon"])
        lines.append(f"| {eps} | {float(m['sigma']):.3f} | {value:.2f} | {start:.2f} | {share:.2f} |")
    private = [float(r["cell"]["epsilon"]) for r in records if not _diagnostic(r)]
    reach = (f"it keeps two thirds of the gain from epsilon {kept:g}" if kept is not None
             else f"it keeps two thirds of the gain at none of these: above epsilon {max(private):g}" if private
             else "no private cell has run")
    note = ("PCKh@0.5 on the ward's validation split, one seed each, centralized on the pooled 1,200 images (400 per "
            "site), delta 1e-5; sigma is what the accountant calibrated for the run's sampling rate and steps. The "
            "share of the gain is against non-private training at "
            + (f"{reference[1]:.2f} from the same start ({reference[0]:.2f}; the data-scale study's records)"
               if reference else "not recorded") + f"; {reach}.")
    return "\n".join(lines + ["", note, "", _study_provenance(records, RECORDLEVEL_EPS)])


def figure_recordlevel_eps(records: list[dict[str, Any]], path: Path) -> None:
    """PCKh@0.5 of the best record-level recipe against epsilon (log scale), with the start, non-private and the
    two-thirds-of-the-gain level."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    points = sorted((float(r["cell"]["epsilon"]), float(r["metrics"]["pckh"]["mean"])) for r in records
                    if not _diagnostic(r))
    if points:
        ax.plot([e for e, _ in points], [v for _, v in points], marker="o", color="tab:orange",
                label="proj, SGD momentum, clipped with psi (record-level)")
    reference = _nonprivate_400()
    if reference:
        start, top = reference
        ax.axhline(top, color="gray", linestyle="--", label="non-private (no guarantee)")
        ax.axhline(start + TWO_THIRDS * (top - start), color="tab:green", linestyle=":", label="two thirds of the gain")
        ax.axhline(start, color="gray", linestyle="-.", label="public start")
    for r in records:
        if _diagnostic(r):
            ax.axhline(float(r["metrics"]["pckh"]["mean"]), color="tab:orange", linestyle=":",
                       label="the same step clipped, without noise (no guarantee)")
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xticks([e for e, _ in points] or [1.0])
    ax.set_xticklabels([f"{e:g}" for e, _ in points] or ["1"])
    ax.set_xlabel("epsilon per record (delta 1e-5)")
    ax.set_ylabel("PCKh@0.5")
    ax.set_title("400 records per site, pooled (1,200)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)


PAPER_GPU = ("fedpose study --config configs/study-paper-gpu.yaml --out runs/study-paper-gpu --jobs 2 "
             "--record benchmarks/results/study-paper-gpu")


def render_paper_gpu(records: list[dict[str, Any]]) -> str:
    """benchmarks/results/study-paper-gpu/: the paper's model and input on a GPU, the best record-level recipe beside
    fpdp, non-private, psi-only and the start (``benchmarks/gpu_session.sh``)."""
    gpus = sorted({str(r["metrics"]["provenance"].get("gpu")) for r in records if r["metrics"].get("provenance")})
    val = {r["metrics"]["data"].get("records", {}).get("val") for r in records if r["metrics"].get("data")} - {None}
    where = f"the {val.pop():,}-image validation split" if len(val) == 1 else "the validation split"
    return (f"GPU-measured on one {', '.join(gpus)}.\n\n"
            + render_recordlevel(records, command=PAPER_GPU, own_ward=False, strategy="finetune", validation=where,
                                 runs="two cells side by side on the one GPU"))


def render_batch_assembly(data: dict[str, Any]) -> str:
    """benchmarks/results/batch_assembly*.json (benchmarks/batch_assembly.py): a training process's batches a second,
    per image on the CPU and, where measured, assembled on a device beside it."""
    h, w = data["input"]
    rates = data["images_per_second"]
    private, psi = "a private step's batch (scale, rotation, flip)", "the unaugmented crops psi is applied to"
    labels = {"train": private, "private": private, "canonical": psi, "psi": psi,
              "pretrain": "public pretraining's batch (and the photometric jitter)"}
    # one path per kind (per image) in the older records; the per-image and the device path side by side since
    paths = {kind: by if "per-image" in by else {"per-image": by} for kind, by in rates.items()}
    threads = sorted({int(n) for by in paths.values() for path in by.values() for n in path})
    two = any("device" in by for by in paths.values())
    where = f", the device path on {data.get('device', 'the CPU')}" if two else ""
    rows = [f"Batch {data['batch']} at {h}x{w} from 320 px images, images per second, median (min-max) of "
            f"{data['rounds']} interleaved rounds{where}; "
            + ("x: over the per-image path at the same thread count." if two else "x: over one thread."), "",
            "| batch | " + ("path | " if two else "") + " | ".join(f"{n} thread{'s' if n > 1 else ''}"
                                                                  for n in threads) + " |",
            "|---|" + ("---|" if two else "") + "---|" * len(threads)]
    for kind, by_path in paths.items():
        per_image = by_path["per-image"]
        for path, by in by_path.items():
            cells = []
            for n in threads:
                v = by[str(n)]
                base = per_image[str(n)]["median"] if two else per_image[str(threads[0])]["median"]
                ratio = f", x{v['median'] / base:.2f}" if (two and path != "per-image") or (
                    not two and n != threads[0]) else ""
                cells.append(f"{v['median']:.0f} ({v['min']:.0f}-{v['max']:.0f}){ratio}")
            rows.append(f"| {labels.get(kind, kind)} | " + (f"{path} | " if two else "") + " | ".join(cells) + " |")
    return "\n".join(rows + ["", _provenance(data.get("provenance"))])


RECIPE = "train.optimizer=sgd, train.momentum=0.9, train.lr=0.003"  # the record-level recipe's step (proj)
BEST = "train.images=raw+psi, " + RECIPE  # the best record-level recipe: each record clipped with its blurred copy
KITS = BEST + ", federation.site_optimizer=keep"  # the same, federated: what the site kits are provisioned with
# The kits' recipe in the data-scale study, whose base keeps the task weights trained and V's public rows raw (its
# older cells ran so): today's defaults put back, as the kits run it
SCALE_KITS = "train.task_weights=auto, privacy.basis_rows=clipped, " + BEST
KITS_ROW = "proj, the site kits' recipe (each image clipped with its blurred copy)"  # its data-scale row
FEDERATED = "setting=federated"  # how a data-scale cell's recipe says it ran federated (``_scale_recipe``)
KITS_FEDERATED_ROW = "proj, the site kits' recipe, federated"
PER_SITE = "record-level DP at each site, the server untrusted"  # a federated row's guarantee
REFERENCE = "setting=reference"  # a data-scale cell of the federation's reachable reference (``_scale_recipe``)
KITS_REFERENCE_ROW = "proj, the site kits' recipe, reference (pooled, the federation's noise)"
CURATOR = "record-level DP, pooled by a trusted curator: a diagnostic"  # the reference row's guarantee
SETTING_ORDER = ("centralized", "reference", "federated")
SETTING_LABEL = {"reference": "reference (pooled, the federation's noise)", "federated": "federated"}


def _gain_share(value: float, start: float, nonprivate: float) -> float:
    return (value - start) / (nonprivate - start)


def render_recordlevel_brief(records: list[dict[str, Any]]) -> str:
    """The README's line: the same ward centralized, each number with the guarantee it carries."""
    records = _one_start(_own_ward(records))
    start = _pckh(records, method="pretrained")
    nonprivate = _pckh(records, method="nonprivate", strategy="full", variant="")
    recipe = _pckh(records, method="proj", strategy="full", variant=BEST, setting="centralized")
    federated = _pckh(records, method="proj", strategy="full", setting="federated", variant=KITS)
    fpdp = _pckh(records, method="fpdp", strategy="full", variant="", epsilon=0.8)
    psi = _pckh(records, method="psi-only", variant="")
    if not (start and nonprivate and recipe and fpdp and psi):
        return "_The record-level study has not finished yet._"
    low, top = start[0], statistics.mean(nonprivate)
    return (f"On the same ward, trained centrally on the three sites' 1,200 images at epsilon 0.8 ({len(recipe)} "
            f"seeds): record-level DP, whose guarantee covers each image (`proj` with SGD and momentum, each image "
            f"clipped with its blurred copy), reaches "
            f"**{statistics.mean(recipe):.1f}**, {_gain_share(statistics.mean(recipe), low, top):.2f} of the gain "
            f"from the start ({low:.1f}, public data only) to the non-private run ({top:.1f}, no guarantee)"
            + (f", and {statistics.mean(federated):.1f} federated across the three sites, each accounting for its "
               f"own records ({_gain_share(statistics.mean(federated), low, top):.2f})" if federated else "") + "; "
            f"Feature-DP (`fpdp`) reaches {statistics.mean(fpdp):.1f}, and training on the blurred copies alone, "
            f"with no noise and the blurred copies public, {statistics.mean(psi):.1f}.")


def _kits_recipe(records: list[dict[str, Any]]) -> dict[str, list[float]]:
    """The site kits' record-level recipe in a record-level study's own ward, at epsilon 0.8: pooled and federated
    PCKh@0.5 (each list empty where no cell of it ran)."""
    records = _own_ward(records)
    return {"centralized": _pckh(records, method="proj", strategy="full", setting="centralized", epsilon=0.8,
                                 variant=BEST),
            "federated": _pckh(records, method="proj", strategy="full", setting="federated", epsilon=0.8,
                               variant=KITS)}


def _listed(parts: list[str]) -> str:
    """"a", "a and b", "a, b and c"."""
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _at_sizes(shares: dict[int, float], what: str = "", unit: str = "") -> str:
    """0.89{what} at 400{unit}, 0.84 at 1,600 and 0.97 at 6,400."""
    return _listed([f"{share:.2f}{what if i == 0 else ''} at {n:,}{unit if i == 0 else ''}" for i, (n, share) in
                    enumerate(shares.items())])


def render_summary(artefacts: tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]) -> str:
    """The results page's first screen, from the record-level study (the site kits' recipe), the five-method study
    (the start, non-private, fpdp pooled and federated) and the data-scale study (how many records): what each
    guarantee reaches on the reference ward, as a share of the gain (defined here, the page's one ratio)."""
    recordlevel, study30, scale = artefacts
    recordlevel, study30 = _own_ward(recordlevel), _one_start(study30)
    _one_start([*study30, *recordlevel])  # one start for every row, or the rows compare starts
    start, top = _pckh(study30, method="pretrained"), _pckh(study30, method="nonprivate", strategy="full", variant="")
    fpdp = {s: _pckh(study30, method="fpdp", strategy="full", setting=s, epsilon=0.8, variant="")
            for s in ("centralized", "federated")}
    kits = _kits_recipe(recordlevel)
    if not (start and top and fpdp["centralized"] and kits["centralized"]):
        return "_The studies behind the summary have not finished yet._"
    low, high = start[0], statistics.mean(top)

    def cell(values: list[float]) -> str:
        return f"{statistics.mean(values):.2f} ({_gain_share(statistics.mean(values), low, high):.2f})" if values \
            else "-"

    seeds = sorted({len(v) for v in (top, *fpdp.values(), *kits.values()) if v})
    federated = next((r["metrics"] for r in study30 if r["cell"]["setting"] == "federated"
                      and r["metrics"].get("sites")), {})
    delta = federated.get("delta") or next(iter(federated.get("sites", {}).values()), {}).get("delta")
    points = _scale_points(scale)
    sizes = sorted({n for _, n in points})
    fpdp_shares = _row_shares(points, "fpdp")
    record_shares = _size_shares(points, _best_record_level(points, _scale_rows(scale), sizes))
    lines = [f"On the reference ward ({len(federated.get('sites', {})) or 'three'} sites of {sizes[0]:,} synthetic "
             f"images each; epsilon 0.8{f' and delta {delta:g}'.replace('e-0', 'e-') if delta else ''} per site; "
             "30 epochs per record), "
             "PCKh@0.5 on the "
             f"240-image validation split, mean of {' to '.join(map(str, seeds))} seeds. Pooled: the sites' images "
             "trained in one place; federated: each site keeps its images and accounts for them itself against an "
             "untrusted server.", "",
             "| training | guarantee | pooled: PCKh@0.5 (share of the gain) "
             "| federated: PCKh@0.5 (share of the gain) |",
             "|---|---|---|---|",
             f"| the public-pretrained start | none needed (public data only) | {low:.2f} (0) | |",
             f"| non-private | none | {high:.2f} (1) | |",
             f"| fpdp | Feature-DP | {cell(fpdp['centralized'])} | {cell(fpdp['federated'])} |",
             f"| proj, the site kits' record-level recipe | record-level DP | {cell(kits['centralized'])} | "
             f"{cell(kits['federated'])} |", "",
             "**Share of the gain** = (PCKh - start) / (non-private - start): the part of what non-private training "
             "adds to the public start that a private run keeps (0: nothing, 1: all of it). It is the one ratio "
             "this page uses."]
    if fpdp_shares and record_shares:
        def enough(shares: dict[int, float], name: str) -> str:
            first = [n for n, share in shares.items() if share >= HALF]
            return (f"with {name} {first[0]:,} records per site keep half of the gain or more" if first else
                    f"with {name} none of the sizes measured does (up to {max(shares):,} per site)")

        said = enough(fpdp_shares, "Feature-DP")
        larger = {len(v) for (name, n), v in points.items() if n > sizes[0] and name != "start"}
        seeds_above = (f", one seed above {sizes[0]:,} records per site" if larger == {1} else
                       ", the seeds of the data-scale table")
        kits_shares = _row_shares(points, KITS_ROW)
        record_level = (f"the site kits' record-level recipe keeps {_at_sizes(kits_shares)}; the best record-level "
                        f"run at each size {_at_sizes(record_shares)}" if kits_shares else
                        "the best record-level run of that study (which did not run the kits' recipe) "
                        f"{_at_sizes(record_shares)}")
        lines += ["", f"**How many records a site needs** (pooled{seeds_above}): Feature-DP keeps "
                  f"{_at_sizes(fpdp_shares, ' of the gain', ' records per site')}; {record_level}. "
                  f"{said[0].upper() + said[1:]}; {enough(record_shares, 'record-level DP')}."]
    return "\n".join(lines)


def _seeds_said(counts: dict[str, int], *, each: bool) -> str:
    """How many seeds stand behind a sentence's figures, ``counts`` being each figure's place (as the sentence
    says it, in its order) and its seeds: "3 seeds each", "one seed", or "3 seeds at 400 and 1,600, one at 6,400"."""
    if len(set(counts.values())) > 1:
        places: dict[int, list[str]] = {}
        for place, n in counts.items():
            places.setdefault(n, []).append(place)
        parts = [f"{'one' if n == 1 else n}{(' seed' if n == 1 else ' seeds') if i == 0 else ''} at {_listed(at)}"
                 for i, (n, at) in enumerate(places.items())]
        return ", ".join(parts)
    n = next(iter(counts.values()))
    return ("one seed" if n == 1 else f"{n} seeds") + (" each" if each else "")


def render_records_brief(artefacts: tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]) -> str:
    """The README's "how many records a site needs": from the data-scale study (the site kits' recipe and the best
    record-level run at each size), full-dimension DP-SGD at its largest size (study-recordlevel-dp) and the kits'
    recipe against epsilon with its clipped ceiling (study-recordlevel-eps; the same ceiling at larger sizes from
    study-recordlevel-dp), each as a share of the gain."""
    scale, dp, eps = artefacts
    points = _scale_points(scale)
    sizes = sorted({n for _, n in points})
    kits = _row_shares(points, KITS_ROW)
    best = _size_shares(points, _best_record_level(points, _scale_rows(scale), sizes))
    if not (kits and best):
        return "_The data-scale study has not run the site kits' recipe yet._"
    seeds = {f"{n:,}": len(points[(KITS_ROW, n)]) for n in kits}
    said = ("The site kits' record-level recipe keeps "
            f"{_at_sizes(kits, ' of the non-private gain', ' records per site')} "
            f"({_seeds_said(seeds, each=len(kits) > 1)}); "
            f"the best record-level run of the data-scale study {_at_sizes(best)}")
    by_digest = _sizes_by_digest(scale)
    full = {}
    for r in dp:
        n = _per_site(r, by_digest)
        if r["cell"]["method"] == "dpsgd" and not _diagnostic(r) and n is not None and _reference(points, n):
            full.setdefault(n, []).append(float(r["metrics"]["pckh"]["mean"]))
    if full:
        n = max(full)
        kept = _gain_share(statistics.mean(full[n]), *_reference(points, n))
        said += f", and full-dimension DP-SGD on {n:,} records per site keeps {kept:.2f}"
        best[n] = max(best.get(n, kept), kept)
    if federated := _row_shares(points, KITS_FEDERATED_ROW):
        counts = {f"{n:,}": len(points[(KITS_FEDERATED_ROW, n)]) for n in federated}
        said += ("; federated across the three sites, each accounting for its own records against an untrusted "
                 f"server, the kits' recipe keeps {_at_sizes(federated)} ({_seeds_said(counts, each=len(counts) > 1)})")
    half = [n for n, share in sorted(best.items()) if share >= HALF]
    verdict = f"from {half[0]:,} per site" if half else f"more than {max(best):,} per site"
    said = ("How many records a site needs before record-level DP pays off, measured on this ward at epsilon 0.8: "
            f"{verdict}. {said}.")
    private: dict[float, list[float]] = {}  # epsilon -> PCKh of each seed
    for r in eps:
        if not _diagnostic(r):
            private.setdefault(float(r["cell"]["epsilon"]), []).append(float(r["metrics"]["pckh"]["mean"]))
    ceiling = [float(r["metrics"]["pckh"]["mean"]) for r in eps if _diagnostic(r)]
    reference = _reference(points, sizes[0])
    if private and reference:
        start, top = reference
        low, high = min(private), max(private)
        share = {e: _gain_share(statistics.mean(v), start, top) for e, v in private.items()}
        said += (f" A larger budget {'buys it' if share[high] >= HALF else 'does not buy it either'}: at "
                 f"{sizes[0]:,} records per site the kits' recipe keeps {share[low]:.2f} of the gain at epsilon "
                 f"{low:g} and {share[high]:.2f} at epsilon {high:g}")
        said += f" ({_seeds_said({f'epsilon {e:g}': len(private[e]) for e in (low, high)}, each=True)})"
        if ceiling:
            clipped = _gain_share(statistics.mean(ceiling), start, top)
            said += f", and {clipped:.2f} clipped without noise"
            larger = _kits_ceilings(dp, points, by_digest)
            shares = {n: _gain_share(statistics.mean(v), *_reference(points, n)) for n, v in larger.items()}
            if larger:
                counts = {f"{n:,}": len(v) for n, v in larger.items()}
                said += (f" ({_at_sizes(shares, unit=' records per site')}, "
                         f"{_seeds_said(counts, each=len(counts) > 1)})")
            gaps = [clipped - share[low], *(shares[n] - kits[n] for n in shares if n in kits)]
            said += (": its step, not the noise, is what holds it." if max(gaps) < 0.1 else
                     ": the noise takes the difference.")
        else:
            said += "."
    return said


def _kits_ceilings(dp: list[dict[str, Any]], points: dict[tuple[str, int], list[float]],
                   by_digest: dict[str, int]) -> dict[int, list[float]]:
    """The kits' recipe clipped without noise (proj, each image with its blurred copy, sigma 0) at the sizes
    study-recordlevel-dp ran it, where the data-scale study gives that size's start and non-private run."""
    ceilings: dict[int, list[float]] = {}
    for r in dp:
        n = _per_site(r, by_digest)
        if (r["cell"]["method"] == "proj" and "privacy.noise_multiplier=0.0" in r["cell"]["variant"]
                and "train.images=raw+psi" in r["cell"]["variant"] and n is not None and _reference(points, n)):
            ceilings.setdefault(n, []).append(float(r["metrics"]["pckh"]["mean"]))
    return dict(sorted(ceilings.items()))


SCALE = ("fedpose study --config configs/study-scale.yaml --out runs/study-scale --threads 1 "
         "--record benchmarks/results/study-scale")
_SCALE_ROWS = (("nonprivate", "", "non-private", "none (no DP)"),
               ("psi-only", "", "psi-only (blurred copies alone)", "none: the blurred copies are public"),
               ("fpdp", "", "fpdp", "Feature-DP (psi(x) and labels public)"),
               ("proj", RECIPE + ", privacy.basis_clip=1.0", "proj, 3e-3, V from clipped gradients",
                "record-level DP"),
               ("dpsgd", "train.lr=0.0001", "dpsgd, Adam 1e-4", "record-level DP"),
               ("proj", SCALE_KITS, KITS_ROW, "record-level DP"),
               ("proj", f"{FEDERATED}, {SCALE_KITS}, federation.site_optimizer=keep", KITS_FEDERATED_ROW, PER_SITE),
               ("proj", f"{REFERENCE}, {SCALE_KITS}, federation.site_optimizer=keep", KITS_REFERENCE_ROW, CURATOR),
               ("proj", RECIPE, "proj, SGD momentum 0.9, 3e-3", "record-level DP"))  # the recipe: last


def _per_site(record: dict[str, Any], by_digest: dict[str, int] | None = None) -> int | None:
    """Records per site from the cell's data counts; a record older than those counts takes them from another
    record of the same data (``by_digest``: the ward's digest -> records per site)."""
    data = record["metrics"].get("data") or {}
    sites = [v for k, v in (data.get("records") or {}).items() if k.startswith("site-") and v is not None]
    if sites:
        return sites[0]
    return (by_digest or {}).get(data.get("digest", ""))


def _scale_rows(records: list[dict[str, Any]]) -> list[tuple[str, str, str, str]]:
    """The named rows, then one per other (method, recipe) the study recorded, labelled with what it changes."""
    named = {(method, variant) for method, variant, _, _ in _SCALE_ROWS}
    guarantees = {method: guarantee for method, _, _, guarantee in _SCALE_ROWS}
    others = sorted({(r["cell"]["method"], _scale_recipe(r)) for r in records
                     if r["cell"]["method"] != "pretrained"} - named)
    return [*_SCALE_ROWS, *((method, variant, ", ".join(p for p in (method, variant) if p),
                             PER_SITE if variant.startswith(FEDERATED) else CURATOR if variant.startswith(REFERENCE)
                             else guarantees.get(method, "record-level DP"))
                            for method, variant in others)]


def _scale_recipe(record: dict[str, Any]) -> str:
    """A data-scale cell's recipe: what it changes in the training, led by ``FEDERATED`` when the sites trained it
    federated (``REFERENCE`` for the federation's reference); without the federation's schedule (rounds x local
    steps: 30 epochs per record, as every cell)."""
    parts = [p for p in _recipe_part(record).split(", ") if p and not p.startswith(_SCHEDULE_KEYS)]
    lead = {"federated": [FEDERATED], "reference": [REFERENCE]}.get(record["cell"]["setting"], [])
    return ", ".join(lead + parts)


_SCHEDULE_KEYS = ("federation.rounds=", "federation.local_steps=")


def _sizes_by_digest(records: list[dict[str, Any]]) -> dict[str, int]:
    """A ward's data digest -> its records per site, from the records that counted them."""
    return {r["metrics"]["data"]["digest"]: size for r in records
            if (size := _per_site(r)) is not None and r["metrics"].get("data", {}).get("digest")}


def _scale_points(records: list[dict[str, Any]]) -> dict[tuple[str, int], list[float]]:
    """(row label, records per site) -> PCKh values; 'start' from each run's own initial PCKh."""
    points: dict[tuple[str, int], list[float]] = {}
    rows = _scale_rows(records)
    by_digest = _sizes_by_digest(records)
    own = {size for r in _own_ward(records) if (size := _per_site(r, by_digest)) is not None}
    for r in records:
        if r["cell"]["setting"] == "federated":  # the server counts no site's records: the size its ward has
            named = re.search(r"data\.synth\.per_site=(\d+)", r["cell"]["variant"])
            size = int(named.group(1)) if named else (next(iter(own)) if len(own) == 1 else None)
        else:
            size = _per_site(r, by_digest)  # pooled: the centralized cells and the federation's reference
        if size is None:
            continue
        if r["metrics"].get("initial_pckh_mean") is not None and r["cell"]["seed"] is not None:
            points.setdefault(("start", size), [])
            start = round(float(r["metrics"]["initial_pckh_mean"]), 6)
            if start not in points[("start", size)]:
                points[("start", size)].append(start)
        for method, variant, label, _ in rows:
            if r["cell"]["method"] == method and _scale_recipe(r) == variant:
                points.setdefault((label, size), []).append(float(r["metrics"]["pckh"]["mean"]))
    return points


def _scale_data(record: dict[str, Any]) -> str:
    """The part of a cell's variant that only names its ward (size, public images, root, pretrained weights' folder)."""
    return ", ".join(p for p in record["cell"]["variant"].split(", ") if p.startswith(_WARD_KEYS))


def _own_ward(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The cells of the study's own ward (the others name theirs in their variant: ``_scale_data``)."""
    return [r for r in records if not _scale_data(r)]


def _recipe_part(record: dict[str, Any]) -> str:
    """The rest of a cell's variant: what it changes in the training, not in the ward."""
    return ", ".join(p for p in record["cell"]["variant"].split(", ") if p and not p.startswith(_WARD_KEYS))


_WARD_KEYS = ("data.synth.per_site=", "data.synth.public=", "data.root=", "pretrain.out=")


def render_scale(records: list[dict[str, Any]]) -> str:
    """benchmarks/results/study-scale/: PCKh against records per site, and the best record-level row's share of the
    gain at each size."""
    points = _scale_points(records)
    sizes = sorted({size for _, size in points})
    lines = ["| method | guarantee | " + " | ".join(f"{n:,} per site" for n in sizes) + " |",
             "|---|---|" + "---|" * len(sizes),
             "| pretrained start | none needed (public data) | "
             + " | ".join(", ".join(f"{v:.2f}" for v in points.get(("start", n), [])) or "-" for n in sizes) + " |"]
    for _, _, label, guarantee in _scale_rows(records):
        lines.append(f"| {label} | {guarantee} | " + " | ".join(_stat(points.get((label, n), [])) for n in sizes)
                     + " |")
    best = _best_record_level(points, _scale_rows(records), sizes)
    shares = _size_shares(points, best)
    notes = ["PCKh@0.5 on the 240-image validation split, mean ± std (seeds), centralized on the three sites' "
             "records at epsilon 0.8 (delta 1e-5), 30 epochs per record; the start is each run's own (the public "
             "split is the same at every size). A federated row trained across the three sites, each accounting for "
             "its own records against the server, for as many epochs of its records, in rounds of local steps."]
    if shares:
        notes.append("The best record-level row's share of the gain at each size: "
                     + "; ".join(f"{n:,}: {share:.2f} ({best[n]})" for n, share in shares.items()) + ".")
        enough = [n for n, share in shares.items() if share >= HALF]
        notes.append(f"It keeps half of the gain from {enough[0]:,} records per site." if enough else
                     f"It keeps half of the gain at none of the sizes where both ran (up to {max(shares):,} "
                     "per site).")
    if federated := _row_shares(points, KITS_FEDERATED_ROW):
        notes.append(f"Federated, the site kits' recipe keeps {_at_sizes(federated, ' of the gain')}.")
    notes.extend(_federation_split(points))
    return "\n".join(lines + ["", " ".join(notes), "", _study_provenance(records, SCALE)])


def _federation_split(points: dict[tuple[str, int], list[float]]) -> list[str]:
    """At each size where the kits' recipe ran pooled, federated and as the federation's reference, how far the
    federated row ends from the pooled one, split into the price of not trusting the server (reference - pooled)
    and the federation's own (federated - reference)."""
    said = []
    for n in sorted(n for name, n in points if name == KITS_REFERENCE_ROW):
        rows = [points.get((label, n)) for label in (KITS_ROW, KITS_FEDERATED_ROW, KITS_REFERENCE_ROW)]
        if all(rows):
            pooled, federated, reference = (statistics.mean(v) for v in rows)
            said.append(f"At {n:,} records per site the federated row ends {abs(federated - pooled):.2f} points "
                        f"{'below' if federated < pooled else 'above'} the pooled one: the price of not trusting "
                        f"the server (reference - pooled) {reference - pooled:+.2f}, the federation's own (federated "
                        f"- reference) {federated - reference:+.2f}.")
    return said


HALF = 0.5  # the share of the gain the data-scale study asks for: from how many records a guarantee keeps half


def _reference(points: dict[tuple[str, int], list[float]], n: int) -> tuple[float, float] | None:
    """(start, non-private) at ``n`` records per site, each a mean over its runs; None where either did not run."""
    start, top = points.get(("start", n)), points.get((_SCALE_ROWS[0][2], n))
    return (statistics.mean(start), statistics.mean(top)) if start and top else None


def _size_shares(points: dict[tuple[str, int], list[float]], label: dict[int, str]) -> dict[int, float]:
    """Per size, the share of the gain of the row ``label[size]``: against that size's start and non-private run."""
    return {n: _gain_share(statistics.mean(points[(name, n)]), *reference)
            for n, name in sorted(label.items()) if (reference := _reference(points, n))}


def _row_shares(points: dict[tuple[str, int], list[float]], label: str) -> dict[int, float]:
    """The share of the gain of the row ``label`` at every size it ran."""
    return _size_shares(points, {n: name for name, n in points if name == label})


def _best_record_level(points: dict[tuple[str, int], list[float]], rows: list[tuple[str, str, str, str]],
                       sizes: list[int]) -> dict[int, str]:
    """Per size, the label of the record-level row with the highest mean (the recipe's on a tie)."""
    recipe = _SCALE_ROWS[-1][2]
    labels = [recipe, KITS_ROW, *(label for _, _, label, guarantee in rows
                                  if guarantee == "record-level DP" and label not in (recipe, KITS_ROW))]
    best = {}
    for n in sizes:
        ran = [label for label in labels if points.get((label, n))]
        if ran:
            best[n] = max(ran, key=lambda label: statistics.mean(points[(label, n)]))
    return best


def figure_scale(records: list[dict[str, Any]], path: Path) -> None:
    """PCKh@0.5 against records per site (log scale), each method with its guarantee."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = _scale_points(records)
    colours = ("black", "tab:green", "tab:blue", "tab:red", "tab:purple", "tab:brown", "tab:brown", "tab:brown",
               "tab:orange")
    assert len(colours) == len(_SCALE_ROWS), "one colour per named row"
    fig, ax = plt.subplots(figsize=(7, 7))
    for (_, variant, label, guarantee), colour in zip(_SCALE_ROWS, colours):
        sizes = sorted(n for (name, n) in points if name == label)
        if sizes:
            values = [points[(label, n)] for n in sizes]
            # the same colour as its pooled row: federated a hollow square, the federation's reference a diamond
            marker, line = ("s", "--") if variant.startswith(FEDERATED) else ("D", ":") \
                if variant.startswith(REFERENCE) else ("o", "-")
            ax.errorbar(sizes, [statistics.mean(v) for v in values],
                        yerr=[statistics.stdev(v) if len(v) > 1 else 0.0 for v in values],
                        marker=marker, markerfacecolor="none" if marker == "s" else colour, linestyle=line,
                        capsize=3, color=colour, label=f"{label}: {guarantee}")
    sizes = sorted(n for (name, n) in points if name == "start")
    if sizes:
        ax.plot(sizes, [statistics.mean(points[("start", n)]) for n in sizes], linestyle="-.", marker="x", color="gray",
                label="pretrained start (public data only)")
    ax.set_xscale("log")
    ax.set_xticks(sorted({n for _, n in points}), [f"{n:,}" for n in sorted({n for _, n in points})])
    ax.minorticks_off()  # the log axis's own minor labels (6 x 10^2, ...) would crowd the sizes
    ax.set_xlabel("records per site (3 sites, pooled unless federated; 30 epochs per record)")
    ax.set_ylabel("PCKh@0.5 (mean ± std over seeds)")
    ax.set_title("Accuracy against data, epsilon 0.8 per record")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=1)  # one column: no label cut
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)


def render_study30_sweep(records: list[dict[str, Any]]) -> str:
    """benchmarks/results/study-30/: PCKh@0.5 against epsilon, centralized and federated."""
    records = _one_start(records)
    eps_values = sorted({r["cell"]["epsilon"] for r in records if r["cell"]["epsilon"] is not None})
    lines = ["| setting | method | " + " | ".join(f"eps {e:g}" for e in eps_values) + " |",
             "|---|---|" + "---|" * len(eps_values)]
    for setting in ("centralized", "federated"):
        for method in PRIVATE:
            cells = [_stat(_pckh(records, method=method, setting=setting, epsilon=e, variant="")) for e in eps_values]
            if any(c != "-" for c in cells):
                lines.append(f"| {setting} | {method} | " + " | ".join(cells) + " |")
    found = []
    for setting in ("centralized", "federated"):
        for e in eps_values:
            means = {m: _pckh(records, method=m, setting=setting, epsilon=e, variant="") for m in PRIVATE}
            if all(means.values()):
                mean = {m: statistics.mean(v) for m, v in means.items()}
                broken = [f"{a} < {b}" for a, b in (("fpdp", "fdp"), ("fdp", "dpsgd"), ("fpdp", "proj"),
                                                    ("proj", "dpsgd")) if mean[a] <= mean[b]]
                found.append(f"{setting} eps {e:g}: " + ("holds" if not broken else f"fails ({', '.join(broken)})"))
    ordering = ["", "The paper's ordering fpdp > fdp, proj > dpsgd (means, at the shared learning rate): "
                + "; ".join(found) + "."] if found else []
    return "\n".join(lines + ordering + ["", _study_provenance(records)])


def render_study30_recipe(records: list[dict[str, Any]]) -> str:
    """benchmarks/results/study-recordlevel/: the caption of the methods-against-epsilon figure for the site kits'
    record-level recipe, which the figure draws from these cells where they exist (and says so where not)."""
    kits = _kits_recipe(records)
    what = ("The star is the record-level recipe the site kits ship (proj under SGD with momentum 0.9 at 3e-3, "
            "each image clipped with its blurred copy, each site keeping its momentum between rounds), from the "
            "record-level study below")
    if not any(kits.values()):
        return (f"{what}: no cell of it has run at these settings, so the figure does not show it; it has no "
                "line against epsilon.")
    ran = " and ".join(f"{_stat(v)} {label}" for label, v in (("pooled", kits["centralized"]),
                                                              ("federated", kits["federated"])) if v)
    return (f"{what}: it ran at epsilon 0.8 only: {ran}. No cell of it ran at another epsilon, so it is a point, "
            "not a line.")


def render_study30_reference(records: list[dict[str, Any]]) -> str:
    """benchmarks/results/study-30/: the federation against its reachable reference and the pooled run."""
    records = _one_start(records)
    lines = ["| method | run | PCKh@0.5 | sigma | q | batch | noise per coordinate and step (sigma C / B) |"
             " epsilon spent |", "|---|---|---|---|---|---|---|---|"]
    gaps = []
    for method in ("dpsgd", "fpdp"):
        means = {}
        for setting, label in (("centralized", "pooled"), ("reference", "reference"), ("federated", "federation")):
            runs = _records(records, method=method, setting=setting, epsilon=0.8, variant="")
            values = [float(r["metrics"]["pckh"]["mean"]) for r in runs]
            means[setting] = statistics.mean(values) if values else None
            if not runs:
                lines.append(f"| {method} | {label} | - | | | | | |")
                continue
            m = runs[0]["metrics"]
            if setting == "federated":
                site = next(iter(m["sites"].values()))
                sites = len(m["sites"])
                sigma, q, batch = site["sigma"], site["sample_rate"], f"{sites} sites x {SITE_BATCH}"
                noise = sigma / SITE_BATCH / sites ** 0.5
            else:
                sigma, q = m["sigma"], m["sample_rate"]
                batch, noise = f"{round(q * WARD_RECORDS)}", m["sigma"] / round(q * WARD_RECORDS)
            lines.append(f"| {method} | {label} | {_stat(values)} | {sigma:.2f} | {q:.3f} | {batch} | {noise:.3f} | "
                         f"{statistics.mean(float(r['metrics']['epsilon']) for r in runs):.3f} |")
        if all(means.values()):
            gaps.append(f"{method}: the federation's own gap (federation - reference) "
                        f"{means['federated'] - means['reference']:+.2f}; the price of not trusting the server "
                        f"(reference - pooled) {means['reference'] - means['centralized']:+.2f}")
    return "\n".join(lines + [""] + [f"- {g}" for g in gaps] + ["", _study_provenance(records)])


STUDY_FACE = ("fedpose study --config configs/study-face.yaml --out runs/study-face --record "
              "benchmarks/results/study-face")
FACE_OFF, POSE_ONLY = "model.task_uncertainty=False", "model.face_tasks=[]"
# (label, metrics key, higher is better, as percentage points) of the face table; DPLH's reported pair
# (non-private, DP-SGD at eps 5, delta 1e-5) where the paper has one.
FACE_ROWS = (("detection accuracy", "detection_accuracy", True, (0.99, 0.90)),
             ("attribute accuracy", "attribute_accuracy", True, (0.90, 0.86)),
             ("landmark MSE", "landmark_mse", False, (0.245, 0.255)),
             ("visibility MSE", "visibility_mse", False, (0.20, 0.25)),
             ("pose MSE", "pose_mse", False, (0.24, 0.27)),
             ("landmark NME (inter-ocular)", "nme_interocular", False, None),
             ("face box IoU", "box_iou", True, None))
FACE_RUNS = (("nonprivate", None), ("dpsgd", 5.0), ("fpdp", 5.0), ("dpsgd", 0.8), ("fpdp", 0.8))


def _face_value(records: list[dict[str, Any]], method: str, epsilon: float | None, variant: str, key: str) -> Any:
    runs = _records(records, method=method, epsilon=epsilon, variant=variant)
    if not runs:
        return None
    if key == "pckh":
        return float(runs[0]["metrics"]["pckh"]["mean"])
    face = runs[0]["metrics"].get("face", {})
    if key.startswith("mae_"):
        return (face.get("pose_mae_degrees") or {}).get(key[4:])
    return face.get(key)


def _change(value: float | None, base: float | None, higher: bool) -> str:
    """A task's change from the non-private run: points for accuracies, percent for errors."""
    if value is None or base is None:
        return "-"
    if higher:
        return f"{100 * (value - base):+.1f} points"
    return f"{100 * (value - base) / base:+.0f} %" if base else "-"


def render_study_face(records: list[dict[str, Any]]) -> str:
    """benchmarks/results/study-face/ (fedpose study --record): DPLH's face tasks beside body pose on the ward."""
    for variant in ("", FACE_OFF, POSE_ONLY):  # each variant pretrains its own start
        _one_start(_records(records, variant=variant))
    heads = ["non-private"] + [f"{m} eps {e:g}" for m, e in FACE_RUNS[1:]]
    out = []
    for variant, title in (("", "Task-uncertainty weighting on (the default)"), (FACE_OFF, "Weighting off")):
        lines = [f"{title}:", "", "| task | " + " | ".join(heads) + " |", "|---" * (len(heads) + 1) + "|"]
        rows = [(label, key) for label, key, _, _ in FACE_ROWS] + [
            (f"head pose MAE, {a} (degrees)", f"mae_{a}") for a in ("yaw", "pitch", "roll")] + [
            ("body PCKh@0.5", "pckh")]
        for label, key in rows:
            values = [_face_value(records, m, e, variant, key) for m, e in FACE_RUNS]
            fmt = ".1f" if key.startswith("mae_") or key == "pckh" else (".4f" if "mse" in key else ".3f")
            lines.append(f"| {label} | " + " | ".join("-" if v is None else format(v, fmt) for v in values) + " |")
        out += lines + [""]
    lines = ["Change from the non-private run at eps 5 (accuracy in points, errors in percent), beside DPLH's "
             "DP-SGD on AFLW:", "", "| task | DPLH (DP-SGD) | dpsgd | fpdp |", "|---|---|---|---|"]
    smaller, larger = [], []
    for label, key, higher, dplh in FACE_ROWS:
        base = _face_value(records, "nonprivate", None, "", key)
        ours = [_face_value(records, m, 5.0, "", key) for m in ("dpsgd", "fpdp")]
        theirs = _change(dplh[1], dplh[0], higher) if dplh else "-"
        lines.append(f"| {label} | {theirs} | " + " | ".join(_change(v, base, higher) for v in ours) + " |")
        if dplh and base is not None and ours[1] is not None:
            ours_drop = (base - ours[1]) if higher else (ours[1] - base) / base
            their_drop = (dplh[0] - dplh[1]) if higher else (dplh[1] - dplh[0]) / dplh[0]
            (smaller if ours_drop < their_drop else larger).append(label)
    verdict = []
    if smaller or larger:
        verdict = ["", f"fpdp at eps 5 loses less than DPLH's DP-SGD on {len(smaller)} of {len(smaller) + len(larger)} "
                       "tasks" + (f"; more on {', '.join(larger)}" if larger else "") + ". The data differ (the ward's "
                       "faces are a few pixels wide; DPLH's are AFLW photographs), so compare the changes, not the "
                       "values."]
    out += lines + verdict + [""]
    lines = ["Body PCKh@0.5 with and without the face heads (weighting on):", "",
             "| run | with face heads | without |", "|---|---|---|"]
    for m, e in FACE_RUNS:
        both = [_face_value(records, m, e, v, "pckh") for v in ("", POSE_ONLY)]
        label = "non-private" if e is None else f"{m} eps {e:g}"
        lines.append(f"| {label} | " + " | ".join("-" if v is None else f"{v:.2f}" for v in both) + " |")
    starts = []
    for variant, label in (("", "with face heads"), (FACE_OFF, "with face heads, weighting off"),
                           (POSE_ONLY, "without face heads")):
        values = [r["metrics"].get("initial_pckh_mean") for r in _records(records, variant=variant)]
        values = [v for v in values if v is not None]
        if values:
            starts.append(f"{label} {values[0]:.2f}")
    if starts:
        lines += ["", "Body PCKh@0.5 of the public pretrained start each run began from: " + ", ".join(starts) + "."]
    out += lines + ["", "One seed each; centralized, 30 epochs per record.", "",
                    _study_provenance(records, STUDY_FACE)]
    return "\n".join(out)


def _weights_label(path: str) -> str:
    folder = Path(path).parent.name  # pretrained, or <method>-<optimizer>-<lr>-<seed> of a --train run
    parts = folder.split("-")
    if len(parts) == 4:
        return f"{parts[0]} after 30 epochs ({parts[1]}, lr {parts[2]})"
    return "the public-pretrained start" if folder == "pretrained" else folder


def render_fpdp_terms(data: dict[str, Any]) -> str:
    """benchmarks/results/fpdp_terms.json (benchmarks/fpdp_terms.py): what each term of an fpdp step carries."""
    lines = ["| records per site | sigma | private signal | in V | in V, beyond the public term | noise in V | "
             "public term | cosine, in V with public |", "|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        m, s = r["mean"], r["std"]
        cells = [f"{m[k]:.3f} ± {s[k]:.3f}" for k in ("private", "private_in_v", "private_in_v_beyond_public",
                                                      "noise_in_v", "public")]
        lines.append(f"| {r['per_site']:,} | {r['sigma']:.2f} ({r['steps']} steps) | " + " | ".join(cells) +
                     f" | {m['cos_private_in_v_public']:.2f} |")
    first = data["rows"][0]
    lines += ["", f"At the public start of each ward; mean ± std over {data['batches']} batches of "
                  f"{first['batch_size']} records; C = {first['clip']:g}, k = {first['k']}, {first['params']:,} "
                  f"weights; sigma is the accountant's for epsilon 0.8 over the run's steps.", "",
              _provenance(data.get("provenance"))]
    return "\n".join(lines)


def render_proj(data: dict[str, Any]) -> str:
    """benchmarks/results/proj_diagnosis.json (benchmarks/proj_diagnosis.py): why proj ends below dpsgd."""
    lines = ["| weights | V keeps of the signal g* | V keeps of the noise | signal / noise of a step, dpsgd | "
             "the same, proj |", "|---|---|---|---|---|"]
    for p in data["points"]:
        lines.append(f"| {_weights_label(p['weights'])} | {100 * p['signal_kept']:.1f} % | "
                     f"{100 * p['noise_kept']:.4f} % | {p['snr_step']['dpsgd']:.1e} | {p['snr_step']['proj']:.2f} |")
    lines += ["", f"After {data['steps']} noisy steps at these weights: the cosine of each update u with g*, and "
              "the training loss change of one step along u.", "",
              "| weights | update | cos(u, g*) | loss change (learning rate) |", "|---|---|---|---|"]
    for p in data["points"]:
        for i, (name, o) in enumerate(p["optimizers"].items()):
            change = ", ".join(f"{d:+.4f} ({lr})" for lr, d in o["loss_change"].items())
            where = _weights_label(p["weights"]) if i == 0 else ""
            lines.append(f"| {where} | {name} | {o['cosine_mean_last10']:+.3f} | {change} |")
    if data.get("training"):
        runs = {(r["optimizer"], r["lr"], r["method"]): r for r in data["training"]}
        starts = {f"{r['start']:.2f}" for r in data["training"] if "start" in r}
        lines += ["", f"Centralized, 30 epochs, epsilon 0.8, seed 1; PCKh@0.5 after training (the start: "
                      f"{', '.join(sorted(starts))}).", "", "| optimizer | learning rate | dpsgd | proj |",
                  "|---|---|---|---|"]
        for optimizer, lr in sorted({(o, lr) for o, lr, _ in runs}, key=lambda t: (t[0], -t[1])):
            cells = []
            for method in ("dpsgd", "proj"):
                r = runs.get((optimizer, lr, method))
                cells.append("-" if r is None else f"broke down ({r['failed'].split(' (')[0]})" if "failed" in r
                             else f"{r['pckh']:.2f}")
            name = "Adam" if optimizer == "adam" else "SGD, momentum 0.9"
            lines.append(f"| {name} | {lr:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines + ["", _provenance(data)])


def render_edge_latency(data: dict[str, Any]) -> str:
    """benchmarks/results/edge_latency.json (benchmarks/edge_latency.py): eager against onnxruntime, the pipeline."""
    lines = ["| model | input | backend | p50 ms | p95 ms | against eager |", "|---|---|---|---|---|---|"]
    for r in data["rows"]:
        lines.append(f"| {r['model']} | {r['input'][0]}x{r['input'][1]} | {r['backend']} | {r['p50_ms']:.2f} | "
                     f"{r['p95_ms']:.2f} | {r['speedup']:.2f}x |")
    speedups = "; ".join(f"{name}: **{statistics.median(r):.2f}x** ({min(r):.2f}-{max(r):.2f})"
                         for name, r in data["ort_speedup_rounds"].items())
    lines += ["", f"onnxruntime fp32 against eager, median of rounds timed side by side (range): {speedups}.", "",
              "| camera loop | frames per second | onnxruntime alone | share (rounds) |", "|---|---|---|---|"]
    for p in data["pipelines"]:
        rounds = ", ".join(f"{r:.2f}" for r in p["share_runs"])
        lines.append(f"| {p['model']} {p['input'][0]}x{p['input'][1]} | {p['fps']:.0f} | {p['ort_bound_fps']:.0f} | "
                     f"**{p['share_of_bound']:.2f}** ({rounds}) |")
    return "\n".join(lines + ["", _provenance(data)])


_STEP_LABELS = {
    "nonprivate": "non-private",
    "nonprivate-2x": "non-private over private + psi images",
    "dpsgd": "DP-SGD (book-keeping clipping)",
    "dpsgd-generic": "DP-SGD, generic per-sample path",
    "fpdp": "FP-DP",
    "opacus": "Opacus (hooks), same model",
}


def render_dp_step(data: dict[str, Any]) -> str:
    """benchmarks/results/dp_step.json (benchmarks/dp_step.py): a private step against a non-private one."""
    h, w = data["input"]
    variants = list(data["variants"])
    rows = [f"One optimizer step, batch {data['batch']} at {h}x{w}, finetune parameters; median of "
            f"{data['repeats']} interleaved rounds, with the min-max of the per-round ratio. The generic path and "
            "Opacus run in a process of their own, against that process's non-private step.", "",
            "| step | " + " | ".join(f"{v}: ms | × non-private" for v in variants) + " |",
            "|---|" + "---|---|" * len(variants)]
    for kind, label in _STEP_LABELS.items():
        if not all(kind in data["variants"][v]["ms"] for v in variants):
            continue
        cells = []
        for v in variants:
            ms, r = data["variants"][v]["ms"][kind], data["variants"][v]["ratio"][kind]
            cells.append(f"{ms['median']:.1f} | {r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})")
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    fpdp = ", ".join(f"{v} {data['variants'][v]['ratio']['fpdp-vs-2x']['median']:.2f}" for v in variants)
    rows += ["", f"FP-DP against a non-private step over the same images (the private batch and the psi batch): "
             f"{fpdp}.", "",
             "Peak memory above the model and the batch (MB), DP-SGD with 16 per-sample gradients at a time:", "",
             "| realised batch | " + " | ".join(variants) + " |", "|---|" + "---|" * len(variants)]
    for key in data["variants"][variants[0]]["peak_mb"]:
        label = key.replace("dpsgd@", "DP-SGD, ").replace("nonprivate@", "non-private, ")
        rows.append(f"| {label} | " + " | ".join(f"{data['variants'][v]['peak_mb'][key]:.0f}" for v in variants) + " |")
    if "basis" in data:
        b = data["basis"]
        processes = b.get("process_medians")
        across = "" if not processes else (f"; the medians of {len(processes)} processes of its own, "
                                            f"{min(processes):.2f}-{max(processes):.2f} s")
        rows += ["", f"Projection basis (m = {b['m']} public samples, k = {b['k']}, {b['parameters']:,} tinyvit-5m "
                 f"finetune parameters): {b['seconds']['median']:.2f} s (min {b['seconds']['min']:.2f}, max "
                 f"{b['seconds']['max']:.2f}{across})."]
    return "\n".join(rows + ["", _provenance(data.get("provenance"))])


def render_dp_step_cuda(data: dict[str, Any]) -> str:
    """benchmarks/results/dp_step_cuda.json (benchmarks/dp_step.py --device cuda): the same steps on a GPU."""
    h, w = data["input"]
    rows = [f"GPU-measured on one {data['device']}: one optimizer step, batch {data['batch']} at {h}x{w} (the "
            f"paper's setting), finetune parameters, per-sample gradients {data['chunk']} at a time; median of "
            f"{data['repeats']} interleaved rounds, timed between CUDA synchronisations, with the min-max of the "
            "per-round ratio. Peak memory is torch's allocator peak above what the model and the batch hold.", "",
            "| step | ms | × non-private | peak MB |", "|---|---|---|---|"]
    for variant, v in data["variants"].items():
        for kind, label in _STEP_LABELS.items():
            if kind in v["ms"]:
                r = v["ratio"][kind]
                rows.append(f"| {variant}, {label} | {v['ms'][kind]['median']:.1f} | {r['median']:.2f} "
                            f"({r['min']:.2f}-{r['max']:.2f}) | {v['peak_mb'][kind]:.0f} |")
        r = v["ratio"]["fpdp-vs-2x"]
        rows += ["", f"{variant}: FP-DP against a non-private step over the same images: {r['median']:.2f} "
                 f"({r['min']:.2f}-{r['max']:.2f})."]
    b = data["basis"]
    rows += ["", f"Projection basis (m = {b['m']}, k = {b['k']}, {b['parameters']:,} tinyvit-5m finetune parameters "
             f"at {h}x{w}): {b['seconds']['median']:.3f} s (min {b['seconds']['min']:.3f}, max "
             f"{b['seconds']['max']:.3f})."]
    return "\n".join(rows + ["", _provenance(data.get("provenance"))])


def render_dp_step_chunks(data: dict[str, Any]) -> str:
    """benchmarks/results/dp_step_chunks[_cuda].json (benchmarks/dp_step.py --chunks): the private step with chunks
    sized from the free memory beside chunks of a fixed size."""
    h, w = data["input"]
    where = f"GPU-measured on one {data['device']}" if "device" in data else "On this CPU"
    rows = [f"{where}: one optimizer step, batch {data['batch']} at {h}x{w}, finetune parameters, every chunk padded "
            f"as a site runs it; median of {data['repeats']} interleaved rounds, with the min-max of the per-round "
            "ratio.", "", "| step | " + " | ".join(f"{v}: ms | × non-private" for v in data["variants"]) + " |",
            "|---|" + "---|---|" * len(data["variants"])]
    first = next(iter(data["variants"].values()))
    fixed = first["chunk"]["fixed"]
    labels = {"nonprivate": "non-private", "nonprivate-2x": "non-private over private + psi images",
              f"dpsgd@{fixed}": f"DP-SGD, chunks of {fixed}", "dpsgd@auto": "DP-SGD, chunk sized from free memory",
              f"fpdp@{fixed}": f"FP-DP, chunks of {fixed}", "fpdp@auto": "FP-DP, chunk sized from free memory"}
    for kind, label in labels.items():
        cells = []
        for v in data["variants"].values():
            ms, r = v["ms"][kind], v["ratio"][kind]
            cells.append(f"{ms['median']:.1f} | {r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})")
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    rows.append("")
    for name, v in data["variants"].items():
        c, r = v["chunk"], v["ratio"]
        said = ", ".join(f"{label} {r[key]['median']:.2f} ({r[key]['min']:.2f}-{r[key]['max']:.2f})"
                         for label, key in (("DP-SGD", f"dpsgd@auto-vs-{fixed}"), ("FP-DP", f"fpdp@auto-vs-{fixed}")))
        rows.append(f"{name}: the chunk sized from {c['share']:.0%} of the free memory ran {c['size']} rows (cap "
                    f"{c['cap']}; its measured peak {c['peak_mb']:.0f} MB of {c['budget_mb']:.0f} MB allowed; chosen "
                    f"in {c['seconds']:.2f} s, once a run); the sized step's time over the fixed one's: {said}.")
        rows.append("")
    return "\n".join(rows + [_provenance(data.get("provenance"))])


def render_deploy_round(data: dict[str, Any]) -> str:
    """benchmarks/results/deploy_round.json (benchmarks/deploy_round.py): a round beyond the sites' own work."""
    h, w = data["input"]
    modes = data["modes"]
    runs = "; ".join(f"{name}: `fedpose site start {m['flags']}`" if m.get("flags")
                     else f"{name}: `fedpose site start` as it is" for name, m in modes.items())
    rows = [f"{data['sites']} sites on 127.0.0.1, {h}x{w} inputs, {data['local_steps']} local steps a round ({runs}). "
            "Server: the time from sending the round's train messages to the "
            "last reply; site: what the slower site spent on the round itself (local training and the basis); the "
            "rest is the engine, the message processes and the transfer.", "",
            "| round | " + " | ".join(f"{m}: server s | site s | beyond s" for m in modes) + " |",
            "|---|" + "---|---|---|" * len(modes)]
    for i, r in enumerate(next(iter(modes.values()))["rounds"]):
        cells = []
        for m in modes.values():
            x = m["rounds"][i]
            cells.append(f"{x['server_train_s']:.2f} | {x['site_work_s']:.2f} | {x['overhead_s']:.2f}")
        rows.append(f"| {r['round']} | " + " | ".join(cells) + " |")
    rows += ["", "Beyond the sites' own work, a round: " + "; ".join(
        f"{name} {m['overhead_s']['median']:.2f} s (median; {m['overhead_s']['min']:.2f}-{m['overhead_s']['max']:.2f})"
        for name, m in modes.items()) + ".", "",
        "| message | " + " | ".join(f"{m}: process start-up s | handler s" for m in modes) + " |",
        "|---|" + "---|---|" * len(modes)]
    for kind in next(iter(modes.values()))["messages"]:
        cells = [f"{m['messages'][kind]['startup_s']:.2f} | {m['messages'][kind]['handler_s']:.2f}"
                 for m in modes.values()]
        rows.append(f"| {kind} | " + " | ".join(cells) + " |")
    return "\n".join(rows + ["", "Medians over the messages of both sites; the handler includes the round's training "
                             "and basis.", "", _provenance(data.get("provenance"))])


def load_sources(source: str | tuple[str, ...]) -> Any:
    """A block's or a figure's artefact, or the tuple of its artefacts where it is drawn from several."""
    return tuple(load_artefact(name) for name in source) if isinstance(source, tuple) else load_artefact(source)


def load_artefact(name: str) -> Any:
    """A measurement's file under benchmarks/results/: JSON, CSV as a list of rows, a folder as its JSON files."""
    if (RESULTS / name).is_dir():
        return [json.loads(p.read_text()) for p in sorted((RESULTS / name).glob("*.json"))]
    text = (RESULTS / name).read_text()
    return list(csv.DictReader(text.splitlines())) if name.endswith(".csv") else json.loads(text)


# Block name -> (the artefact under benchmarks/results/ it is rendered from, or a tuple of them, the renderer).
RENDERERS: dict[str, tuple[str | tuple[str, ...], Callable[[Any], str]]] = {
    "summary": (("study-recordlevel", "study-30", "study-scale"), render_summary),
    "main": ("main.json", render_main),
    "main-brief": ("main.json", render_main_brief),
    "start-by-cpu": ("start_by_cpu.json", render_start_by_cpu),
    "pretraining": ("pretraining.json", render_pretraining),
    "audits": ("privacy_attacks.json", render_audits),
    "mia": ("privacy_attacks.json", render_mia),
    "reid": ("privacy_attacks.json", render_reid),
    "reconstruction": ("feature_dp_reconstruction.json", render_reconstruction),
    "study": ("study/results.csv", render_study),
    "study30-methods": ("study-30", render_study30_methods),
    "study30-sweep": ("study-30", render_study30_sweep),
    "study30-reference": ("study-30", render_study30_reference),
    "study30-recipe": ("study-recordlevel", render_study30_recipe),
    "study-face": ("study-face", render_study_face),
    "recordlevel": ("study-recordlevel", render_recordlevel),
    "recordlevel-proxy": ("study-recordlevel-proxy", render_recordlevel_proxy),
    "recordlevel-proxy-start": ("study-recordlevel-proxy", render_recordlevel_proxy_start),
    "recordlevel-start": ("study-recordlevel", render_recordlevel_start),
    "recordlevel-brief": ("study-recordlevel", render_recordlevel_brief),
    "records-brief": (("study-scale", "study-recordlevel-dp", "study-recordlevel-eps"), render_records_brief),
    "scale": ("study-scale", render_scale),
    "recordlevel-dp": ("study-recordlevel-dp", render_recordlevel_dp),
    "recordlevel-dp-proxy": ("study-recordlevel-dp-proxy", render_recordlevel_dp_proxy),
    "recordlevel-eps": ("study-recordlevel-eps", render_recordlevel_eps),
    "proj": ("proj_diagnosis.json", render_proj),
    "fpdp-terms": ("fpdp_terms.json", render_fpdp_terms),
    "dp-step": ("dp_step.json", render_dp_step),
    "dp-step-cuda": ("dp_step_cuda.json", render_dp_step_cuda),
    "dp-step-chunks": ("dp_step_chunks.json", render_dp_step_chunks),
    "batch-assembly": ("batch_assembly.json", render_batch_assembly),
    "batch-assembly-gpu": ("batch_assembly_gpu.json", render_batch_assembly),
    "paper-gpu": ("study-paper-gpu", render_paper_gpu),
    "edge-latency": ("edge_latency.json", render_edge_latency),
    "deploy-round": ("deploy_round.json", render_deploy_round),
}

def figure_study30(artefacts: tuple[list[dict[str, Any]], list[dict[str, Any]]], path: Path) -> None:
    """PCKh@0.5 against epsilon, centralized and federated side by side (the paper's Fig. 2 on the ward), with the
    site kits' record-level recipe from the record-level study where its cells ran (a star per epsilon)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records, recordlevel = artefacts
    _one_start([*records, *_own_ward(recordlevel)])  # the star and the lines from one start
    colours = {"dpsgd": "tab:red", "proj": "tab:orange", "fdp": "tab:purple", "fpdp": "tab:blue"}
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    kits = _kits_recipe(recordlevel)
    for ax, setting in zip(axes, ("centralized", "federated")):
        if kits[setting]:
            values = kits[setting]
            ax.errorbar([0.8], [statistics.mean(values)], yerr=[statistics.stdev(values) if len(values) > 1 else 0.0],
                        marker="*", markersize=14, linestyle="none", capsize=3, color="tab:green",
                        label="proj, the site kits' record-level recipe (ran at eps 0.8 only)")
        for method, colour in colours.items():
            eps = sorted({r["cell"]["epsilon"] for r in _records(records, method=method, setting=setting, variant="")})
            values = [_pckh(records, method=method, setting=setting, epsilon=e, variant="") for e in eps]
            if eps:
                ax.errorbar(eps, [statistics.mean(v) for v in values],
                            yerr=[statistics.stdev(v) if len(v) > 1 else 0.0 for v in values], marker="o",
                            capsize=3, color=colour, label=method)
        for method, style, label in (("nonprivate", "--", "nonprivate (centralized)"),
                                     ("pretrained", "-.", "pretrained start")):
            if _pckh(records, method=method):
                ax.axhline(statistics.mean(_pckh(records, method=method)), color="gray", linestyle=style, label=label)
        ax.set_title(f"{setting}: full, C = 1, 30 epochs per record")
        ax.set_xlabel("epsilon (delta 1e-5)")
        ax.set_xlim(0.1, 0.9)
        ax.set_xticks([0.2, 0.4, 0.6, 0.8])
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("PCKh@0.5 mean (seeds: mean ± std)")
    handles = {label: handle for ax in axes for handle, label in zip(*ax.get_legend_handles_labels())}
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=4, fontsize=8)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)


# Figure under docs/ -> (the artefact it is drawn from, the function drawing it); --check only checks they exist.
FIGURES: dict[str, tuple[str | tuple[str, ...], Callable[[Any, Path], None]]] = {
    "docs/img/study-30-pckh-vs-eps.png": (("study-30", "study-recordlevel"), figure_study30),
    "docs/img/study-scale.png": ("study-scale", figure_scale),
    "docs/img/recordlevel-eps.png": ("study-recordlevel-eps", figure_recordlevel_eps),
}

BLOCK = re.compile(r"(<!-- rendered:(?P<name>[a-z0-9-]+) -->\n)(?P<body>.*?)(<!-- /rendered:(?P=name) -->)", re.S)


def render_text(text: str, where: str) -> str:
    def one(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in RENDERERS:
            raise SystemExit(f"{where}: unknown rendered block {name!r} (known: {', '.join(RENDERERS)})")
        artefact, render = RENDERERS[name]
        return match.group(1) + render(load_sources(artefact)).rstrip() + "\n" + match.group(4)

    return BLOCK.sub(one, text)


def pages() -> list[Path]:
    out: list[Path] = []
    for p in PAGES:
        out.extend(sorted(p.rglob("*.md")) if p.is_dir() else [p])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a page is not what its artefacts render")
    args = parser.parse_args(argv)
    stale = []
    for page in pages():
        text = page.read_text()
        new = render_text(text, str(page.relative_to(REPO)))
        if new != text:
            stale.append(page.relative_to(REPO))
            if not args.check:
                page.write_text(new)
                print(f"rendered {page.relative_to(REPO)}")
    for name, (artefact, draw) in FIGURES.items():
        if not args.check:
            draw(load_sources(artefact), REPO / name)
        elif not (REPO / name).is_file():
            stale.append(Path(name))
    if args.check and stale:
        print("not current (run python tools/render_results.py): " + ", ".join(map(str, stale)), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
