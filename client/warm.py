"""A warm start for the site's ClientApp processes: a fork server beside the SuperNode.

Flower 1.41 starts a new ``flwr-clientapp`` process for every message, and each one imported torch and
Flower's runtime again before it could look at its message: about 1.5 s of a site's time per message on a
2-core machine (``benchmarks/deploy_round.py``). ``fedpose site start`` therefore starts this server first:
it imports those libraries once and never runs anything else (no model, no data, no thread pool), and for
every message the site's gate shim (``fedpose.client.app_trust.write_shim``) asks it to fork a child that runs the
gated ClientApp exactly as the shim would have run it itself: same arguments, environment, working folder
and standard streams (passed over the socket), the approved list read again, the bundle installed fresh.
Each message still gets a process of its own; only the import work is shared, copy-on-write.

The socket is in a private folder (0700) of the site's user. When the server is not running, the shim
runs the gate itself (the cold path), so a site works the same with or without it.

    python -m fedpose.client.warm --socket PATH --approved FILE
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import signal
import socket
import struct
import sys
import threading
from collections.abc import Sequence
from typing import Any

# What a ClientApp process imports before it reaches its message: third-party only. The bundle's own modules
# (client, shared) are imported by each child from the checked bundle, never from this process.
PRELOAD = ("torch", "torch.func", "torch._dynamo", "torch._functorch.eager_transforms", "torch._inductor", "numpy",
           "cv2", "yaml", "statistics", "opacus", "opacus.accountants.analysis.rdp", "flwr.app", "flwr.clientapp",
           "flwr.supernode.runtime.run_clientapp", "flwr.supernode.cli.flwr_clientapp")
_HEADER = struct.Struct("!I")
MAX_REQUEST = 1 << 20


def send_frame(sock: socket.socket, payload: dict[str, Any], fds: Sequence[int] = ()) -> None:
    data = json.dumps(payload).encode()
    frame = _HEADER.pack(len(data)) + data
    if fds:
        socket.send_fds(sock, [frame], list(fds))
    else:
        sock.sendall(frame)


def recv_frame(sock: socket.socket, *, with_fds: int = 0) -> tuple[dict[str, Any], list[int]]:
    """One length-prefixed JSON frame (and up to ``with_fds`` file descriptors sent with its first bytes)."""
    fds: list[int] = []
    if with_fds:
        data, fds, _, _ = socket.recv_fds(sock, MAX_REQUEST + _HEADER.size, with_fds)
    else:
        data = sock.recv(MAX_REQUEST + _HEADER.size)
    if len(data) < _HEADER.size:
        raise ConnectionError("connection closed before a frame")
    (size,) = _HEADER.unpack(data[:_HEADER.size])
    if size > MAX_REQUEST:
        raise ValueError(f"frame of {size} bytes refused")
    body = data[_HEADER.size:]
    while len(body) < size:
        more = sock.recv(size - len(body))
        if not more:
            raise ConnectionError("connection closed inside a frame")
        body += more
    return json.loads(body[:size]), fds


def _child(request: dict[str, Any], fds: list[int], approved: str) -> None:
    """In the forked child: become the shim's process and run the gate; never returns."""
    code = 1
    try:
        for target, fd in zip((0, 1, 2), fds):
            os.dup2(fd, target)
        for fd in fds:
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
        sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
        from fedpose.client.app_trust import run_gate

        run_gate(["--approved", approved, "--", *request["argv"]])
        code = 0
    except SystemExit as done:  # Flower's ClientApp ends with sys.exit(code)
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except BaseException as err:  # noqa: BLE001 - reported on the shim's stderr, as the cold path would
        print(f"fedpose warm start: the ClientApp failed: {type(err).__name__}: {err}", file=sys.stderr)
    finally:
        try:
            atexit._run_exitfuncs()  # the gate's private FLWR_HOME is removed by an atexit hook
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _serve_one(conn: socket.socket, listener: socket.socket, approved: str) -> None:
    try:
        request, fds = recv_frame(conn, with_fds=3)
        if len(fds) != 3 or not isinstance(request.get("argv"), list) or not isinstance(request.get("env"), dict):
            raise ValueError("a request carries argv, env, cwd and three standard streams")
    except (OSError, ValueError) as err:
        print(f"fedpose warm start: bad request: {err}", file=sys.stderr, flush=True)
        conn.close()
        return
    pid = os.fork()
    if pid == 0:
        listener.close()
        conn.close()
        _child(request, fds, approved)
    for fd in fds:
        os.close(fd)

    def wait() -> None:
        try:
            send_frame(conn, {"pid": pid})
            _, status = os.waitpid(pid, 0)
            send_frame(conn, {"exit": os.waitstatus_to_exitcode(status)})
        except OSError:
            pass  # the shim went away; the child was still reaped above
        finally:
            conn.close()

    threading.Thread(target=wait, daemon=True).start()


def _end_with_parent() -> None:
    """Linux: get SIGTERM when the process that started this one dies (``fedpose site start`` killed -9)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def serve(socket_path: str, approved: str) -> None:
    """Import what a ClientApp needs, then fork one gated ClientApp per request on ``socket_path``."""
    _end_with_parent()
    for name in PRELOAD:
        __import__(name)
    if os.path.exists(socket_path):
        os.unlink(socket_path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        listener.bind(socket_path)
    finally:
        os.umask(old)
    listener.listen(16)
    print(f"fedpose warm start: ready on {socket_path}", flush=True)
    stop = threading.Event()

    def _stop(*_: object) -> None:
        stop.set()
        listener.close()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                break
            _serve_one(conn, listener, approved)
    finally:
        listener.close()
        if os.path.exists(socket_path):
            os.unlink(socket_path)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fedpose.client.warm", description=__doc__.splitlines()[0])
    parser.add_argument("--socket", required=True, help="the Unix socket to listen on")
    parser.add_argument("--approved", required=True, help="the site's approved bundles file (read per message)")
    args = parser.parse_args(argv)
    serve(args.socket, args.approved)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
