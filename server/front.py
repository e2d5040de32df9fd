"""The server's front (``fedpose server front``): the server's public address serves the Fleet API and nothing else.

Flower's SuperLink (1.41) serves three APIs on one HTTP listener (``--host``/``--port``): the Fleet API
the SuperNodes use (``/v1/fleet/...``), the Control API of ``flwr run | ls | stop | supernode ...``
(``/v1/control/...``) and the Runtime API of its own ServerApp and SuperExec (``/v1/runtime/...``). The
Control API checks no credential of its caller, and a site's kit holds nothing secret, so a SuperLink
listening on the sites' address lets any site list the runs or unregister another site's SuperNode.

The server kit therefore binds the SuperLink to 127.0.0.1 (the operator's ``flwr`` and ``fedpose
server run`` use it there) and runs this front on the public address. It terminates TLS with the
server's certificate and forwards, over TLS, exactly the Fleet API's routes as Flower declares them
(method and path, compared whole) and ``GET``/``HEAD /health``; every other request gets 404 without
reaching the SuperLink. The SuperNodes' own authentication headers are passed on unchanged: the
SuperLink still checks them.

Until the SuperLink has checked a request's credentials, its sender is anyone who can reach the address, so
the front bounds what it gives one (``Limits``): a request body larger than the largest a site sends (its
reply: the model's weights; ``body_limit_mib`` derives it from the federation's config, and the server kit's
start script passes it) is answered 413 from its Content-Length, before any of it is read, and a body is
streamed to the SuperLink, never held whole; a connection that has not sent a complete request's headers
within ``header_timeout`` seconds of opening, or of its previous answer, is closed; and connections beyond
``max_connections`` are closed as they open. uvicorn's own protocol starts no timer before a first request
and checks its concurrency limit only once a request's headers are complete, so both bounds live in a
subclass of its h11 protocol (``guarded_protocol``).

Given a command after ``--`` (the SuperLink's), the front starts it under ``fedpose.shared.flower.processes``' guard,
waits for it to answer, serves until it exits (and exits with its code) or until the front is
stopped (and stops it, with everything it started). A command that would make the SuperLink listen on
every interface, or on the front's own address, is refused.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import math
import ssl
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("fedpose.front")

# Headers that belong to one connection, not to the request (RFC 9110, 7.6.1), and those httpx or uvicorn set.
_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
                  "te", "trailer", "transfer-encoding", "upgrade", "host", "content-length"})
HEALTH = "/health"
MIB = 1 << 20
# Flower 1.41 sends each array in objects of at most 5 MiB (FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE): a cap never
# goes below one of those with its framing, however small the model.
MIN_BODY_MIB = 8


@dataclass(frozen=True)
class Limits:
    """What the front grants a peer before the SuperLink has checked who it is: the largest request body (MiB),
    the seconds a connection has to send a complete request's headers (after opening, and after each answer),
    and how many connections it holds at once."""

    max_body_mib: int = 64
    header_timeout: float = 10.0
    max_connections: int = 128

    def __post_init__(self) -> None:
        if isinstance(self.max_body_mib, bool) or not isinstance(self.max_body_mib, int) or self.max_body_mib < 1:
            raise ValueError(f"max_body_mib={self.max_body_mib!r}: expected a whole number of MiB >= 1")
        if not (math.isfinite(self.header_timeout) and self.header_timeout > 0):
            raise ValueError(f"header_timeout={self.header_timeout!r}: expected a number of seconds > 0")
        if isinstance(self.max_connections, bool) or not isinstance(self.max_connections, int) \
                or self.max_connections < 1:
            raise ValueError(f"max_connections={self.max_connections!r}: expected a whole number >= 1")

    @property
    def max_body(self) -> int:
        return self.max_body_mib * MIB


def body_limit_mib(cfg: Any) -> int:
    """The body cap (MiB) for a federation of config ``cfg``: the largest request a site sends is its reply, the
    model's every tensor as float32 (``weights_record``), plus a quarter and 1 MiB for the record's layout, the
    metrics and the framing. The basis V is not counted: it travels from the server to the sites only, in the
    SuperLink's answers, which the front does not cap."""
    from fedpose.shared.model.posenet import build_model

    model = build_model(cfg.model, cfg.data.input_size)
    weights = 4 * sum(t.numel() for t in model.state_dict().values())  # float32 on the wire
    return max(MIN_BODY_MIB, math.ceil(weights * 5 / 4 / MIB) + 1)


def fleet_routes() -> frozenset[tuple[str, str]]:
    """(method, path) of every route of Flower's Fleet API, read from Flower's own router."""
    from flwr.superlink.routers.fleet.router import router

    declared: list[Any] = router.routes  # FastAPI's APIRoutes: each has its path and its methods
    routes = frozenset((method, route.path) for route in declared for method in route.methods)
    if not routes or any(not path.startswith("/v1/fleet/") for _, path in routes):
        raise RuntimeError(f"Flower's Fleet API router has unexpected routes: {sorted(routes)}")
    return routes


