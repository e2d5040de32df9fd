"""What the guarantee means, measured: one-run audits, membership inference, re-identification.

    python benchmarks/privacy_attacks.py [--only audit,mia,reid] [--out benchmarks/results]

CPU-sized (a shared 2-core machine): a small synthetic ward (2 sites x 100
images at 64 px, 32x32 model input, tinyvit-small with a 64-wide head) for the
audit and the membership attacks, and a 240-image ward at 128 px (30 people)
for re-identification. Writes JSON + PNG per experiment under --out and a
markdown table (``privacy_attacks.md``). Run it as a file (Opacus installs a
top-level ``benchmarks`` package that shadows ``python -m benchmarks...``).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from fedpose.shared.configuration.methods import PRIVATE, PROJECTED


from fedpose.shared.configuration.schema import config_from_dict


def bench_config(root: Path, **train: object) -> object:
    return config_from_dict({
        "data": {
            "source": "synthetic",
            "root": str(root / "ward"),
            "synth": {"sites": 2, "per_site": 100, "public": 120, "val": 48, "seed": 11, "image_size": 64},
            "train_splits": ["site-0", "site-1"],
            "input_size": [32, 32],
        },
        "model": {"variant": "tinyvit-small", "hidden": 64, "joint_channels": 8},
        "pretrain": {"out": str(root / "pretrained"), "epochs": 8, "batch_size": 32},
        "privacy": {"epsilon": 0.8, "delta": 1.0e-5, "k": 16, "m": 48, "basis_every": 10, "chunk_size": 16},
        "train": {"strategy": "full", "batch_size": 32, "public_batch_size": 16, "epochs": 3, **train},
    })


SPAN_CANARIES = 300  # in-span canaries share k = 16 dimensions: 100 / 300 / 1000 gave control eps_LB 0.18 / 0.56 / 0.16


def run_audits(root: Path, out: Path, methods: tuple[str, ...], previous: list[dict]) -> list[dict]:
    """Audit rows of ``methods``; rows of other methods are kept from ``previous`` (the last run)."""
    from fedpose.shared.experiments.audit import AuditSpec, run_audit

    cfg = bench_config(root)
    longer = bench_config(root, epochs=12)  # 84 steps: what an in-span audit needs to catch the control
    recipe = bench_config(root, images="raw+psi", optimizer="sgd", momentum=0.9, lr=3.0e-3)
    rows = [r for r in previous if ("recipe" if "-recipe-" in r["name"] else r["method"]) not in methods]
    plan = []
    for m in PRIVATE:
        span = m in PROJECTED
        plan += [(cfg, m, e, "gradient", SPAN_CANARIES if span else 1000, 1.0) for e in (0.8, 4.0)]
    plan += [(cfg, "dpsgd", 4.0, "input", 48, 1.0), (cfg, "dpsgd", 0.8, "gradient", 1000, 0.01)]
    plan += [(cfg, m, 0.8, "gradient", SPAN_CANARIES, 0.01) for m in ("proj", "fpdp")]
    plan += [(longer, "fpdp", 0.8, "gradient", SPAN_CANARIES, 0.01)]
    # the site kits' record-level recipe (proj under SGD with momentum, each record clipped with its blurred copy),
    # and its positive control: "--audit-methods recipe"
    plan += [(recipe, "proj", 0.8, "gradient", SPAN_CANARIES, scale) for scale in (1.0, 0.01)]
    for c, method, eps, mode, m, scale in plan:
        if (method if c is not recipe else "recipe") not in methods:
            continue
        spec = AuditSpec(method=method, epsilon=eps, canaries=m, mode=mode, noise_scale=scale, seed=0)
        name = (f"audit-{method}" + ("-recipe" if c is recipe else "") + f"-eps{eps:g}-{mode}"
                + (f"-{spec.placement}" if spec.placement == "span" else "")
                + ("-control" if scale != 1.0 else "") + (f"-{c.train.epochs}ep" if c is longer else ""))
        res = run_audit(c, spec, out / name, progress=False)
        print(f"{name}: claimed {res['epsilon_claimed']:.3f} eps_LB {res['epsilon_lb']:.3f} "
              f"({res['v']}/{res['r']}) {res['seconds']:.0f} s", flush=True)
        rows.append({k: v for k, v in res.items() if k not in ("scores", "membership", "released_coords")}
                    | {"name": name})
    return rows


def run_membership(root: Path, out: Path) -> dict:
    from fedpose.shared.experiments.membership import MiaSpec, run_mia

    cfg = bench_config(root, batch_size=16, epochs=30)
    res = run_mia(cfg, MiaSpec(methods=("nonprivate", "dpsgd", "fpdp"), models=6, pool=96, split="site-0", seed=0),
                  out / "mia", progress=True)
    for method, r in res["methods"].items():
        print(method, r["epsilon"], {a: round(v["auc"], 3) for a, v in r["attacks"].items()}, flush=True)
    return {k: v for k, v in res.items()} | {"methods": {m: {k: v for k, v in r.items() if k != "roc"}
                                                        for m, r in res["methods"].items()}}


def run_reidentification(root: Path, out: Path) -> dict:
    from fedpose.shared.experiments.reid import ReidSpec, run_reid
    from fedpose.shared.data.synth.ward import WardSpec, ensure_ward

    ward = ensure_ward(root / "reid-ward", WardSpec(sites=1, per_site=240, public=8, val=8, seed=12, image_size=128),
                       progress=False)
    res = run_reid(ward, "site-0", ReidSpec(seed=0), out / "reid", progress=True)
    print(f"reid: clean {res['clean']:.3f} blur {res['blur']:.3f}", flush=True)
    return res


def table(results: dict) -> str:
    lines = []
    if "audit" in results:
        lines += ["| audit | mode | canaries | claimed eps (RDP) | eps_LB (95%) | correct / guesses | steps, q, sigma "
                  "| s |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in results["audit"]:
            placed = f"{r['canaries']} {r.get('placement') or r['mode']}"
            lines.append(f"| {r['name']} | {r['mode']} | {placed} | {r['epsilon_claimed']:.3f} | "
                         f"**{r['epsilon_lb']:.3f}** | "
                         f"{r['v']} / {r['r']} | {r['steps']}, {r['sample_rate']:.3f}, {r['sigma_ran']:.3g} | "
                         f"{r['seconds']:.0f} |")
        lines.append("")
    if "mia" in results:
        lines += ["| method | eps | attack | AUC | TPR @ 1% FPR | TPR @ 0.1% FPR |", "|---|---|---|---|---|---|"]
        for method, r in results["mia"]["methods"].items():
            eps = f"{r['epsilon']:.3g}" if r["epsilon"] is not None else "-"
            for attack, a in r["attacks"].items():
                lines.append(f"| {method} | {eps} | {attack} | {a['auc']:.3f} | {a['tpr@0.01fpr']:.3f} | "
                             f"{a['tpr@0.001fpr']:.3f} |")
        lines.append("")
    if "reid" in results:
        r = results["reid"]
        lines += [f"Re-ID top-1 ({r['identities']} people, chance {r['chance']:.3f}): clean {r['clean']:.3f}, blur "
                  f"sigma {r['blur_sigma']:g} px {r['blur']:.3f}, " + ", ".join(
                      f"plain pixelization b={p['b']} {p['top1']:.3f}" for p in r["plain_pixelization"]), "",
                  "| b | mode | " + " | ".join(f"eps {e:g}" for e in sorted({p['eps'] for p in r["pixelized"]})) + " |",
                  "|---|---|" + "---|" * len({p['eps'] for p in r["pixelized"]})]
        for b in sorted({p["b"] for p in r["pixelized"]}):
            for mode in ("uniform", "adaptive"):
                vals = [p["top1"] for p in sorted(r["pixelized"], key=lambda p: p["eps"])
                        if p["b"] == b and p["mode"] == mode]
                lines.append(f"| {b} | {mode} | " + " | ".join(f"{v:.3f}" for v in vals) + " |")
    return "\n".join(lines) + "\n"


def part_seconds(part: str, results: dict, elapsed: float) -> float:
    """A part's seconds: the audits' is the sum of every audit row's own run (a partial rerun keeps the other
    rows and their times), the others' the run just made."""
    if part == "audit":
        return round(sum(r["seconds"] for r in results["audit"]), 1)
    return round(elapsed, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="audit,mia,reid")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--audit-methods", default="dpsgd,proj,fdp,fpdp",
                        help="re-run the audit rows of these methods only (the others are kept from the last run)")
    parser.add_argument("--work", default="runs/bench-attacks", help="wards and pretrained weights (cached)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    out, root = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    summary_path = out / "privacy_attacks.json"
    results = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    t0 = time.perf_counter()
    for part in args.only.split(","):
        start = time.perf_counter()
        if part == "audit":
            results["audit"] = run_audits(root, out, tuple(args.audit_methods.split(",")), results.get("audit", []))
        elif part == "mia":
            results["mia"] = run_membership(root, out)
        elif part == "reid":
            results["reid"] = run_reidentification(root, out)
        else:
            raise SystemExit(f"unknown part {part!r}; choose from audit, mia, reid")
        results.setdefault("seconds", {})[part] = part_seconds(part, results, time.perf_counter() - start)
        summary_path.write_text(json.dumps(results, indent=1))
        (out / "privacy_attacks.md").write_text(table(results))
    print(table(results))
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
