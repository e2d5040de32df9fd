"""``fedpose server run``: the federation submitted to the SuperLink with ``flwr run``, followed to its end.

``flwr run`` itself returns 0 as soon as the run is submitted; ``submit_run`` follows it (``flwr ls``), prints
each round of the run folder's rounds.jsonl as it lands, and returns 0 only when the run finished completed.
A run that failed says why in one line (the server's outcome.json), any other ending prints the end of its
log (``flwr log``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from fedpose.shared.errors import ExitCode

# ``fedpose server run``: 0 finished completed; FAILED when the run failed, was stopped or was not submitted.
RUN_FAILED = NOT_SUBMITTED = ExitCode.FAILED


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


def submit_run(app: str | Path, connection: str, out: str | Path, *, config: str | Path, resume: bool = False,
               timeout: float = 24 * 3600.0, poll: float = 10.0) -> int:
    """Submit, follow, and say plainly how the run ended: 0 only when it finished completed, else ``RUN_FAILED``
    (``NOT_SUBMITTED`` when ``flwr run`` did not take it)."""
    app = Path(app).expanduser().resolve()
    if not (app / "pyproject.toml").is_file():
        raise FileNotFoundError(f"no Flower app at {app} (it needs pyproject.toml): give --app the folder "
                                "`fedpose server build-app --out DIR` wrote, whose bundle the sites approved")
    out = Path(out).expanduser().resolve()
    if not resume and (out / "ledger.sqlite").exists():
        raise ValueError(f"{out} already holds a federation: continue it with --resume, or choose another --out "
                         "(nothing was submitted)")
    rounds = out / "rounds.jsonl"
    # rounds an earlier run of this folder wrote are not this run's: only later lines are printed
    seen = len([line for line in rounds.read_text().splitlines() if line.strip()]) if rounds.is_file() else 0
    parts = [f"out='{out}'"]
    if resume:
        parts.append("resume=true")
    else:
        parts.append(f"config='{Path(config).expanduser().resolve()}'")
    submitted_at = time.time() - 1.0
    submitted = _flwr("run", str(app), connection, "--format", "json", "--run-config", " ".join(parts))
    try:
        run_id = int(json.loads(submitted.stdout)["run-id"])
    except (ValueError, KeyError, TypeError):
        print(f"fedpose server run: the run was not submitted: {(submitted.stdout + submitted.stderr).strip()[-800:]}",
              file=sys.stderr)
        return NOT_SUBMITTED
    print(f"submitted run {run_id} to {connection}; results in {out}", flush=True)
    if seen:
        print(f"resuming after the {seen} round(s) {rounds} already holds", flush=True)
    status, deadline = "", time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = _status_of(connection, run_id)
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
        time.sleep(poll)
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
              f"{connection} --show)", file=sys.stderr)
        return RUN_FAILED
    log = _flwr("log", str(run_id), connection, "--show", timeout=120).stdout
    why = status or f"still running after --timeout {timeout:.0f} s"
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