def allowed_routes() -> frozenset[tuple[str, str]]:
    """What the front passes: the Fleet API and the health check; nothing else."""
    return fleet_routes() | {("GET", HEALTH), ("HEAD", HEALTH)}


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def _bind_all(host: str) -> bool:
    return host in ("", "0.0.0.0", "::", "*")


def check_superlink_command(cmd: list[str], *, listen: tuple[str, int], upstream: tuple[str, int]) -> None:
    """Refuse a SuperLink command whose listener is not the front's upstream: every interface, the public
    address, or another address than ``upstream`` (its Control API would then be reachable there)."""
    host, port = "127.0.0.1", 8000  # flower-superlink's defaults
    for i, arg in enumerate(cmd):
        value = arg.split("=", 1)[1] if "=" in arg else (cmd[i + 1] if i + 1 < len(cmd) else "")
        if arg == "--host" or arg.startswith("--host="):
            host = value
        elif arg == "--port" or arg.startswith("--port="):
            port = int(value) if value.isdigit() else -1
    if _bind_all(host) or (host, port) == listen or (host, port) != upstream:
        raise ValueError(f"the SuperLink would listen on {host}:{port}; it must listen on the front's upstream "
                         f"{upstream[0]}:{upstream[1]} only (its Control API answers anyone who reaches it)")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _BodyBroken(Exception):
    """The request's body did not arrive as its Content-Length declared (the peer went away, or sent more)."""


async def _counted_body(receive: Any, length: int) -> Any:
    """The request's body as it arrives, chunk by chunk, never more than ``length`` bytes in all."""
    got = 0
    while got < length:
        message = await receive()
        if message["type"] != "http.request":
            raise _BodyBroken(f"the peer went away after {got} of {length} bytes")
        chunk = message.get("body", b"")
        got += len(chunk)
        if got > length:
            raise _BodyBroken(f"more than the {length} bytes declared")
        if chunk:
            yield chunk
        if not message.get("more_body", False):
            break
    if got != length:
        raise _BodyBroken(f"{got} of {length} bytes")


def make_app(upstream: str, ca: Path, *, timeout: float = 300.0, limits: Limits = Limits()) -> Any:
    """The front as an ASGI app: Fleet API routes and /health forwarded to ``https://upstream``, the rest 404;
    a body over ``limits.max_body`` gets 413 before any of it is read."""
    import httpx
    from starlette.background import BackgroundTask
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse, StreamingResponse

    allowed = allowed_routes()
    verify = ssl.create_default_context(cafile=str(ca))
    client: dict[str, httpx.AsyncClient] = {}

    async def app(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    client["c"] = httpx.AsyncClient(base_url=f"https://{upstream}", verify=verify,
                                                    timeout=httpx.Timeout(timeout, connect=10.0),
                                                    follow_redirects=False, trust_env=False)
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    if "c" in client:
                        await client["c"].aclose()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        request = Request(scope, receive)
        # The decoded path and the raw one must both be exactly an allowed route: no query, no encoding, no
        # dot segments, no double slashes; what is forwarded is the route's own path, never the request's.
        raw = scope.get("raw_path", b"").decode("latin-1")
        key = (request.method, scope["path"])
        if key not in allowed or raw != scope["path"] or scope.get("query_string"):
            peer = scope.get("client") or ("?", 0)
            log.warning("refused %s %r from %s (not the Fleet API)", request.method, raw or scope["path"], peer[0])
            await PlainTextResponse("not served on this address\n", status_code=404)(scope, receive, send)
            return
        peer = (scope.get("client") or ("?", 0))[0]
        if "transfer-encoding" in request.headers:  # a site's SuperNode declares its body's length
            log.warning("refused %s %s from %s: a body without Content-Length", request.method, key[1], peer)
            await PlainTextResponse("send Content-Length\n", status_code=411,
                                    headers={"connection": "close"})(scope, receive, send)
            return
        # h11 has checked the header's form; its value decides before a byte of the body is read
        length = int(request.headers.get("content-length") or 0)
        if length > limits.max_body:
            log.warning("refused %s %s from %s: a body of %d bytes, over the cap of %d MiB (--max-body-mib)",
                        request.method, key[1], peer, length, limits.max_body_mib)
            await PlainTextResponse(f"request body over {limits.max_body_mib} MiB\n", status_code=413,
                                    headers={"connection": "close"})(scope, receive, send)
            return
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP]
        content: Any = b""
        if length:  # streamed on as it arrives, under its declared length (httpx then sends no chunked framing)
            headers.append(("content-length", str(length)))
            content = _counted_body(receive, length)
        try:
            upstream_request = client["c"].build_request(request.method, key[1], headers=headers, content=content)
            response = await client["c"].send(upstream_request, stream=True)
        except (httpx.HTTPError, _BodyBroken) as exc:
            log.warning("the SuperLink did not answer %s %s: %s", request.method, key[1], exc)
            await PlainTextResponse("the SuperLink is not reachable\n", status_code=502)(scope, receive, send)
            return
        out_headers = {k: v for k, v in response.headers.items() if k.lower() not in _HOP}
        await StreamingResponse(response.aiter_raw(), status_code=response.status_code, headers=out_headers,
                                background=BackgroundTask(response.aclose))(scope, receive, send)

    return app


