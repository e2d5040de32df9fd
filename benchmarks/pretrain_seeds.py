"""How stable the public-pretrained start is: pretraining over seeds and CPU instruction sets (not a test).

The start of every private run is the public-pretrained model. A recipe is only usable if its start does not
depend on the seed or on the machine by more than about a point. For each recipe (a set of ``--set`` overrides)
this runs ``fedpose pretrain`` for every seed, once per CPU instruction set torch may dispatch to
(``ATEN_CPU_CAPABILITY``: a machine with AVX2 only runs the ``avx2`` kernels, which sum in another order than
the ``avx512`` ones), each in its own process, and writes ``OUT/pretraining.json``: per recipe the start of
every run, the mean and standard deviation, and the provenance. Finished runs are read, not rerun.

    python benchmarks/pretrain_seeds.py --recipe no-jitter=pretrain.photometric=0 --recipe shipped= \\
        --seeds 0 1 2 --capabilities native avx2 --out runs/pretrain-seeds
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from fedpose.shared.training.provenance import provenance  # noqa: E402


def parse_recipe(text: str) -> tuple[str, list[str]]:
    """``name=key=value;key=value`` (or ``name=`` for the config as it is) -> (name, ["key=value", ...])."""
    name, sep, rest = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--recipe {text!r}: expected name=key=value;key=value (or name=)")
    return name, [s for s in rest.split(";") if s.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="default")
    parser.add_argument("--recipe", type=parse_recipe, action="append", required=True,
                        help="name=key=value;key=value: config overrides of one recipe (repeat)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--capabilities", nargs="+", default=["native"],
                        help="ATEN_CPU_CAPABILITY values to run under: native (the machine's own, unset), avx512, "
                             "avx2 or default (no vector kernels); default: native")
    parser.add_argument("--data", default=None, help="data.root for every run (the ward is generated once there)")
    parser.add_argument("--out", type=Path, default=Path("runs/pretrain-seeds"))
    args = parser.parse_args(argv)
    out = args.out.resolve()
    recipes = {}
    for name, sets in args.recipe:
        runs = []
        for capability in args.capabilities:
            for seed in args.seeds:
                run = out / f"{name}-{capability}-{seed}"
                if not (run / "metrics.json").is_file():
                    cmd = [sys.executable, "-m", "fedpose.cli.main", "pretrain", "--config", args.config, "--out",
                           str(run), "--set", f"pretrain.seed={seed}", "--quiet"]
                    cmd += [a for s in sets for a in ("--set", s)]
                    if args.data:
                        cmd += ["--set", f"data.root={args.data}"]
                    env = dict(os.environ)
                    if capability != "native":
                        env["ATEN_CPU_CAPABILITY"] = capability
                    print(f"{name} seed {seed} ({capability}): {' '.join(cmd[1:])}", flush=True)
                    if subprocess.run(cmd, cwd=REPO, env=env).returncode != 0:
                        print(f"failed: {run}", file=sys.stderr)
                        return 1
                metrics = json.loads((run / "metrics.json").read_text())
                runs.append({"seed": seed, "capability": capability,
                             "cpu_capability": metrics["provenance"].get("cpu_capability"),
                             "start": metrics["pckh"]["mean"], "seconds": metrics.get("seconds")})
                print(f"{name} seed {seed} ({capability}): start {runs[-1]['start']:.2f}", flush=True)
        starts = [r["start"] for r in runs]
        recipes[name] = {"overrides": sets, "runs": runs, "mean": statistics.mean(starts),
                         "std": statistics.stdev(starts) if len(starts) > 1 else 0.0}
        print(f"{name}: {recipes[name]['mean']:.2f} ± {recipes[name]['std']:.2f} over {len(starts)} runs", flush=True)
    result = {"what": "public-pretrained start (PCKh@0.5 on the validation split) per recipe, seed and CPU kernels",
              "config": args.config, "recipes": recipes,
              "provenance": provenance(command=" ".join(["python", "benchmarks/pretrain_seeds.py",
                                                         *(argv if argv is not None else sys.argv[1:])]))}
    out.mkdir(parents=True, exist_ok=True)
    (out / "pretraining.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out / 'pretraining.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
