"""What a study writes: results.csv, tables.md (the paper's layout), gap recovered, the figures.

Input is the rows of ``fedpose.shared.experiments.study.collect`` (one per cell and seed); every
function here is post-processing of finished cells, so a partly finished
study reports what it has.
"""

from __future__ import annotations

import csv
import math
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fedpose.shared.experiments.study import COLUMNS, GROUPS
from fedpose.shared.configuration.methods import PRIVATE

METHOD_ORDER = ("pretrained", "psi-only", "nonprivate", *PRIVATE)
SETTING_ORDER = ("centralized", "federated", "reference")
SETTING_TITLES = {"centralized": "centralized", "federated": "federated",
                  "reference": "reference (pooled, the federation's batch and noise)"}
HEADERS = ("Head", "Shoulder", "Elbow", "Wrist", "Hip", "Knee", "Ankle", "Mean", "Mean@0.1")
VALUE_KEYS = (*GROUPS, "mean", "mean@0.1")


def write_report(out: str | Path, rows: list[dict[str, Any]], cells: list[Any], study: Any) -> list[Path]:
    """Every output of a study into ``out``; returns the paths written."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = [write_csv(out / "results.csv", rows, COLUMNS)]
    (out / "tables.md").write_text(tables_markdown(rows))
    written.append(out / "tables.md")
    gaps = gap_rows(rows)
    gap_columns = ("setting", "strategy", "clip", "epsilon", "nonprivate", "dpsgd", "proj", "fdp", "fpdp",
                   "gap_recovered", "reference", "ordering")
    written.append(write_csv(out / "gap_recovered.csv", gaps, gap_columns))
    (out / "gap_recovered.md").write_text(gap_markdown(gaps))
    written.append(out / "gap_recovered.md")
    written.extend(eps_figures(out, rows))
    qualitative = qualitative_figure(out / "qualitative.png", out, cells, study)
    if qualitative is not None:
        written.append(qualitative)
    return written


def write_csv(path: Path, rows: Iterable[dict[str, Any]], columns: Iterable[str]) -> Path:
    columns = list(columns)
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({c: _csv_value(row.get(c)) for c in columns})
    return path


def _csv_value(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4f}" if math.isfinite(value) else ""
    return value


# ---------------------------------------------------------------------------
# aggregation over seeds
# ---------------------------------------------------------------------------


def _point(row: dict[str, Any]) -> tuple:
    return (row["setting"], row["method"], row["strategy"], row["epsilon"], row["clip"], row["ablation"],
            row.get("variant", ""))


def mean_std(rows: list[dict[str, Any]], key: str) -> tuple[float, float, int]:
    values = [float(r[key]) for r in rows if r.get(key) is not None]
    if not values:
        return math.nan, math.nan, 0
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0, len(values)


def by_point(rows: list[dict[str, Any]]) -> dict[tuple, list[dict[str, Any]]]:
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(_point(row), []).append(row)
    return groups


def _fmt(mean: float, std: float, n: int) -> str:
    if n == 0 or math.isnan(mean):
        return "-"
    return f"{mean:.2f} ± {std:.2f}" if n > 1 else f"{mean:.2f}"


def _table(title: str, labelled: list[tuple[str, list[dict[str, Any]]]], *, extra: str | None = None) -> str:
    head = "| Method | " + " | ".join(HEADERS) + " | eps spent | seeds |"
    lines = [f"### {title}", "", head, "|" + "---|" * (len(HEADERS) + 3)]
    for label, group in labelled:
        cells = [_fmt(*mean_std(group, k)) for k in VALUE_KEYS]
        eps, _, n_eps = mean_std(group, "eps_spent")
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {f'{eps:.3f}' if n_eps else '-'} | {len(group)} |")
    if extra:
        lines += ["", extra]
    return "\n".join(lines) + "\n"


def tables_markdown(rows: list[dict[str, Any]]) -> str:
    """The paper's table (Head ... Ankle, Mean, Mean@0.1) per setting, strategy, C and eps; mean ± std over seeds."""
    grid = [r for r in rows if not r["ablation"]]
    groups = by_point(grid)
    parts = ["# Privacy-utility study", "",
             "PCKh@0.5 per joint group on the validation split (Mean@0.1: PCKh@0.1 mean); mean ± std over seeds.",
             ""]
    strategies = sorted({r["strategy"] for r in grid if r["strategy"]})
    baseline_rows = []
    pretrained = [g for p, g in groups.items() if p[1] == "pretrained"]
    if pretrained:
        baseline_rows.append(("pretrained (public only, no training)", pretrained[0]))
    for strategy in strategies:
        for method, label in (("nonprivate", "nonprivate (raw images)"), ("psi-only", "psi(x) only")):
            for point, group in groups.items():
                if point[1] == method and point[2] == strategy:
                    baseline_rows.append((f"{label}, {strategy}", group))
    if baseline_rows:
        parts.append(_table("Non-private baselines (centralized)", baseline_rows))
    for setting in SETTING_ORDER:
        points = sorted({(p[2], p[4], p[3]) for p in groups if p[0] == setting and p[1] in PRIVATE},
                        key=lambda t: (t[0], t[1], t[2]))
        for strategy, clip, eps in points:
            labelled = []
            reference = groups.get(("centralized", "nonprivate", strategy, None, None, "", ""))
            if reference:
                labelled.append(("nonprivate" if setting == "centralized" else "nonprivate (centralized)",
                                 reference))
            for method in PRIVATE:
                group = groups.get((setting, method, strategy, eps, clip, "", ""))
                if group:
                    labelled.append((method, group))
            labelled += [(f"{p[1]} ({p[6]})", g) for p, g in sorted(groups.items(), key=lambda kv: str(kv[0]))
                         if p[6] and p[:6] == (setting, p[1], strategy, eps, clip, "")]  # a grid's own overrides
            parts.append(_table(f"{SETTING_TITLES[setting]}, {strategy}, C = {clip}, eps = {eps}", labelled))
    parts.append(summary_markdown(grid))
    ablations = [r for r in rows if r["ablation"]]
    if ablations:
        parts.append(ablation_markdown(ablations))
    return "\n".join(parts)


