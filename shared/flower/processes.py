"""Processes that must not outlive the command that started them (Linux: prctl; elsewhere a no-op).

Flower's SuperLink and SuperNode start helpers detached (new sessions), which then outlive a killed
parent. A *subreaper* inherits every orphan of its descendants instead of init, so it can find and
stop them; ``guard`` runs a command that way and also dies, taking everything with it, when its own
parent dies, even by kill -9 (``PR_SET_PDEATHSIG``).

Both sides use them: the server's front (``fedpose.server.front``) and a local simulation
(``fedpose.shared.flower.simulation``) run the SuperLink under ``guard`` (``python -m
fedpose.shared.flower.processes -- CMD...``); a site's SuperNode supervisor (``fedpose.client.supernode``)
is a subreaper that reaps what each SuperNode left behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> bool:
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def become_subreaper() -> bool:
    """Processes our children leave behind are re-parented to this one (not to init)."""
    return _prctl(PR_SET_CHILD_SUBREAPER, 1)


def reap_orphans(keep: frozenset[int] = frozenset()) -> None:
    """Kill and reap every child of this process but ``keep``, then theirs as they are re-parented here (a
    subreaper)."""
    me = os.getpid()
    while True:
        orphans = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == me and int(stat.parent.name) not in keep:
                orphans.append(int(stat.parent.name))
        if not orphans:
            return
        for pid in orphans:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in orphans:  # reap them (their own children are re-parented to us next)
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


def guard(cmd: list[str]) -> int:
    """Run ``cmd``; when this process's parent dies (or it gets SIGTERM/SIGINT) stop ``cmd`` and every process
    it left behind. Returns ``cmd``'s exit code."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    become_subreaper()
    child = subprocess.Popen(cmd)

    def stop(signum: int, _frame: object) -> None:
        if child.poll() is None:
            child.send_signal(signal.SIGKILL)
        reap_orphans()
        os._exit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    if os.getppid() == 1:  # the parent was already gone before the death signal was armed
        stop(signal.SIGTERM, None)
    code = child.wait()
    reap_orphans()
    return code


if __name__ == "__main__":  # python -m fedpose.shared.flower.processes -- CMD...: what the front and LocalSuperLink run
    args = sys.argv[1:]
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        raise SystemExit("usage: python -m fedpose.shared.flower.processes -- COMMAND [ARGS...]")
    raise SystemExit(guard(args))