def guarded_protocol(limits: Limits) -> type:
    """uvicorn's h11 protocol with the two bounds it lacks (``uvicorn.Config(http=...)`` takes the class): a
    header timer, started when a connection opens and again when each answer is complete, that closes the
    connection unless a request's headers have arrived by then; and ``limits.max_connections`` connections at
    most, counted as each opens (uvicorn counts them only once a request's headers are complete)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        header_timer: asyncio.TimerHandle | None = None
        answered = 0

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                log.warning("closed a connection from %s: %d connections open, the most this front holds "
                            "(--max-connections)", self._peer(), limits.max_connections)
                transport.abort()
                return
            self._start_header_timer()

        def on_response_complete(self) -> None:
            self.answered += 1
            super().on_response_complete()  # may start a pipelined request: the timer then finds it under way
            self._start_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

        def _peer(self) -> str:
            return self.client[0] if self.client else "?"

        def _start_header_timer(self) -> None:
            self._cancel_header_timer()
            if not self.transport.is_closing():
                self.header_timer = self.loop.call_later(limits.header_timeout, self._headers_late)

        def _cancel_header_timer(self) -> None:
            if self.header_timer is not None:
                self.header_timer.cancel()
                self.header_timer = None

        def _headers_late(self) -> None:
            self.header_timer = None
            if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
                return  # a request is under way: the timer starts again once it is answered
            pending = len(self.conn.trailing_data[0])
            if pending or not self.answered:  # not a keep-alive connection that merely went quiet
                log.warning("closed a connection from %s: no complete request headers within %g s (%d bytes of "
                            "them)", self._peer(), limits.header_timeout, pending)
            self.transport.abort()

    return GuardedH11Protocol


def healthy(upstream: str, ca: Path) -> bool:
    """Whether ``upstream`` (HOST:PORT, a SuperLink or this front) answers its health route over TLS with ``ca``."""
    import urllib.request

    ctx = ssl.create_default_context(cafile=str(ca))
    try:
        with urllib.request.urlopen(f"https://{upstream}{HEALTH}", context=ctx, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def _start_superlink(cmd: list[str]) -> subprocess.Popen:
    # Under shared.flower.processes' guard: it and the SuperExec it starts die with the front, even by kill -9.
    return subprocess.Popen([sys.executable, "-m", "fedpose.shared.flower.processes", "--", *cmd])


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def serve(listen: str, upstream: str, *, ca: Path, cert: Path, key: Path, superlink: list[str] | None = None,
          start_timeout: float = 120.0, limits: Limits = Limits()) -> int:
    """Serve the front on ``listen`` until stopped (0), or until the SuperLink it started exits (its code)."""
    host, port = split_address(listen)
    up_host, up_port = split_address(upstream)
    for path in (ca, cert, key):
        if not Path(path).is_file():
            raise FileNotFoundError(f"{path} not found")
    if not _is_loopback(up_host):
        log.warning("the SuperLink is at %s: make sure that address is reachable by the operator only", upstream)
    if superlink:
        check_superlink_command(superlink, listen=(host, port), upstream=(up_host, up_port))
    child = _start_superlink(superlink) if superlink else None
    try:
        return _serve(host, port, upstream, ca=ca, cert=cert, key=key, child=child, start_timeout=start_timeout,
                      limits=limits)
    finally:
        if child is not None:
            _stop(child)


def _serve(host: str, port: int, upstream: str, *, ca: Path, cert: Path, key: Path,
           child: subprocess.Popen | None, start_timeout: float, limits: Limits) -> int:
    import uvicorn

    if child is not None:
        deadline = time.monotonic() + start_timeout
        while not healthy(upstream, ca):
            if child.poll() is not None:
                print(f"fedpose server front: the SuperLink exited at start (code {child.returncode})",
                      file=sys.stderr)
                return child.returncode or 1
            if time.monotonic() > deadline:
                print(f"fedpose server front: the SuperLink did not answer on {upstream} within "
                      f"{start_timeout:.0f} s", file=sys.stderr)
                return 1
            time.sleep(0.3)
    config = uvicorn.Config(make_app(upstream, ca, limits=limits), host=host, port=port, ssl_certfile=str(cert),
                            ssl_keyfile=str(key), lifespan="on", access_log=False, server_header=False,
                            proxy_headers=False, log_level="warning", http=guarded_protocol(limits))
    server = uvicorn.Server(config)
    code = 0
    if child is not None:
        def watch() -> None:
            nonlocal code
            child.wait()
            code = child.returncode or 1  # the SuperLink is not meant to stop on its own
            print(f"fedpose server front: the SuperLink exited (code {child.returncode}); stopping", file=sys.stderr,
                  flush=True)
            server.should_exit = True

        threading.Thread(target=watch, daemon=True).start()
    print(f"fedpose server front: serving the Fleet API on {host}:{port} (the SuperLink on {upstream} stays on "
          f"its own address); bodies up to {limits.max_body_mib} MiB, headers within {limits.header_timeout:g} s, "
          f"{limits.max_connections} connections at most", flush=True)
    asyncio.run(server.serve())
    return code if server.started else (code or 1)