def summary_markdown(rows: list[dict[str, Any]]) -> str:
    """PCKh@0.5 mean against eps, one row per method (the figures as a table)."""
    groups = by_point(rows)
    out = ["## PCKh@0.5 mean against eps", ""]
    panels = sorted({(p[0], p[2], p[4]) for p in groups if p[1] in PRIVATE}, key=str)
    for setting, strategy, clip in panels:
        eps_values = sorted({p[3] for p in groups if p[0] == setting and p[2] == strategy and p[4] == clip
                             and p[3] is not None})
        out += [f"### {setting}, {strategy}, C = {clip}", "",
                "| method | " + " | ".join(f"eps {e:g}" for e in eps_values) + " |",
                "|---|" + "---|" * len(eps_values)]
        for method in PRIVATE:
            cells = [_fmt(*mean_std(groups.get((setting, method, strategy, e, clip, "", ""), []), "mean"))
                     for e in eps_values]
            if any(c != "-" for c in cells):
                out.append(f"| {method} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def ablation_markdown(rows: list[dict[str, Any]]) -> str:
    out = ["## Ablations (centralized)", ""]
    for name in dict.fromkeys(r["ablation"] for r in rows):
        subset = [r for r in rows if r["ablation"] == name]
        labelled = []
        for point, group in by_point(subset).items():
            labelled.append((f"{point[1]}, {point[6]}", group))
        parts = _table(f"ablation: {name}", labelled)
        out.append(parts)
    return "\n".join(out)


# ---------------------------------------------------------------------------
# gap recovered
# ---------------------------------------------------------------------------


def gap_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """(fpdp - dpsgd) / (nonprivate - dpsgd) per setting, strategy, C and eps (means over seeds).

    A federation never trains non-privately (the site policy refuses it), so
    its reference is the centralized nonprivate run of the same strategy; the
    ``reference`` column says which one was used. ``ordering`` checks the
    paper's claim fpdp > proj, fdp > dpsgd.
    """
    groups = by_point([r for r in rows if not r["ablation"]])

    def mean_of(setting: str, method: str, strategy: str, eps: Any, clip: Any) -> float:
        return mean_std(groups.get((setting, method, strategy, eps, clip, "", ""), []), "mean")[0]

    out = []
    points = sorted({(p[0], p[2], p[4], p[3]) for p in groups if p[1] in PRIVATE}, key=str)
    for setting, strategy, clip, eps in points:
        ref_setting = setting
        nonprivate = mean_of(setting, "nonprivate", strategy, None, None)
        if math.isnan(nonprivate) and setting != "centralized":
            ref_setting = "centralized"
            nonprivate = mean_of("centralized", "nonprivate", strategy, None, None)
        values = {m: mean_of(setting, m, strategy, eps, clip) for m in PRIVATE}
        denominator = nonprivate - values["dpsgd"]
        gap = (values["fpdp"] - values["dpsgd"]) / denominator if denominator and not math.isnan(denominator) \
            else math.nan
        missing = [m for m in ("proj", "fdp") if math.isnan(values[m])]
        if math.isnan(values["fpdp"]) or math.isnan(values["dpsgd"]):
            ordering = "n/a (fpdp or dpsgd not run)"
        elif missing:
            ordering = f"n/a ({', '.join(missing)} not run)"
        else:
            holds = all(values["fpdp"] > values[m] > values["dpsgd"] for m in ("proj", "fdp"))
            ordering = "holds" if holds else "fails"
        out.append({"setting": setting, "strategy": strategy, "clip": clip, "epsilon": eps,
                    "nonprivate": nonprivate, **values, "gap_recovered": gap,
                    "reference": f"{ref_setting} nonprivate", "ordering": ordering})
    return out


def gap_markdown(gaps: list[dict[str, Any]]) -> str:
    lines = ["# Gap recovered: (fpdp - dpsgd) / (nonprivate - dpsgd)", "",
             "PCKh@0.5 means over seeds. Federated points use the centralized nonprivate run as reference (a "
             "federation never trains non-privately). Ordering: fpdp > proj, fdp > dpsgd.", "",
             "| setting | strategy | C | eps | nonprivate | dpsgd | proj | fdp | fpdp | gap recovered | reference | "
             "ordering |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for g in gaps:
        nums = [g[k] for k in ("nonprivate", "dpsgd", "proj", "fdp", "fpdp")]
        lines.append(f"| {g['setting']} | {g['strategy']} | {g['clip']:g} | {g['epsilon']:g} | "
                     + " | ".join("-" if math.isnan(v) else f"{v:.2f}" for v in nums)
                     + f" | {'-' if math.isnan(g['gap_recovered']) else format(g['gap_recovered'], '.2f')} | "
                       f"{g['reference']} | {g['ordering']} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------
# figures
# ---------------------------------------------------------------------------

_COLOURS = {"dpsgd": "tab:red", "proj": "tab:orange", "fdp": "tab:purple", "fpdp": "tab:blue",
            "nonprivate": "black", "psi-only": "tab:green", "pretrained": "tab:gray"}


def eps_figures(out: Path, rows: list[dict[str, Any]]) -> list[Path]:
    """pckh_vs_eps_<strategy>_C<clip>.png: PCKh vs eps, one line per method, centralized | federated side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = [r for r in rows if not r["ablation"]]
    groups = by_point(grid)
    drawn = [p for p in groups if p[1] in PRIVATE and not p[6]]  # a variant is a recipe, not a point of the curve
    written = []
    for strategy, clip in sorted({(p[2], p[4]) for p in drawn}, key=str):
        settings = [s for s in SETTING_ORDER if any(p[0] == s and p[2] == strategy and p[4] == clip for p in drawn)]
        fig, axes = plt.subplots(1, len(settings), figsize=(5.2 * len(settings), 4), sharey=True, squeeze=False)
        for ax, setting in zip(axes[0], settings):
            for method in PRIVATE:
                pts = sorted((p[3], groups[p]) for p in drawn
                             if p[0] == setting and p[1] == method and p[2] == strategy and p[4] == clip)
                if not pts:
                    continue
                xs = [e for e, _ in pts]
                stats = [mean_std(g, "mean") for _, g in pts]
                ax.errorbar(xs, [s[0] for s in stats], yerr=[s[1] for s in stats], marker="o", capsize=3,
                            color=_COLOURS[method], label=method)
            for method, style in (("nonprivate", "--"), ("psi-only", ":")):
                group = groups.get(("centralized", method, strategy, None, None, "", ""))
                if group:
                    label = method if setting == "centralized" else f"{method} (centralized)"
                    ax.axhline(mean_std(group, "mean")[0], color=_COLOURS[method], linestyle=style, label=label)
            pre = [g for p, g in groups.items() if p[1] == "pretrained"]
            if pre and strategy != "scratch":
                ax.axhline(mean_std(pre[0], "mean")[0], color=_COLOURS["pretrained"], linestyle="-.",
                           label="pretrained start")
            ax.set_title(f"{setting}: {strategy}, C = {clip:g}")
            ax.set_xlabel("epsilon")
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("PCKh@0.5 mean")
        axes[0][-1].legend(fontsize=8, loc="best")
        fig.tight_layout()
        path = out / f"pckh_vs_eps_{strategy}_C{clip:g}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def qualitative_figure(path: Path, out: Path, cells: list[Any], study: Any, *, images: int = 4) -> Path | None:
    """Predicted skeletons (red) over ground truth (green) on the first validation images, one row per method.

    Methods at the study's largest eps, the base strategy and clip (else the
    first ones run), centralized, lowest seed; the pretrained baseline first.
    """
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from PIL import Image

    from fedpose.shared.data.joints import SKELETON
    from fedpose.shared.experiments.study import cell_dir
    from fedpose.shared.model.posenet import load_checkpoint
    from fedpose.shared.training.runs import load_records
    from fedpose.shared.metrics.evaluation import evaluate

    def weights_of(cell: Any) -> Path:
        where = cell_dir(out, cell)
        if cell.kind == "pretrained" and (where / "metrics.json").is_file():
            return Path(json.loads((where / "metrics.json").read_text())["checkpoint"])
        return where / "model.pt"

    # Cells restored from a study's record have no weights here: they are left out of the figure.
    finished = [c for c in cells if not c.ablation and c.setting == "centralized" and weights_of(c).is_file()]
    if not finished:
        return None
    strategy = study.base.train.strategy
    if not any(c.strategy == strategy for c in finished if c.strategy):
        strategy = next(c.strategy for c in finished if c.strategy)
    chosen = []
    for method in METHOD_ORDER:
        candidates = [c for c in finished if c.method == method and (c.strategy in (strategy, None))]
        private = [c for c in candidates if c.epsilon is not None]
        if private:
            top = max(c.epsilon for c in private)
            clip = study.base.privacy.clip_norm if any(c.clip == study.base.privacy.clip_norm for c in private) \
                else private[0].clip
            candidates = [c for c in private if c.epsilon == top and c.clip == clip]
        if candidates:
            chosen.append(min(candidates, key=lambda c: c.seed if c.seed is not None else -1))
    cfg = study.base
    val = load_records(Path(cfg.data.root), cfg.data.val_split)[:images]
    fig, axes = plt.subplots(len(chosen), len(val), figsize=(1.9 * len(val), 2.0 * len(chosen)), squeeze=False)
    for i, cell in enumerate(chosen):
        model, _ = load_checkpoint(weights_of(cell))
        _, keypoints, _ = evaluate(model, val)
        label = cell.method if cell.epsilon is None else f"{cell.method}\neps {cell.epsilon:g}, C {cell.clip:g}"
        for j, record in enumerate(val):
            ax = axes[i][j]
            image = np.asarray(Image.open(record.image).convert("RGB"))
            ax.imshow(image, interpolation="nearest")
            for pts, colour in ((record.joints, "lime"), (keypoints[j], "red")):
                for a, b in SKELETON:
                    if record.visible[a] and record.visible[b]:
                        ax.plot([pts[a][0], pts[b][0]], [pts[a][1], pts[b][1]], color=colour, linewidth=1.2)
            ax.set_xlim(-0.5, image.shape[1] - 0.5)
            ax.set_ylim(image.shape[0] - 0.5, -0.5)
            ax.set_xticks([])
            ax.set_yticks([])
            if j == 0:
                ax.set_ylabel(label, fontsize=8)
    fig.suptitle(f"validation predictions (red) and ground truth (green), centralized, {strategy}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    # The ward's sensor noise makes a true-colour PNG ~1 MB: a 256-colour palette keeps it small enough to commit.
    Image.open(path).convert("RGB").quantize(colors=256).save(path, optimize=True)
    return path
