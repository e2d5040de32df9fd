"""``fedpose site start`` keeps the site's SuperNode running: started again after an exit the site did not ask
for, told apart from a key that another SuperNode holds.

flower-supernode exits with 1 on any error: a refused activation, a SuperLink it never reached, a crash;
and with 0 ("terminated gracefully") when it loses a SuperLink it had joined and gives up reconnecting
(--max-retries / --max-wait-time). Unless the site asked it to stop, both are started again. Usage errors
exit with 2 and are not retried.

The SuperLink refuses to activate a node whose key is still online (code 2004). Right after a crash of
this site's own SuperNode that is its old session, which the SuperLink drops once two heartbeats are
missed (Flower's default interval 30 s: about 60 s). Any longer, the key is held by another SuperNode that
keeps its heartbeats going: a copied kit. ``supervise`` tells the two apart by when a SuperNode of its own
was last connected (the ``alive`` file, touched while one is) and stops at once in the second case.

Flower 1.41 refuses a key the SuperLink does not know (not registered yet) with the very same answer:
FLEET_NODE_ACTIVATION_FAILED, code 2004, "Failed to activate SuperNode.", no public details (the reason,
"No SuperNode found with the given public key" or "could not be activated", goes to the SuperLink's log
only); and every other Fleet call with that key is refused alike ("Invalid node ID") unless the node id is
known. What tells them apart is that a key in use was registered: ``alive`` records (beside the pid) the
SHA-256 of the key its SuperNode connected with, and only a key that connected here before is taken for
one in use. A key that never did is waited for as not registered yet, for ``retry_for`` s, with the
operator's step named. Limits: a key that connected here and was then unregistered (or a SuperLink whose
state was lost, without its --database) reads as in use; a kit copied before its first connection whose
copy connected first reads as not registered, and waits.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from fedpose.cli.processes import become_subreaper, reap_orphans
from fedpose.shared.errors import ExitCode

_RETRYABLE_EXITS = (0, 1)
REFUSED_ACTIVATION = "[code: 2004]"  # what Flower's SuperNode prints when the SuperLink refuses to activate it
CONNECTED = "SuperNode ID:"  # ... and once it is activated
HEARTBEAT_INTERVAL = 30.0  # Flower's default (flwr.common.constant.HEARTBEAT_DEFAULT_INTERVAL)

KEY_IN_USE = ExitCode.BAD_INPUT


def _option(cmd: list[str], name: str) -> str | None:
    """The value of the first ``name VALUE`` or ``name=VALUE`` in ``cmd`` (None without one)."""
    for i, arg in enumerate(cmd):
        if arg == name and i + 1 < len(cmd):
            return cmd[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def _heartbeat_interval(cmd: list[str]) -> float:
    value = _option(cmd, "--heartbeat-interval")
    try:
        return HEARTBEAT_INTERVAL if value is None else max(float(value), HEARTBEAT_INTERVAL)
    except ValueError:
        return HEARTBEAT_INTERVAL


def _key_id(cmd: list[str]) -> str:
    """SHA-256 of the SuperNode's --auth-supernode-private-key file ("" without one, or when it cannot be read)."""
    path = _option(cmd, "--auth-supernode-private-key")
    if path is None:
        return ""
    try:
        return hashlib.sha256(Path(path).expanduser().read_bytes()).hexdigest()
    except OSError:
        return ""


def _recorded(alive: Path | None) -> tuple[int, str]:
    """The pid and key SHA-256 that ``alive`` records (0 and "" when there is none)."""
    try:
        fields = alive.read_text().split() if alive is not None else []
        return int(fields[0]) if fields else 0, fields[1] if len(fields) > 1 else ""
    except (OSError, ValueError):
        return 0, ""


def _last_alive(alive: Path | None) -> float:
    """Seconds since a SuperNode of this site was last connected (inf when none ever was, here)."""
    try:
        return time.time() - alive.stat().st_mtime if alive is not None else float("inf")
    except OSError:
        return float("inf")


def _mark_alive(alive: Path, key: str) -> None:
    alive.parent.mkdir(parents=True, exist_ok=True)
    alive.write_text(f"{os.getpid()} {key}\n" if key else f"{os.getpid()}\n")


def _other_holder(alive: Path | None, key: str) -> int | None:
    """The pid of another ``site start`` of this very folder whose SuperNode is connected now with ``key``."""
    try:
        pid, held = _recorded(alive) if _last_alive(alive) < 30.0 else (0, "")
        if pid and pid != os.getpid() and key and held == key:
            os.kill(pid, 0)
            return pid
    except (OSError, ValueError, IndexError):
        pass
    return None


