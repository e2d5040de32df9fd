"""Benchmark: what a round on Flower's deployment engine costs beyond the sites' own work (not a test).

Starts a real SuperLink (TLS, node authentication) and two sites through ``fedpose site start`` (the
app gate, one SuperNode each) on 127.0.0.1, submits the app with ``flwr run`` and runs a small federation
(the tests' tiny world: 32x32 inputs, 2 local steps, k = 4). Then, per round, it sets the server's time
for the round's train messages (sent until the last reply came back) against what the slower site spent
on the round itself (its log: local training and the basis), and per message what the site paid before
it could start on it: the age of the ClientApp process Flower started for the message (Python, imports,
the bundle's install) when the handler began, and the handler's own time. It runs the federation three
times, side by side: with ``fedpose site start`` as it is (ClientApps forked warm, the SuperNode looking
for messages every 0.2 s), with Flower's own polling (``--poll 3``), and with neither (``--cold --poll 3``).

    python benchmarks/deploy_round.py [--rounds 4] [--out FILE]

writes benchmarks/results/deploy_round.json (rendered into docs/results/benchmarks.md).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # support.federation: the tests' world and pilot

TRAINED = re.compile(r"site (site-\d+) round (\d+): trained \d+ steps .* in ([0-9.]+) s \(\+([0-9.]+) s basis\)")
HANDLED = re.compile(r"site (site-\d+): (\w+) message handled in ([0-9.]+) s; "
                     r"its process had started ([0-9.]+) s before")


def site_costs(log: str) -> tuple[dict[int, float], list[dict]]:
    """From a site's log: per round, its training + basis seconds; per message, handler and start-up seconds."""
    rounds = {int(m[2]): float(m[3]) + float(m[4]) for m in TRAINED.finditer(log)}
    messages = [{"site": m[1], "type": m[2], "handler_s": float(m[3]), "startup_s": float(m[4])}
                for m in HANDLED.finditer(log)]
    return rounds, messages


MODES = {"default": (), "poll-3": ("--poll", "3"), "cold": ("--cold", "--poll", "3")}


def run_pilot(rounds: int, *, flags: tuple[str, ...], keep: Path | None) -> tuple[list[dict], list, Any]:
    """A federation of ``rounds`` rounds on a real SuperLink and two gated SuperNodes; its rounds and site logs."""
    from support.federation import Pilot, prepare_world

    from fedpose.shared.configuration.schema import dump_config

    with tempfile.TemporaryDirectory(prefix="fedpose-deploy-bench-") as tmp:
        root = Path(tmp)
        cfg = prepare_world(root / "world", rounds=rounds)
        config_path = root / "federation.yaml"
        dump_config(cfg, config_path)
        with contextlib.redirect_stdout(io.StringIO()):  # the kit's own printing
            pilot = Pilot(root, cfg, lifetime_rounds=rounds)
        try:
            pilot.start_superlink()
            pilot.register(1, 2)
            for i in (0, 1):
                pilot.start_site(i, None, *flags)
            out = root / "out"
            run_id = pilot.submit(pilot.app, f"config='{config_path}' out='{out}'")
            status = pilot.wait_finished(run_id, 300 + 120 * rounds)
            if status != "finished:completed":
                raise SystemExit(f"run {run_id} ended {status}:\n{pilot.run_log(run_id)[-4000:]}")
        finally:
            pilot.close()
        records = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
        per_site = [site_costs(pilot.log(f"supernode-{i}").read_text()) for i in (0, 1)]
        if keep:
            keep.mkdir(parents=True, exist_ok=True)
            for log in root.glob("*.log"):
                (keep / log.name).write_bytes(log.read_bytes())
    return records, per_site, cfg


def summarise(records: list[dict], per_site: list) -> dict:
    rounds = []
    for r in records:
        site_s = max(costs.get(r["round"], 0.0) for costs, _ in per_site)
        rounds.append({"round": r["round"], "server_train_s": r["seconds"]["train"], "site_work_s": site_s,
                       "overhead_s": r["seconds"]["train"] - site_s,
                       "bytes_down": sum(r["bytes_down"].values()), "bytes_up": sum(r["bytes_up"].values())})
    messages = [m for _, ms in per_site for m in ms]
    by_type: dict[str, dict] = {}
    for kind in sorted({m["type"] for m in messages}):
        these = [m for m in messages if m["type"] == kind]
        by_type[kind] = {"count": len(these), "startup_s": statistics.median(m["startup_s"] for m in these),
                         "handler_s": statistics.median(m["handler_s"] for m in these)}
    overheads = [r["overhead_s"] for r in rounds]
    return {"rounds": rounds, "messages": by_type,
            "overhead_s": {"median": statistics.median(overheads), "min": min(overheads), "max": max(overheads)}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4, help="federation rounds (default: 4)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "deploy_round.json")
    parser.add_argument("--keep", type=Path, default=None, help="copy the processes' logs into this folder")
    args = parser.parse_args(argv)

    from fedpose.shared.training.provenance import provenance

    started = time.time()
    result: dict = {"sites": 2, "modes": {}}
    for mode, flags in MODES.items():  # side by side in one run
        print(f"{mode} ({' '.join(flags) or 'fedpose site start as it is'}): {args.rounds} rounds on the deployment "
              "engine (2 sites on 127.0.0.1) ...", flush=True)
        records, per_site, cfg = run_pilot(args.rounds, flags=flags, keep=args.keep and args.keep / mode)
        result["modes"][mode] = {"flags": " ".join(flags), **summarise(records, per_site)}
        result["input"], result["local_steps"] = list(cfg.data.input_size), cfg.federation.local_steps
        print(f"{'round':>5}{'server s':>10}{'site s':>8}{'beyond s':>10}")
        for r in result["modes"][mode]["rounds"]:
            print(f"{r['round']:>5}{r['server_train_s']:>10.2f}{r['site_work_s']:>8.2f}{r['overhead_s']:>10.2f}")
        for kind, m in result["modes"][mode]["messages"].items():
            print(f"{kind} messages: {m['count']}, process start-up {m['startup_s']:.2f} s, "
                  f"handler {m['handler_s']:.2f} s (medians)")
    command = " ".join(["python", "benchmarks/deploy_round.py", *(argv if argv is not None else sys.argv[1:])])
    result["provenance"] = provenance(command=command, seconds=time.time() - started)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
