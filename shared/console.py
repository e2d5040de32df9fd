"""The read-only web console: a small local HTTP server, one page, a JSON status and Prometheus metrics.

Both sides' consoles are this one server: ``fedpose console`` hands it ``fedpose.client.status`` for a hospital
site, ``fedpose.server.status`` for the federation server, each a function that reads the same files the CLI
reads (ledgers, the policy, the run's folder) and returns the status as plain data, so there is no second
source of truth. Every request reads the files again; the page refreshes itself every few seconds while a run
is live.

Bound to 127.0.0.1 by default. Bound to anything else it requires a token (``?token=`` on the page,
``Authorization: Bearer`` for ``/metrics`` and ``/api/status``); nothing it serves can change
anything (GET only).

Without a token (loopback only) it answers only requests addressed to a loopback name: the ``Host`` header
must be 127.0.0.1, localhost or [::1] (any port), and an ``Origin``, when a browser sends one, must be the
console's own. Otherwise any web page the operator opens could read it by DNS rebinding (its own name,
attacker.example, made to resolve to 127.0.0.1: the browser then sends ``Host: attacker.example:8480`` and
treats the answer as the attacker's page's own). With a token, any Host is served: the token protects it.
"""

from __future__ import annotations

import errno
import hmac
import json
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

log = logging.getLogger(__name__)

LOOPBACK = ("127.0.0.1", "localhost", "::1")
# The names a loopback console without a token answers to, as a Host header writes them (without the port).
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "[::1]"})
PAGE = Path(__file__).with_name("console.html")

StatusFn = Callable[[], dict[str, Any]]
MetricsFn = Callable[[dict[str, Any]], list[tuple[str, dict[str, str], float, str]]]


def prometheus_text(samples: list[tuple[str, dict[str, str], float, str]]) -> str:
    """Prometheus text exposition format from (name, labels, value, help) samples (one HELP/TYPE per name)."""
    lines: list[str] = []
    seen: set[str] = set()
    for name, labels, value, help_text in samples:
        if name not in seen:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
            seen.add(name)
        label = ",".join(f'{k}="{_escape(str(v))}"' for k, v in sorted(labels.items()))
        lines.append(f"{name}{{{label}}} {float(value):.10g}" if label else f"{name} {float(value):.10g}")
    return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class Console:
    """What the HTTP handler serves: the page, ``/api/status`` (JSON) and ``/metrics`` (Prometheus)."""

    def __init__(self, title: str, status: StatusFn, metrics: MetricsFn, *, token: str | None) -> None:
        self.title, self.status, self.metrics, self.token = title, status, metrics, token

    def allowed(self, query: dict[str, list[str]], header: str | None) -> bool:
        if self.token is None:
            return True
        given = (query.get("token") or [""])[0]
        if header and header.startswith("Bearer "):
            given = header[len("Bearer "):]
        return hmac.compare_digest(given.encode(), self.token.encode())

    def misaddressed(self, host: str | None, origin: str | None) -> str | None:
        """Why a request must be refused (to the requester, in words), or None: DNS rebinding, without a token.

        With a token, None: the token protects the console whatever name it is reached by.
        """
        if self.token is not None:
            return None
        name = _host_name(host)
        if name not in LOOPBACK_HOSTS:
            given = "no Host header" if host is None else f"the Host {host[:100]!r}"
            return (f"refused: {given} is not this machine's loopback. Without a token this console answers only "
                    "at http://127.0.0.1:<port>/ or http://localhost:<port>/ (so that no other web site can read "
                    "it through your browser); to reach it by another name, start it with --token\n")
        if origin is not None and origin.strip().lower() != f"http://{(host or '').strip()}".lower():
            return (f"refused: a request from another web site (Origin {origin[:100]!r}); open the console itself "
                    f"at http://{host}/\n")
        return None

    def page(self) -> bytes:
        return PAGE.read_text(encoding="utf-8").replace("{{TITLE}}", self.title).encode()


