"""The main command's numbers over several seeds: public pretraining, then the default federation (not a test).

For each seed S it runs what the README's main command runs, with S as the pretraining seed and the sites'
noise seed (``fedpose simulate --seed S``: reproducible, not for production):

    fedpose simulate --config CONFIG --seed S --set pretrain.seed=S --set pretrain.out=OUT/pretrained-S
                     --out OUT/seed-S

each in its own process. With ``--pretrain-seed P`` every run starts from the one model pretrained with seed P
(``OUT/pretrained-P``) and S seeds only the sites' noise: the spread of the main command itself, whose
pretraining is seeded by the config (``pretrain.seed``) and whose noise comes from the operating system.
It writes ``OUT/main.json``: per seed the start (the public-pretrained model's
PCKh@0.5 on the validation split), the PCKh after every round, the best and the final round, every site's
epsilon and the seconds; over the seeds the mean and standard deviation of the start, the best, the final
and the gain; and the provenance (commit, date, command, versions, threads, CPU). A seed whose run folder
already holds a finished federation is read, not rerun (so an interrupted run continues).
``tools/render_results.py`` renders the results pages' tables from this file.

    python benchmarks/main_seeds.py --seeds 0 1 2 --out runs/main-seeds
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from fedpose.server.report import read_rounds  # noqa: E402
from fedpose.shared.training.provenance import provenance  # noqa: E402


def command(config: str, seed: int, out: Path, pretrain_seed: int | None = None) -> list[str]:
    pretrain = seed if pretrain_seed is None else pretrain_seed
    return [sys.executable, "-m", "fedpose.cli.main", "simulate", "--config", config, "--seed", str(seed),
            "--set", f"pretrain.seed={pretrain}", "--set", f"pretrain.out={out / f'pretrained-{pretrain}'}",
            "--out", str(out / f"seed-{seed}"), "--quiet"]


def read_seed(run: Path, seed: int, seconds: float | None) -> dict:
    """One finished federation's numbers, from its own files."""
    metrics = json.loads((run / "metrics.json").read_text())
    curve = [float(r["pckh_mean"]) for r in read_rounds(run / "rounds.jsonl")]
    start = float(metrics["initial_pckh_mean"])
    return {"seed": seed, "start": start, "curve": curve, "best": max(curve), "best_round": 1 + curve.index(max(curve)),
            "final": curve[-1], "gain": curve[-1] - start, "epsilon": metrics["epsilon"],
            "sites": {s: v["epsilon"] for s, v in metrics["sites"].items()}, "seconds": seconds}


def spread(values: list[float]) -> dict:
    return {"mean": statistics.mean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "values": values}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="default", help="a config file or a shipped name (default default)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--pretrain-seed", type=int, default=None,
                        help="pretrain once with this seed and let --seeds seed only the sites' noise "
                             "(default: each seed pretrains with itself)")
    parser.add_argument("--out", type=Path, default=Path("runs/main-seeds"))
    args = parser.parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    seeds = []
    for seed in args.seeds:
        run = out / f"seed-{seed}"
        seconds = None
        if not (run / "metrics.json").is_file():
            cmd = command(args.config, seed, out, args.pretrain_seed)
            print(f"seed {seed}: {' '.join(cmd)}", flush=True)
            t0, load = time.perf_counter(), os.getloadavg()[0]
            done = subprocess.run(cmd, cwd=REPO)
            seconds = round(time.perf_counter() - t0, 1)
            print(f"seed {seed}: {seconds:.0f} s; 1-minute load average {load:.1f} at the start, "
                  f"{os.getloadavg()[0]:.1f} at the end (other jobs on the machine slow a run down)", flush=True)
            if done.returncode != 0:
                print(f"seed {seed} failed (exit {done.returncode}): see {run}", file=sys.stderr)
                return 1
        row = read_seed(run, seed, seconds)
        seeds.append(row)
        print(f"seed {seed}: start {row['start']:.2f}, best {row['best']:.2f} (round {row['best_round']}), final "
              f"{row['final']:.2f}, gain {row['gain']:+.2f}", flush=True)
    summary = {key: spread([r[key] for r in seeds]) for key in ("start", "best", "final", "gain")}
    what = ("the main command's pretraining and default federation, per seed" if args.pretrain_seed is None else
            f"the main command's default federation per noise seed, from one start pretrained with seed "
            f"{args.pretrain_seed}")
    result = {"what": what, "config": args.config, "pretrain_seed": args.pretrain_seed, "seeds": seeds,
              "summary": summary,
              "provenance": provenance(
                  command=" ".join(["python", "benchmarks/main_seeds.py", *(argv or sys.argv[1:])]),
                  commands=[" ".join(command(args.config, s, Path("OUT"), args.pretrain_seed)[1:])
                            for s in args.seeds])}
    (out / "main.json").write_text(json.dumps(result, indent=1) + "\n")
    for key, s in summary.items():
        print(f"{key}: {s['mean']:.2f} ± {s['std']:.2f} over {len(seeds)} seeds")
    print(f"wrote {out / 'main.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
