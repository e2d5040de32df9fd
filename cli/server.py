"""``fedpose server prepare | run | status``: the federation server's steps.

``prepare``: the server's public split, validation split and pretrained weights (server/prepare.py).
``run``: submit the federation to the SuperLink with ``flwr run``, follow it and exit non-zero unless it
finished completed (``flwr run`` itself returns 0 as soon as the run is submitted).
``status``: the run folder's rounds, per-site spend and events (server/status.py).
``build-app``: the Flower app and the bundle the sites approve, from this install (cli/app_bundle.py).
``register-sites``: the sites' public keys, registered again safely (cli/register_sites.py).
``front``: the sites' address, which passes the SuperLink's Fleet API only (cli/fleet_front.py).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from fedpose.shared.errors import ExitCode

# ``fedpose server run``: 0 finished completed; FAILED when the run failed, was stopped or was not submitted.
RUN_FAILED = NOT_SUBMITTED = ExitCode.FAILED


def cmd_prepare(args: argparse.Namespace) -> int:
    from fedpose.cli.main import load_cli_config
    from fedpose.server.prepare import prepare_server

    prepare_server(load_cli_config(args), Path(args.out), progress=not args.quiet)
    return 0


def _flwr(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("flwr")
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=timeout)


def _status_of(connection: str, run_id: int) -> str:
    done = _flwr("ls", connection, "--run-id", str(run_id), "--format", "json", timeout=60)
    if done.returncode != 0:
        return ""
    try:
        return str(json.loads(done.stdout)["runs"][0]["status"])
    except (ValueError, KeyError, IndexError):
        return ""


def cmd_run(args: argparse.Namespace) -> int:
    """Submit, follow, and say plainly how the run ended (exit 0 only when it finished completed)."""
    app = Path(args.app).expanduser().resolve()
    if not (app / "pyproject.toml").is_file():
        raise FileNotFoundError(f"no Flower app at {app} (it needs pyproject.toml): give --app the folder "
                                "`fedpose server build-app --out DIR` wrote, whose bundle the sites approved")
    out = Path(args.out).expanduser().resolve()
    parts = [f"out='{out}'"]
    if args.resume:
        parts.append("resume=true")
    else:
        parts.append(f"config='{Path(args.config).expanduser().resolve()}'")
    submitted_at = time.time() - 1.0
    submitted = _flwr("run", str(app), args.connection, "--format", "json", "--run-config", " ".join(parts))
    try:
        run_id = int(json.loads(submitted.stdout)["run-id"])
    except (ValueError, KeyError, TypeError):
        print(f"fedpose server run: the run was not submitted: {(submitted.stdout + submitted.stderr).strip()[-800:]}",
              file=sys.stderr)
        return NOT_SUBMITTED
    print(f"submitted run {run_id} to {args.connection}; results in {out}", flush=True)
    seen, status, deadline = 0, "", time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        status = _status_of(args.connection, run_id)
        rounds = out / "rounds.jsonl"
        if rounds.is_file():
            lines = [line for line in rounds.read_text().splitlines() if line.strip()]
            for line in lines[seen:]:
                try:
                    r = json.loads(line)
                except ValueError:
                    break
                print(round_line(r), flush=True)
                seen += 1
        if status.startswith("finished"):
            break
        time.sleep(args.poll)
    if status == "finished:completed":
        metrics = out / "metrics.json"
        if metrics.is_file():
            m = json.loads(metrics.read_text())
            if m.get("stopped"):
                print(f"stopped early: {m['stopped']}")
            print(f"finished: PCKh {m['pckh_mean']:.2f} (start {m.get('initial_pckh_mean') or float('nan'):.2f}); "
                  f"claim: {m['claim']}")
        else:
            print("finished")
        return 0
    from fedpose.server.outcome import read_outcome

    outcome = read_outcome(out) if (out / "outcome.json").is_file() and \
        (out / "outcome.json").stat().st_mtime >= submitted_at else None  # this run's, not an earlier one's
    if status.startswith("finished") and outcome is not None and outcome.get("state") == "failed":
        # the server said why it could not go on: that line, not the traceback Flower logs around it
        print(f"fedpose server run: run {run_id} failed: {outcome['reason']} (its whole log: flwr log {run_id} "
              f"{args.connection} --show)", file=sys.stderr)
        return RUN_FAILED
    log = _flwr("log", str(run_id), args.connection, "--show", timeout=120).stdout
    why = status or f"still running after --timeout {args.timeout:.0f} s"
    print(f"fedpose server run: run {run_id} did not finish completed ({why}); the end of its log:\n"
          + "\n".join(log.splitlines()[-40:]), file=sys.stderr)
    return RUN_FAILED


def round_line(r: dict[str, Any]) -> str:
    """One round of rounds.jsonl as ``server run`` prints it; a round that was not aggregated names who paid for it."""
    if r.get("aggregated", True):
        line = f"round {r['round']}: PCKh {r['pckh_mean']:.2f}, accepted {', '.join(r['accepted']) or '-'}"
    else:
        line = (f"round {r['round']}: not aggregated (too few valid replies), PCKh {r['pckh_mean']:.2f} unchanged"
                + (f"; {', '.join(r['discarded'])} paid for an update that was thrown away" if r.get("discarded")
                   else ""))
    return (line + (f", missed {', '.join(r['missed'])}" if r.get("missed") else "")
            + (f", refused {', '.join(r['refused'])}" if r.get("refused") else ""))


def cmd_status(args: argparse.Namespace) -> int:
    from fedpose.server.status import server_status

    status = server_status(args.out)
    if args.json:
        print(json.dumps(status, indent=1, default=str))
        return 0
    print(f"federation {status['federation']} in {status['out']}: {status['state']}"
          + (f" ({status['state_reason']})" if status["state_reason"] else "")
          + f", {len(status['rounds'])}/{status['rounds_planned'] or '?'} rounds, {status['resumes']} resume(s)")
    if status["rounds"]:
        print(f"PCKh@0.5: start {status['initial_pckh'] or float('nan'):.2f}, latest {status['latest_pckh']:.2f}, "
              f"best {status['best_pckh']:.2f}")
    for site, s in sorted(status["sites"].items()):
        print(f"  {site}: eps {s['epsilon']:.4f} of {s['budget']:g} (delta {s['delta']:g}), {s['rounds']} rounds, "
              f"{s['status']}" + (f" ({s['reason']})" if s["reason"] else ""))
    for e in status["events"][-10:]:
        print(f"  round {e['round']}: {e['site']} {e['kind']}: {e['reason'][:160]}")
    if status["claim"]:
        print(f"claim: {status['claim']}")
    return 0


def register(sub: Any) -> None:
    from fedpose.cli.main import add_config

    server = sub.add_parser("server", help="the federation server: prepare its data and weights, run and follow "
                                           "a federation, its status")
    ss = server.add_subparsers(dest="server_command", required=True)
    prep = ss.add_parser("prepare", help="make or check the public split, the validation split and the public "
                                         "pretrained weights; write a config with absolute paths (server.yaml)")
    add_config(prep, help="the federation's config, a file or a shipped name (default default)")
    prep.add_argument("--out", required=True, help="folder for server.yaml and for what the config's relative "
                                                    "paths name: the data, the weights (e.g. /srv/fedpose)")
    prep.add_argument("--quiet", action="store_true", help="no progress bars")
    prep.add_argument("--verbose", action="store_true", help="debug logging")
    prep.set_defaults(func=cmd_prepare)

    run = ss.add_parser("run", help="submit the federation with flwr run, follow it, exit 0 only if it finished "
                                    f"completed ({int(RUN_FAILED)}: failed, stopped or not submitted)",
                        description="Submit the federation with flwr run and follow it. Exit 0 only if it finished "
                                    f"completed; {int(RUN_FAILED)}: failed, stopped or not submitted.")
    run.add_argument("--connection", required=True, help="the SuperLink connection in $FLWR_HOME/config.toml "
                                                         "(e.g. pilot)")
    run.add_argument("--out", required=True, help="the run's results folder (on this machine)")
    run.add_argument("--config", default="server.yaml", help="the config `server prepare` wrote (default server.yaml)")
    run.add_argument("--app", default=".", help="the app folder fedpose server build-app wrote, whose bundle the "
                                                "sites approved (default: here)")
    run.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    run.add_argument("--timeout", type=float, default=24 * 3600.0, help="stop following after this many seconds "
                                                                       "(default one day)")
    run.add_argument("--poll", type=float, default=10.0, help="seconds between two looks at the run (default 10)")
    run.add_argument("--verbose", action="store_true", help="debug logging")
    run.set_defaults(func=cmd_run)

    from fedpose.cli.app_bundle import register as register_build_app
    from fedpose.cli.fleet_front import register as register_front
    from fedpose.cli.register_sites import register as register_sites

    register_build_app(ss)
    register_sites(ss)
    register_front(ss)

    st = ss.add_parser("status", help="a run folder's rounds, per-site spend against budget, events")
    st.add_argument("--out", required=True, help="the run's results folder")
    st.add_argument("--json", action="store_true", help="print one JSON object")
    st.add_argument("--verbose", action="store_true", help="debug logging")
    st.set_defaults(func=cmd_status)