def _follow(child: Any, alive: Path | None, key: str, seen: dict[str, bool], stop: threading.Event) -> None:
    """Pass the SuperNode's output on, line by line; note a refused activation; touch ``alive`` while connected."""
    for line in child.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        if REFUSED_ACTIVATION in line:
            seen["refused"] = True
        if CONNECTED in line and alive is not None:
            seen["connected"] = True
            _mark_alive(alive, key)
    stop.set()


def _keep_alive(alive: Path | None, key: str, seen: dict[str, bool], stop: threading.Event) -> None:
    while not stop.wait(10.0):
        if alive is not None and seen.get("connected"):
            _mark_alive(alive, key)


def supervise(cmd: list[str], env: dict[str, str], *, retry_for: float, pause: float,
              keep: frozenset[int] = frozenset(), alive: Path | None = None) -> int:
    """Run the SuperNode; after an exit the site did not ask for (an error, or a clean exit after giving up on
    its SuperLink), start it again, until it has failed for ``retry_for`` s.

    A SuperNode restarted right after a crash is refused by the SuperLink ("Failed to activate
    SuperNode", code 2004) until the SuperLink drops the crashed session (about 60 s: two missed
    heartbeats); a refusal of a key that connected here before, when no SuperNode of this site was
    connected for longer than that, means another SuperNode holds the key: it stops at once (exit 3). A
    key that never connected here is taken for one not registered yet and waited for. One whose
    SuperLink restarted gives up
    after its --max-retries / --max-wait-time and exits with 0. Both come back by starting again.
    SIGTERM / SIGINT go to the SuperNode and end the supervision.
    """
    import signal
    import subprocess

    stopping = False
    child: subprocess.Popen | None = None
    lapse = 2 * _heartbeat_interval(cmd) + 20.0  # its last heartbeat may follow our last mark by 10 s
    key = _key_id(cmd)

    def forward(signum: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    reaper = become_subreaper()
    failing_since: float | None = None
    while True:
        started = time.monotonic()
        child = subprocess.Popen(cmd, env={**env, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, bufsize=1, errors="replace")
        seen: dict[str, bool] = {}
        done = threading.Event()
        reader = threading.Thread(target=_follow, args=(child, alive, key, seen, done), daemon=True)
        beat = threading.Thread(target=_keep_alive, args=(alive, key, seen, done), daemon=True)
        reader.start()
        beat.start()
        code = child.wait()
        if reaper:
            reap_orphans(keep)  # its SuperExec would otherwise outlive it and attach to the next SuperNode
        reader.join(timeout=5.0)  # its output ends once the SuperExec it started is gone too
        done.set()
        if stopping or code not in _RETRYABLE_EXITS:
            return code
        other = _other_holder(alive, key)
        refused = bool(seen.get("refused") and not seen.get("connected"))
        used_here = bool(key) and _recorded(alive)[1] == key  # only a registered key ever connects
        if refused and (other or (used_here and _last_alive(alive) > lapse)):
            where = (f"started from this same folder (fedpose site start, pid {other})" if other else
                     f"elsewhere (no SuperNode of this site was connected here in the last {lapse:.0f} s, so it is "
                     "not an old session of this one)")
            print(f"fedpose site start: the SuperLink refuses this site's key because it is already in use by another "
                  f"SuperNode, connected now, {where}. A copied kit? Each site runs one SuperNode with its own key "
                  "(fedpose site keygen); stop the other one, or make a new key and ask the operator to register "
                  "it.", flush=True)
            return KEY_IN_USE
        now = time.monotonic()
        if now - started > 2 * pause:  # it ran for a while: a new failure, not the same one again
            failing_since = None
        failing_since = failing_since if failing_since is not None else started
        unregistered = refused and not used_here
        if now - failing_since >= retry_for:
            print(f"fedpose site start: the SuperNode kept failing for {now - failing_since:.0f} s "
                  f"(--retry-for {retry_for:.0f}): giving up; " + (
                      "this site's key is still not registered with the SuperLink: ask the operator to run "
                      "`fedpose server register-sites` with this site's .pub key, then start again" if unregistered
                      else "see the errors above"), flush=True)
            return code
        what = "stopped on its own (it gives up when its SuperLink stays away)" if code == 0 else \
            "exited with an error"
        why = ("The SuperLink does not know this site's key: it is not registered yet (it never connected "
               "here). The operator registers it with `fedpose server register-sites` (the server kit's "
               "register-sites.sh); this site connects once that is done. (Flower gives the same answer, "
               "code 2004, for a key another SuperNode already uses.)" if unregistered else
               f"The SuperLink still holds this site's previous session (a crash {_last_alive(alive):.0f} s ago); "
               f"it drops it within about {lapse:.0f} s of the crash." if refused else
               "A key that was never registered is refused every time.")
        print(f"fedpose site start: the SuperNode {what}; starting it again in {pause:.0f} s "
              f"(failing for {now - failing_since:.0f} of at most {retry_for:.0f} s). {why}", flush=True)
        time.sleep(pause)
        if stopping:
            return code
