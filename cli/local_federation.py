"""A federation on this machine, both sides at once: what ``fedpose simulate`` and a study's federated cell run.

A simulation needs the server's side (its config's paths made absolute: ``fedpose.server.prepare``) and every
site's (its default policy and its own checks: ``fedpose.client``) around Flower's simulation runtime
(``fedpose.shared.flower.simulation``: the local SuperLink, ``flwr run``, the log). Only the CLI may import
both sides, so they meet here; the command modules only parse and call ``simulate``.

``simulation_apps`` are the same two apps for Flower's in-process ``run_simulation`` (tests drive a hostile
server through it).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def simulation_apps(run_config: dict[str, Any]) -> tuple[Any, Any]:
    """Server and client apps for ``run_simulation``, which passes no run config: inject ours."""
    from flwr.app import Context, Message
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp

    from fedpose.client import client_app as site_app
    from fedpose.server import server_app as central_app

    server = ServerApp()
    client = ClientApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        context.run_config = dict(run_config)
        central_app.serve(grid, context)

    @client.query()
    def query(msg: Message, context: Context) -> Message:
        return site_app.on_query(msg, context, dict(run_config))

    @client.train()
    def train(msg: Message, context: Context) -> Message:
        return site_app.on_train(msg, context, dict(run_config))

    return server, client


def prepare_simulation(cfg: Any, out: Path, *, progress: bool, echo: Callable[[str], None] = print) -> Path:
    """Data, pretrained weights, site policies and each site's own checks (P2 disjointness, duplicates), and
    the run's config file; returns its path. Each phase is said before it starts (``echo``): a fresh clone
    generates its data and pretrains for minutes before the federation's first round."""
    from fedpose.client.policy import load_policy, write_policy
    from fedpose.client.policy_resolve import default_policy
    from fedpose.client.data import prepare_site
    from fedpose.shared.configuration.schema import dump_config
    from fedpose.shared.training.runs import ensure_data, ensure_pretrained, pretrained_problem

    root = Path(cfg.data.root)
    synthetic = cfg.data.source == "synthetic"
    echo(f"[1/3] data: {root}" + (" (generating the synthetic ward: first run only, seconds)"
                                  if synthetic and not (root / "manifest.json").is_file() else ""))
    ensure_data(cfg, progress=progress)
    if cfg.train.strategy == "scratch":
        echo("[2/3] public pretraining: none (train.strategy = scratch)")
    else:
        problem = pretrained_problem(cfg)
        echo(f"[2/3] public pretraining: {cfg.pretrain.out}: present, made with this config" if problem is None else
             f"[2/3] public pretraining: {problem}: pretraining on the public split first ({cfg.pretrain.epochs} "
             "epochs, no private data; once, then cached for every later run; its progress bar says the time left)")
        ensure_pretrained(cfg, progress=progress)
    fed = cfg.federation
    echo(f"[3/3] federation: {fed.rounds} rounds of {fed.local_steps} local steps at each of "
         f"{len(cfg.data.train_splits)} sites, in Flower's simulation (each site's checks first; each round's line "
         "says the time left)")
    for i, split in enumerate(cfg.data.train_splits):
        path = out / "sites" / split / "policy.yaml"
        if not path.exists():
            write_policy(path, default_policy(cfg, out, i))
        prepare_site(load_policy(path))  # each simulated site's operator step: its own checks, once per run
    config_path = out / "run-config.yaml"
    dump_config(cfg, config_path)
    return config_path


def _silent(_line: str) -> None:
    pass


def simulate(config: str | Path, out: str | Path, *, sets: dict[str, Any] | None = None, rounds: int | None = None,
             seed: int | None = None, resume: bool = False, progress: bool = True,
             quiet: bool = False) -> dict[str, Any]:
    """``fedpose simulate``: the federation of ``config`` (or, with ``resume``, the one in ``out``, from its
    checkpoint) with one simulated site per ``data.train_splits`` entry; returns its metrics.json.

    ``sets`` are dotted overrides (``--set``), then ``rounds`` and ``seed`` when given; ``progress`` shows the
    preparation's progress bars, ``quiet`` leaves Flower's log and the phases' lines out.
    """
    from fedpose.server.prepare import absolute_paths
    from fedpose.shared.configuration.schema import load_config
    from fedpose.shared.flower.simulation import check_simulation_sites, flower_env, run_local_simulation

    out = Path(out).expanduser().resolve()
    overrides: dict[str, Any] = {**(sets or {}), "federation.out": str(out)}
    if rounds is not None:
        overrides["federation.rounds"] = rounds
    if seed is not None:
        overrides["train.seed"] = seed
    if resume:
        previous = out / "run-config.yaml"
        if not previous.is_file():
            raise FileNotFoundError(f"{previous} not found: nothing to resume in {out}")
        cfg = load_config(previous, overrides)
    else:
        if (out / "checkpoint.pt").exists() or (out / "ledger.sqlite").exists():
            raise ValueError(f"{out} already holds a federation: continue it with --resume or choose another --out")
        cfg = load_config(config, overrides)
    cfg = absolute_paths(cfg)  # Ray workers may run elsewhere
    check_simulation_sites(cfg)
    out.mkdir(parents=True, exist_ok=True)
    flower_env(out / "flwr-home")
    config_path = prepare_simulation(cfg, out, progress=progress, echo=_silent if quiet else print)
    run_config = {"config": str(config_path), "overrides": "", "out": str(out), "resume": bool(resume)}
    status = run_local_simulation(out, run_config, sites=len(cfg.data.train_splits), quiet=quiet)
    metrics_path = out / "metrics.json"
    if status != "finished:completed" or not metrics_path.is_file():
        raise RuntimeError(f"the federation did not finish ({status or 'no status'}); see the log above and "
                           f"{out / 'superlink.log'}")
    return json.loads(metrics_path.read_text())