def _host_name(host: str | None) -> str | None:
    """The name of a Host header value without its port, lower case ("[::1]" keeps its brackets); None if malformed."""
    host = (host or "").strip().lower()
    if host.startswith("["):
        close = host.find("]")
        name, port = (host[:close + 1], host[close + 1:]) if close > 0 else ("", "")
    else:
        name, colon, port = host.partition(":")
        port = colon + port
    if not name or port and not (port.startswith(":") and port[1:].isdigit()):
        return None
    return name


def _handler(console: Console) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "fedpose-console"

        def log_message(self, fmt: str, *args: Any) -> None:  # quiet: one debug line per request
            log.debug("console %s: " + fmt, self.address_string(), *args)

        def _send(self, status: HTTPStatus, body: bytes, kind: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("X-Content-Type-Options", "nosniff")
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            url = urlparse(self.path)
            refused = console.misaddressed(self.headers.get("Host"), self.headers.get("Origin"))
            if refused is not None:
                log.warning("console: %s", refused.strip())
                self._send(HTTPStatus.FORBIDDEN, refused.encode(), "text/plain; charset=utf-8")
                return
            if not console.allowed(parse_qs(url.query), self.headers.get("Authorization")):
                self._send(HTTPStatus.UNAUTHORIZED, b"a token is needed: ?token=... or Authorization: Bearer\n",
                           "text/plain; charset=utf-8")
                return
            try:
                if url.path in ("/", "/index.html"):
                    self._send(HTTPStatus.OK, console.page(), "text/html; charset=utf-8")
                elif url.path == "/api/status":
                    self._send(HTTPStatus.OK, json.dumps(console.status(), default=str).encode(),
                               "application/json")
                elif url.path == "/metrics":
                    body = prometheus_text(console.metrics(console.status())).encode()
                    self._send(HTTPStatus.OK, body, "text/plain; version=0.0.4; charset=utf-8")
                else:
                    self._send(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain; charset=utf-8")
            except Exception as err:  # noqa: BLE001 - a broken file must not kill the console
                log.exception("console: reading the status failed")
                self._send(HTTPStatus.INTERNAL_SERVER_ERROR, f"cannot read the status: {err}\n".encode(),
                           "text/plain; charset=utf-8")

    return Handler


class _IPv6Server(ThreadingHTTPServer):
    address_family = socket.AF_INET6


def start_console(title: str, status: StatusFn, metrics: MetricsFn, *, host: str = "127.0.0.1", port: int = 8480,
                  token: str | None = None) -> tuple[ThreadingHTTPServer, str | None]:
    """Start serving in a background thread; returns (server, token). A non-loopback host gets a token."""
    if host not in LOOPBACK and token is None:
        token = secrets.token_urlsafe(24)
    server_class = _IPv6Server if ":" in host else ThreadingHTTPServer  # "::1", "::": an IPv6 socket
    try:
        server = server_class((host, port), _handler(Console(title, status, metrics, token=token)))
    except OSError as err:
        if err.errno != errno.EADDRINUSE:
            raise
        raise ValueError(f"port {port} on {host} is in use (another console?): choose another with --port, or "
                         "--port 0 for any free one") from err
    thread = threading.Thread(target=server.serve_forever, name="fedpose-console", daemon=True)
    thread.start()
    return server, token


def serve_console(title: str, status: StatusFn, metrics: MetricsFn, *, host: str = "127.0.0.1", port: int = 8480,
                  token: str | None = None) -> None:
    """Serve the console (``start_console``) and say where, until Ctrl-C."""
    server, token = start_console(title, status, metrics, host=host, port=port, token=token)
    bound, port = server.server_address[:2]
    name = str(bound)
    shown = f"[{name}]" if ":" in name else name
    print(f"console on http://{shown}:{port}/" + (f"?token={token}" if token else "")
          + f"  (Prometheus: /metrics{' with Authorization: Bearer <token>' if token else ''}); Ctrl-C stops it",
          flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
