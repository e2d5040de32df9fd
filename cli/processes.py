"""Processes that must not outlive the command that started them (Linux: prctl; elsewhere a no-op).

Flower's SuperLink and SuperNode start helpers detached (new sessions), which then outlive a killed
parent. A *subreaper* inherits every orphan of its descendants instead of init, so it can find and
stop them; ``guard`` runs a command that way and also dies, taking everything with it, when its own
parent dies, even by kill -9 (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

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


def start_warm(approved: Path) -> tuple[Any, Path] | None:
    """Start the warm-start server (``fedpose.client.warm``) on a socket in a private folder; None if it cannot
    start."""
    folder = Path(tempfile.mkdtemp(prefix="fedpose-warm-"))  # 0700, and short: a socket path has 107 bytes at most
    sock = folder / "clientapp.sock"
    proc = subprocess.Popen([sys.executable, "-m", "fedpose.client.warm", "--socket", str(sock), "--approved",
                             str(approved)])
    deadline = time.monotonic() + 60
    while not sock.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    if not sock.exists():
        print("fedpose site start: the warm-start server did not come up; every ClientApp starts cold", flush=True)
        stop_warm(proc, sock)
        return None
    return proc, sock


def stop_warm(proc: Any, sock: Path) -> None:
    """Stop the warm-start server and remove its private folder."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
    shutil.rmtree(sock.parent, ignore_errors=True)


if __name__ == "__main__":  # python -m fedpose.cli.processes -- CMD...: what LocalSuperLink runs
    args = sys.argv[1:]
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        raise SystemExit("usage: python -m fedpose.cli.processes -- COMMAND [ARGS...]")
    raise SystemExit(guard(args))
