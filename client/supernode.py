"""The site's SuperNode as ``fedpose site start`` runs it: behind the site's gate, looking for messages at the
site's own interval, a warm-start server beside it, and started again after an exit the site did not ask for,
told apart from a key that another SuperNode holds.

``start_site`` is the command's whole run: the SuperNode's arguments checked, the site's own checks of its
policy (``check``: the CLI's report), the gate shim written (``fedpose.client.app_trust``), the warm-start
server (``fedpose.client.warm``) started, then ``supervise``.

Polling. Flower 1.41's SuperNode asks the SuperLink for a message and, when there is none, sleeps 3 s before it asks
again; once a ClientApp has started on a message, it looks for the reply every 0.5 s. Every round therefore
starts up to 3 s late at each site (1.5 s on average, and the round waits for its slowest site), and ends up
to 0.5 s late. Flower has no setting for either wait, so ``fedpose site start`` runs the same
``flower-supernode`` entry point through this module (``main``), which caps the waits of Flower's SuperNode loop
(``flwr.supernode.start_client_internal``) at ``--poll`` seconds. Nothing else changes: the same arguments,
the same code, the same messages; an idle site sends the SuperLink one small pull request per ``--poll``
seconds instead of one per 3 s. The SuperNode's pulls of a message's objects retry after 0.05 s instead of
Flower's 1 s (``fedpose.shared.flower.waits``).

When the installed Flower no longer has that loop (another version), the SuperNode runs unchanged and says
so on stderr: the site still works, with Flower's own waits.

    python -m fedpose.client.supernode --poll 0.2 -- <flower-supernode arguments>

Supervision. flower-supernode exits with 1 on any error: a refused activation, a SuperLink it never reached, a crash;
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

import argparse
import hashlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fedpose.shared.errors import ExitCode
from fedpose.shared.flower.processes import become_subreaper, reap_orphans
from fedpose.shared.flower.waits import FLOWER_IDLE_WAIT, CappedTime, cap_waits, quick_pulls

LOOP_MODULE = "flwr.supernode.start_client_internal"


# ---------------------------------------------------------------------------
# the SuperNode's command: Flower's, checked, with the site's policy
# ---------------------------------------------------------------------------


def _supernode_args(rest: list[str]) -> list[str]:
    args = rest[1:] if rest and rest[0] == "--" else rest
    for i, arg in enumerate(args):
        if arg == "--isolation" and i + 1 < len(args) and args[i + 1] != "subprocess" or arg.startswith(
                "--isolation=") and arg != "--isolation=subprocess":
            raise ValueError("fedpose site start gates the ClientApp processes the SuperNode starts itself: "
                             "use the default --isolation subprocess (with --isolation process, put the gate "
                             "directory first on the PATH of your own flower-superexec instead)")
    return args


def _with_policy(supernode_args: list[str], policy: Path) -> list[str]:
    """The SuperNode arguments with ``--node-config site-policy=...`` naming ``policy`` (added when absent)."""
    for i, arg in enumerate(supernode_args):
        value = supernode_args[i + 1] if arg == "--node-config" and i + 1 < len(supernode_args) else (
            arg.split("=", 1)[1] if arg.startswith("--node-config=") else None)
        if value is not None and "site-policy" in value:
            named = value.split("site-policy", 1)[1].lstrip(" =").strip("'\"")
            if Path(named).expanduser().resolve() != policy:
                raise ValueError(f"--policy {policy} but the SuperNode's --node-config names {named}: give one")
            return supernode_args
    return [*supernode_args, "--node-config", f"site-policy='{policy}'"]


def supernode_command(*, poll: float) -> list[str]:
    """The SuperNode's command (its arguments follow): Flower's SuperNode through this module's ``main`` when the
    site looks for messages more often than Flower's 3 s, else Flower's own ``flower-supernode`` (found beside
    this Python first, then on PATH)."""
    CappedTime(poll)  # refuses a poll outside (0, 3] before anything starts
    if poll < FLOWER_IDLE_WAIT:
        if importlib.util.find_spec("flwr.supernode") is None:
            raise FileNotFoundError("Flower's SuperNode is not installed: install fedpose (it depends on flwr) in "
                                    "this environment")
        return [sys.executable, "-m", "fedpose.client.supernode", "--poll", repr(poll), "--"]
    exe = shutil.which("flower-supernode", path=os.pathsep.join(
        [str(Path(sys.executable).parent), *filter(None, [os.environ.get("PATH")])]))
    if exe is None:
        raise FileNotFoundError("flower-supernode is not beside this Python nor on PATH: install fedpose (it "
                                "depends on flwr) in this environment")
    return [exe]


# ---------------------------------------------------------------------------
# the warm-start server beside it (fedpose.client.warm)
# ---------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------
# supervision: started again after an exit the site did not ask for
# ---------------------------------------------------------------------------

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
        refused = bool(seen.get("refused") and not seen.get("connected"))
        used_here = bool(key) and _recorded(alive)[1] == key  # only a registered key ever connects
        # (a second start from this folder never gets here: the folder's start lock stops it first)
        if refused and used_here and _last_alive(alive) > lapse:
            where = (f"elsewhere (no SuperNode of this site was connected here in the last {lapse:.0f} s, so it is "
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


def start_site(approved: str | Path, supernode_args: Sequence[str], *, policy: str | Path | None,
               check: Callable[[Any, Path], None], gate_dir: str | Path | None, retry_for: float, retry_pause: float,
               cold: bool, poll: float) -> int:
    """``fedpose site start``: the SuperNode with ``supernode_args``, gated by the ``approved`` file, supervised
    until it stops for good; returns its exit code. With a ``policy``, ``check(policy, path)`` runs the site's own
    checks of it first (once, not per message) and the SuperNode is started with it. A second start of a site
    whose ``site start`` runs from the same folder says so and returns 3 before anything else."""
    args = _supernode_args(list(supernode_args))
    supernode = supernode_command(poll=poll)  # a bad --poll or no Flower: refused before any check runs
    approved = Path(approved).expanduser().resolve()
    gates = Path(gate_dir).expanduser() if gate_dir else approved.parent / "gate-bin"
    if retry_for < 0:
        raise ValueError(f"--retry-for: must be >= 0 seconds, got {retry_for}")
    lock = _hold_site(gates)
    if isinstance(lock, int):
        print(f"fedpose site start: this site is already running from this folder (fedpose site start, pid {lock}; "
              f"{gates / START_LOCK}): nothing started. Each site runs one SuperNode; stop that one first "
              "(or see it with fedpose site status).", flush=True)
        return KEY_IN_USE
    try:
        return _start_held(approved, gates, args, supernode, policy=policy, check=check, retry_for=retry_for,
                           retry_pause=retry_pause, cold=cold, poll=poll)
    finally:
        lock.close()  # releases the lock


START_LOCK = "site-start.lock"


def _hold_site(gates: Path) -> Any:
    """Take this site folder's start lock (an open file, held until closed), or return the pid of the ``site start``
    that holds it: a site runs one SuperNode, and a second one would rerun its checks, then find its ports taken."""
    import fcntl

    gates.mkdir(parents=True, exist_ok=True)
    fh = open(gates / START_LOCK, "a+")  # noqa: SIM115 - held for the whole run, closed by the caller
    try:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.seek(0)
        text = fh.read().strip()
        fh.close()
        return int(text) if text.isdigit() else 0
    fh.seek(0)
    fh.truncate()
    fh.write(f"{os.getpid()}\n")
    fh.flush()
    return fh


def _start_held(approved: Path, gates: Path, args: list[str], supernode: list[str], *, policy: str | Path | None,
                check: Callable[[Any, Path], None], retry_for: float, retry_pause: float, cold: bool,
                poll: float) -> int:
    """``start_site`` once it holds the site's start lock: the checks, the gate, the warm-start server, the
    supervised SuperNode."""
    from fedpose.client.app_trust import gated_env, load_approved, write_shim

    if policy:
        from fedpose.client.policy import load_policy

        policy_path = Path(policy).expanduser().resolve()
        check(load_policy(policy_path), policy_path)  # the checks that read private data run here, once
        args = _with_policy(args, policy_path)
    digests = load_approved(approved)
    warm = None if cold else start_warm(approved)
    try:
        shim = write_shim(gates, approved=approved, warm_socket=warm[1] if warm else None)
        env = gated_env(shim.parent)
        # Flower's SuperExec looks for a new message every second by default; a site answers sooner at 0.1 s.
        env.setdefault("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", "0.1")
        print(f"SuperNode runs only app bundles approved in {approved} ({len(digests)} digest"
              f"{'s' if len(digests) != 1 else ''}); gate {shim}"
              + ("; ClientApps forked warm" if warm else "; every ClientApp started cold")
              + f"; looks for messages every {poll:g} s", flush=True)
        return supervise([*supernode, *args], env, retry_for=retry_for, pause=retry_pause,
                         keep=frozenset({warm[0].pid}) if warm else frozenset(), alive=gates / "supernode.alive")
    finally:
        if warm is not None:
            stop_warm(*warm)


# ---------------------------------------------------------------------------
# python -m fedpose.client.supernode: Flower's SuperNode, looking for messages at the site's interval
# ---------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m fedpose.client.supernode --poll S -- ARGS``: Flower's ``flower-supernode ARGS`` with its waits
    capped at ``S`` seconds (the command ``supernode_command`` gives a site that polls more often than 3 s)."""
    parser = argparse.ArgumentParser(prog="python -m fedpose.client.supernode",
                                     description="Flower's SuperNode with its message polling at the site's interval")
    parser.add_argument("--poll", type=float, default=0.2,
                        help=f"seconds between two looks for a message or a reply (Flower's own: "
                             f"{FLOWER_IDLE_WAIT:g} and 0.5; default 0.2)")
    parser.add_argument("supernode_args", nargs=argparse.REMAINDER, help="-- then the flower-supernode arguments")
    args = parser.parse_args(argv)
    rest = list(args.supernode_args)
    if rest[:1] == ["--"]:
        rest = rest[1:]
    loop = importlib.import_module(LOOP_MODULE)
    if not cap_waits(loop, args.poll):  # refuses a --poll outside (0, 3] before anything starts
        print(f"fedpose site start: this Flower's SuperNode loop ({LOOP_MODULE}) does not wait through the time "
              "module; its own polling intervals apply", file=sys.stderr, flush=True)
    if not quick_pulls(loop, "pull_objects"):
        print(f"fedpose site start: this Flower's SuperNode loop ({LOOP_MODULE}) has no pull_objects to shorten; "
              "its own retry waits apply", file=sys.stderr, flush=True)
    from flwr.supernode.cli import flower_supernode

    sys.argv = ["flower-supernode", *rest]
    flower_supernode()


if __name__ == "__main__":
    main()
