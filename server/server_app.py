"""Flower ServerApp of fedpose: thin glue around ``fedpose.server.run.run_federation``.

Run config (``[tool.flwr.app.config]`` in pyproject.toml; override with
``flwr run . <connection> --run-config "key=value ..."``):

- ``config``    fedpose YAML (default ``configs/default.yaml``, shipped in the app)
- ``overrides`` space-separated dotted overrides, e.g. ``"federation.rounds=2"``
- ``out``       results directory (default: the config's ``federation.out``)
- ``resume``    continue from the checkpoint in ``out``, with the config saved there

Everything the run produces lands in ``out``: ledger.sqlite, rounds.jsonl,
checkpoint.pt, model.pt, metrics.json, report.md, federation.png.
"""

from __future__ import annotations

import logging

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedpose.server.run import run_federation
from fedpose.shared.flower.app_logging import setup_app_logging
from fedpose.shared.flower.waits import quick_pulls
from fedpose.shared.flower.run_config import resume_flag, server_config

log = logging.getLogger(__name__)

app = ServerApp()


def setup_logging() -> None:
    setup_app_logging("fedpose.server", "fedpose.shared", defer_to_root=True)


def serve(grid: Grid, context: Context) -> dict:
    """Load the fedpose config named by the run config and run the federation."""
    setup_logging()
    cfg, out = server_config(context.run_config)
    log.info("fedpose federation: %d rounds, method %s/%s, basis mode %s, results in %s", cfg.federation.rounds,
             cfg.train.method, cfg.train.strategy, cfg.federation.basis_mode, out)
    return run_federation(grid, cfg, out, resume=resume_flag(context.run_config))


def quick_reply_pulls(grid: Grid) -> None:
    """Replies are listed before their objects have all arrived at the SuperLink; the deployment engine's grid
    pulls those again after 0.05 s, not after Flower's 1 s (``fedpose.shared.flower.waits``). The simulation's grid
    pulls no objects."""
    import sys

    module = sys.modules.get(type(grid).__module__)
    if hasattr(module, "pull_objects"):
        quick_pulls(module, "pull_objects")


@app.main()
def main(grid: Grid, context: Context) -> None:
    quick_reply_pulls(grid)
    serve(grid, context)
