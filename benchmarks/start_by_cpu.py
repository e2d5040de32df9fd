"""The main command's start on this machine, added to the starts measured on other CPUs (not a test).

The main command pretrains with a fixed seed (``pretrain.seed: 0``), yet its start moves with the CPU: each
CPU family and instruction set sums a matmul's blocks in its own order (torch's kernels for the instruction
set, and the BLAS and oneDNN code paths each vendor's CPU gets), and 30 epochs of pretraining carry the
difference into the weights. This runs the main command's pretraining (``fedpose pretrain --config default``,
nothing overridden) in its own process and writes ``OUT/start_by_cpu.json``: the machines already in
``benchmarks/results/start_by_cpu.json`` and this one, each with its CPU, instruction set, start and how many
runs gave it. ``tools/render_results.py`` states the range a user should expect from this file.

    python benchmarks/start_by_cpu.py --out runs/start-by-cpu
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULT = REPO / "benchmarks" / "results" / "start_by_cpu.json"


def merge(machines: list[dict], row: dict) -> list[dict]:
    """``machines`` with ``row`` counted in: one more run of a machine that gave the same start, else a new row."""
    out = [dict(m) for m in machines]
    for m in out:
        if (m["cpu"], m["cpu_capability"], round(m["start"], 2)) == (row["cpu"], row["cpu_capability"],
                                                                     round(row["start"], 2)):
            m["runs"] += 1
            return out
    return [*out, row]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/start-by-cpu"))
    args = parser.parse_args(argv)
    out = args.out.resolve()
    run = out / "pretrained"
    if not (run / "metrics.json").is_file():
        cmd = [sys.executable, "-m", "fedpose.cli.main", "pretrain", "--config", "default", "--out", str(run),
               "--quiet"]
        if subprocess.run(cmd, cwd=REPO).returncode != 0:
            print(f"failed: {run}", file=sys.stderr)
            return 1
    metrics = json.loads((run / "metrics.json").read_text())
    p = metrics["provenance"]
    row = {"cpu": p.get("cpu") or "unknown", "cpu_capability": p.get("cpu_capability") or "unknown",
           "start": metrics["pckh"]["mean"], "runs": 1, "how": "benchmarks/start_by_cpu.py",
           "torch": (p.get("versions") or {}).get("torch"), "commit": (p.get("commit") or "")[:10],
           "date": str(p.get("date", ""))[:10]}
    known = json.loads(RESULT.read_text()) if RESULT.is_file() else {"machines": []}
    result = {**known, "machines": merge(known["machines"], row)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "start_by_cpu.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"start {row['start']:.2f} on {row['cpu']} ({row['cpu_capability']}); wrote {out / 'start_by_cpu.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
