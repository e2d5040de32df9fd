"""Compare the five training methods on one config over several seeds (not a test).

Runs ``fedpose train`` (shared.training.runs.run_train) for each method and seed with
everything else from the config, then prints a markdown table of PCKh@0.5
(mean +- std over seeds), PCKh@0.1, epsilon spent and seconds. Data and the
public pretrained weights are generated once and shared by all runs.

Run: python benchmarks/compare_methods.py --config configs/default.yaml --seeds 1 2 3 --out runs/compare
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


from fedpose.shared.configuration.schema import load_config, replace
from fedpose.shared.configuration.methods import METHODS
from fedpose.shared.training.runs import run_train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--out", default="runs/compare")
    parser.add_argument("--reuse", action="store_true", help="reuse runs whose metrics.json already exists in --out")
    args = parser.parse_args()
    base = load_config(args.config)
    rows = {}
    for method in args.methods:
        for seed in args.seeds:
            out = Path(args.out) / f"{method}-{seed}"
            cfg = replace(base, **{"train.method": method, "train.seed": seed, "train.out": str(out)})
            done = out / "metrics.json"
            if args.reuse and done.exists():
                metrics = json.loads(done.read_text())
            else:
                metrics = run_train(cfg, out, progress=False)
            rows.setdefault(method, []).append(metrics)
            print(f"{method} seed {seed}: PCKh {metrics['pckh']['mean']:.2f}  ({metrics['seconds']:.0f} s)", flush=True)
    print()
    print(f"| method | PCKh@0.5 mean (± std over {len(args.seeds)} seeds) | PCKh@0.1 mean | epsilon spent | sigma "
          "| s/run |")
    print("|---|---|---|---|---|---|")
    summary = {}
    for method, runs in rows.items():
        vals = [r["pckh"]["mean"] for r in runs]
        v01 = [r["pckh@0.1"]["mean"] for r in runs]
        eps = runs[0]["epsilon"]
        sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
        summary[method] = {"pckh_mean": statistics.mean(vals), "pckh_std": sd, "runs": vals}
        eps_s = f"{eps:.3f}" if eps is not None else "inf (no DP)"
        print(f"| {method} | {statistics.mean(vals):.2f} ± {sd:.2f} | {statistics.mean(v01):.2f} | {eps_s} | "
              f"{runs[0]['sigma']:.3f} | {statistics.mean(r['seconds'] for r in runs):.0f} |")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "summary.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
