"""``fedpose study``: the privacy-utility grid, one subprocess per cell, resumable, with tables and figures.

Registered by ``fedpose.cli.main``. The grid and its cells are ``shared/experiments/study.py``, running them
``shared/experiments/study_run.py``. Each cell runs in its own process, ``python -m fedpose.cli.study
CELL_DIR``: started from here because a federated cell is ``fedpose simulate``'s federation
(``fedpose.cli.local_federation.simulate``), which composes the server's side and the sites'.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

CELL_COMMAND = (sys.executable, "-m", "fedpose.cli.study")  # then the cell's folder


def cmd_study(args: argparse.Namespace) -> int:
    from fedpose.shared.experiments.study_run import run_study

    return run_study(args.config, args.out, cell_command=CELL_COMMAND, quick=args.quick, jobs=args.jobs,
                     threads=args.threads, record=args.record, report_only=args.report_only, quiet=args.quiet)


def register(sub: Any) -> None:
    p = sub.add_parser("study", help="the privacy-utility grid (methods x eps x C x strategy, centralized and "
                                     "federated): CSV, tables, figures; resumable")
    p.add_argument("--config", default="configs/study.yaml", help="study file (default configs/study.yaml)")
    p.add_argument("--out", required=True, help="results directory (cells/<id>/ per run; rerun to resume)")
    p.add_argument("--quick", action="store_true", help="the study file's quick grid (CI-sized)")
    p.add_argument("--jobs", type=int, default=1,
                   help="cells run in parallel (default 1); with CUDA GPUs, each on one GPU, round-robin")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: write the CSV, tables and figures of the cells finished so far")
    p.add_argument("--record", default=None, metavar="DIR",
                   help="keep each finished cell's metrics in DIR/<cell id>.json and count the cells kept there as "
                        "done (commit DIR: another clone then resumes instead of starting over)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per cell (default: cores / jobs)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--verbose", action="store_true", help="debug logging")
    p.set_defaults(func=cmd_study)


if __name__ == "__main__":  # one cell, in its own process: python -m fedpose.cli.study CELL_DIR
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m fedpose.cli.study CELL_DIR (run by fedpose study)")
    from fedpose.cli.fed import print_summary
    from fedpose.cli.local_federation import simulate
    from fedpose.shared.experiments.study_run import run_cell_process

    def federate(config: Any, out: Any, **options: Any) -> dict[str, Any]:
        """A federated cell: ``fedpose simulate --quiet``'s federation, its summary in the cell's log."""
        metrics = simulate(config, out, **options)
        print_summary(metrics, Path(out).expanduser().resolve())
        return metrics

    run_cell_process(Path(sys.argv[1]), simulate=federate)
