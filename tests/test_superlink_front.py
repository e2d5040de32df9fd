"""What a site can reach on the server: the Fleet API, and nothing an operator uses.

Flower 1.41's SuperLink serves its Fleet API (SuperNodes), its Control API (``flwr run | ls | stop``,
``flwr supernode register | unregister | list``) and its Runtime API (the ServerApp's own, through
SuperExec) on one HTTP listener, ``--host``/``--port``; the Control API checks no credential (its
default authentication plugin accepts everyone). A site kit holds nothing secret (``ca.crt``), so whoever
reaches the Control API through the address the sites are given can list the runs and unregister
another site's SuperNode. The server kit binds the SuperLink to 127.0.0.1 and puts ``fedpose server
front`` on the public address: it passes the Fleet API (and ``/health``) and refuses everything else.

The test follows the server kit as provisioned: its ``start-superlink.sh`` (with the public bind-all
address replaced by 127.0.0.1, so nothing listens beyond this machine), the connection its README names,
``register-sites.sh``. Then, holding only site-b's kit (its ``ca.crt`` and its own node key), it tries
what a reviewer did. Every process binds 127.0.0.1 and is stopped by process group; every wait is bounded.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from fedpose.server.front import healthy
from support.federation import bin_path, flower_env, free_port, start, stop, wait_for

SITES = ["site-a", "site-b"]


def _flwr(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([bin_path("flwr"), *args], env=env, capture_output=True, text=True, timeout=timeout)


def _connection(flwr_home: Path, name: str, address: str, ca: Path) -> None:
    (flwr_home / "config.toml").write_text(f'[superlink]\ndefault = "{name}"\n\n[superlink.{name}]\n'
                                           f'address = "{address}"\nroot-certificates = "{ca}"\n')


def _nodes(env: dict[str, str], connection: str) -> list[dict]:
    done = _flwr(env, "supernode", "list", connection, "--format", "json")
    assert _succeeded(done), done.stdout + done.stderr
    return json.loads(done.stdout)["nodes"]


def _listening(port: int) -> set[str]:
    """The local addresses a TCP socket listens on at ``port`` (Linux: /proc/net/tcp and tcp6)."""
    import socket

    found = set()
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        table = Path("/proc/net") / name
        for line in table.read_text().splitlines()[1:] if table.exists() else []:
            local, state = line.split()[1], line.split()[3]
            address, port_hex = local.split(":")
            if state == "0A" and int(port_hex, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(address)
                # the kernel writes each 32-bit word in host (little-endian) order
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                found.add(socket.inet_ntop(family, raw))
    return found


def _succeeded(done: subprocess.CompletedProcess) -> bool:
    """Whether a ``flwr ... --format json`` command did what it was asked (it exits 0 on failure too)."""
    try:
        return done.returncode == 0 and json.loads(done.stdout)["success"] is True
    except (ValueError, KeyError):
        return False


def _signed_post(address: str, ca: Path, target: str, key: Path) -> int:
    """POST an empty protobuf body to the request-target ``target``, sent as written (no client normalises it),
    with the SuperNode authentication headers of ``key``; returns the HTTP status."""
    import http.client
    import ssl
    from base64 import b64encode

    from cryptography.hazmat.primitives import serialization

    from flwr.supercore.date import now
    from flwr.supercore.primitives.asymmetric import public_key_to_bytes, sign_message

    private = serialization.load_ssh_private_key(key.read_bytes(), password=None)
    stamp = now().isoformat()
    headers = {"content-type": "application/protobuf", "accept": "application/protobuf", "content-length": "0",
               "flwr-public-key": b64encode(public_key_to_bytes(private.public_key())).decode("ascii"),
               "flwr-timestamp": stamp,
               "flwr-signature": b64encode(sign_message(private, stamp.encode("ascii"))).decode("ascii")}
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPSConnection(host, int(port), timeout=30,
                                       context=ssl.create_default_context(cafile=str(ca)))
    try:
        conn.putrequest("POST", target, skip_accept_encoding=True)
        for name, value in headers.items():
            conn.putheader(name, value)
        conn.endheaders()
        return conn.getresponse().status
    finally:
        conn.close()


def _register_sites_again_and_again(server: Path, kits: Path, operator: dict[str, str]) -> dict[str, str]:
    """register-sites.sh as an operator runs it: with a garbled key, again once it is fixed, with a key saved
    under the wrong site's name. Every message names its site; which node id is which site is written down."""
    def register() -> subprocess.CompletedProcess:
        return subprocess.run(["sh", str(server / "register-sites.sh")], env=operator, capture_output=True,
                              text=True, timeout=180)

    for site in SITES:  # each key says whose it is
        assert (kits / site / "node.key.pub").read_text().split()[2] == f"fedpose-{site}"
    key_b = server / "site-keys" / "site-b.pub"
    good_b = key_b.read_text()
    key_b.write_text(good_b.replace(" AAAA", " AAA\nA", 1))  # a mail client wrapped it
    first = register()
    assert first.returncode != 0, first.stdout + first.stderr
    assert "site-a: registered as node" in first.stdout, first.stdout + first.stderr
    assert [line for line in first.stderr.splitlines() if line.strip()][0].startswith("site-b: "), first.stderr
    key_b.write_text(good_b)  # the operator saves it again, as site-b sent it, and runs the script again
    again = register()
    assert again.returncode == 0, again.stdout + again.stderr
    assert "site-a: already registered as node" in again.stdout and "site-b: registered as node" in again.stdout
    # which node id is which site: site-nodes.tsv and the table the script prints (flwr lists no names)
    rows = dict(line.split("\t")[:2] for line in (server / "site-nodes.tsv").read_text().splitlines()[1:])
    registered = {n["node-id"]: n["status"] for n in _nodes(operator, "pilot")}
    assert sorted(registered.values()) == ["registered", "registered"], registered
    assert sorted(rows) == SITES and sorted(rows.values()) == sorted(str(n) for n in registered), (rows, registered)
    for site in SITES:
        assert re.search(rf"^{site}\s+{rows[site]}$", again.stdout, re.M), again.stdout
    # a key saved under the wrong site's name is refused, and says whose it is; nothing changes
    key_b.write_text((kits / "site-a" / "node.key.pub").read_text())
    wrong = register()
    assert wrong.returncode != 0 and "site-b: " in wrong.stderr and "site-a's key" in wrong.stderr, wrong.stderr
    key_b.write_text(good_b)
    assert register().returncode == 0
    assert {n["node-id"]: n["status"] for n in _nodes(operator, "pilot")} == registered
    return registered


@pytest.mark.slow
def test_a_site_kit_reaches_the_fleet_api_but_never_the_control_api(tmp_path: Path) -> None:
    from fedpose.cli.main import main

    kits = tmp_path / "kits"
    port, control_port = free_port(), free_port()
    assert main(["provision", "--out", str(kits), "--sites", ",".join(SITES), "--host", "127.0.0.1",
                 "--port", str(port), "--control-port", str(control_port), "--install-dir", str(kits),
                 "--state-dir", str(tmp_path / "state")]) == 0
    server = kits / "server"
    for site in SITES:  # each site's own key pair; the operator gets the .pub (the kits' README steps)
        assert main(["site", "keygen", "--out", str(kits / site)]) == 0
        (server / "site-keys" / f"{site}.pub").write_text((kits / site / "node.key.pub").read_text())
    public = json.loads((kits / "site-b" / "kit.json").read_text())["superlink"]  # the address sites dial
    assert public == f"127.0.0.1:{port}"

    operator = flower_env(tmp_path / "operator-flwr")
    operator["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), operator["PATH"]])
    script = (server / "start-superlink.sh").read_text()
    # A federation whose sites dial 127.0.0.1 is served on loopback only: the script runs as the kit wrote it.
    assert f"--listen 127.0.0.1:{port} " in script and "0.0.0.0" not in script
    link = start(["sh", str(server / "start-superlink.sh")], tmp_path / "superlink.log", operator)
    procs = [link]
    try:
        wait_for(lambda: healthy(public, kits / "site-b" / "ca.crt") or link.poll() is not None, 120,
                 "the SuperLink", poll=0.5)
        assert link.poll() is None, (tmp_path / "superlink.log").read_text()[-3000:]
        # The operator's connection, as step 4 of the server README writes it, and the sites registered.
        readme = (server / "README.txt").read_text()
        (own,) = re.findall(r'address = "([^"]+)"', readme)
        assert own == f"127.0.0.1:{control_port}"
        if Path("/proc/net/tcp").exists():  # the SuperLink listens on loopback only; the front on the sites' address
            assert _listening(control_port) == {"127.0.0.1"} and _listening(port) == {"127.0.0.1"}
        _connection(tmp_path / "operator-flwr", "pilot", own, server / "ca.crt")
        registered = _register_sites_again_and_again(server, kits, operator)
        victim = min(registered)

        # -- site-b, with nothing but its kit: its ca.crt, the address kit.json names, its own node key
        site = flower_env(tmp_path / "site-b-flwr")
        _connection(tmp_path / "site-b-flwr", "pilot", public, kits / "site-b" / "ca.crt")
        ls = _flwr(site, "ls", "pilot", "--format", "json")
        assert not _succeeded(ls), f"a site listed the runs:\n{ls.stdout}{ls.stderr}"
        listed = _flwr(site, "supernode", "list", "pilot", "--format", "json")
        assert not _succeeded(listed), f"a site listed the SuperNodes:\n{listed.stdout}{listed.stderr}"
        gone = _flwr(site, "supernode", "unregister", str(victim), "pilot", "--format", "json")
        assert not _succeeded(gone), f"a site unregistered another site's SuperNode:\n{gone.stdout}{gone.stderr}"
        key = kits / "site-b" / "node.key"
        for target in ("/v1/control/list-runs", "/v1/control/unregister-node", "/v1/control/list-nodes",
                       "/v1/runtime/acquire-task", "/v1/runtime/get-nodes", "/v1/fleet/../control/list-runs",
                       "/v1/fleet/%2e%2e/control/list-runs", "/v1/fleet/get-run/../../control/list-runs",
                       "/v1/fleet%2f..%2fcontrol/list-runs", "//v1/control/list-runs", "/v1/control/list-runs?",
                       f"https://{public}/v1/control/list-runs", "/docs", "/openapi.json"):
            code = _signed_post(public, kits / "site-b" / "ca.crt", target, key)
            assert code == 404, f"POST {target}: HTTP {code} through the sites' address"
        # A Fleet API route is passed on: the SuperLink itself answers (here: an empty request it cannot use).
        assert _signed_post(public, kits / "site-b" / "ca.crt", "/v1/fleet/get-run", key) not in (404, 502)
        # ... and nothing changed: both sites are still registered, as the operator sees them (an unregistered
        # node stays in the list, with status "unregistered").
        assert {n["node-id"]: n["status"] for n in _nodes(operator, "pilot")} == registered

        # -- the Fleet API still works through the sites' address: site-a's SuperNode joins with its own key
        node = start([bin_path("flower-supernode"), "--superlink", public,
                      "--root-certificates", str(kits / "site-a" / "ca.crt"),
                      "--auth-supernode-private-key", str(kits / "site-a" / "node.key"),
                      "--host", "127.0.0.1", "--port", str(free_port()), "--max-retries", "3"],
                     tmp_path / "supernode-a.log", flower_env(tmp_path / "site-a-flwr"))
        procs.append(node)

        def online() -> bool:
            return any(n["status"] == "online" for n in _nodes(operator, "pilot"))

        wait_for(lambda: online() or node.poll() is not None, 90, "site-a's SuperNode to come online", poll=1.0)
        assert node.poll() is None, (tmp_path / "supernode-a.log").read_text()[-3000:]
        # The operator's own Control API calls, on this machine, still work.
        ls = _flwr(operator, "ls", "pilot", "--format", "json")
        assert _succeeded(ls) and json.loads(ls.stdout)["runs"] == [], ls.stdout + ls.stderr

        # A service manager's stop (SIGTERM to the script's process, the front) stops the SuperLink with it.
        stop(node)
        link.send_signal(signal.SIGTERM)
        assert link.wait(timeout=60) == 0, (tmp_path / "superlink.log").read_text()[-3000:]
        wait_for(lambda: not healthy(own, server / "ca.crt"), 30, "the SuperLink to stop with its front")
    finally:
        stop(*procs)


def test_the_front_refuses_to_start_a_superlink_that_would_listen_beyond_its_upstream() -> None:
    from fedpose.server.front import allowed_routes, check_superlink_command

    listen, upstream = ("0.0.0.0", 8000), ("127.0.0.1", 9093)
    kit = ["flower-superlink", "--ssl-ca-certfile", "ca.crt", "--enable-supernode-auth", "--host", "127.0.0.1",
           "--port", "9093", "--database", "superlink.db"]
    check_superlink_command(kit, listen=listen, upstream=upstream)
    check_superlink_command(["flower-superlink", "--host=127.0.0.1", "--port=9093"], listen=listen,
                            upstream=upstream)
    for bad in (["--host", "0.0.0.0", "--port", "9093"], ["--host", "::", "--port", "9093"],
                ["--host", "127.0.0.1", "--port", "9094"], ["--host=0.0.0.0", "--port=9093"],
                ["--port", "8000", "--host", "0.0.0.0"], ["--host", "10.0.0.5", "--port", "9093"],
                []):  # flower-superlink's defaults are 127.0.0.1:8000, not this upstream
        with pytest.raises(ValueError, match="must listen on the front's upstream"):
            check_superlink_command(["flower-superlink", *bad], listen=listen, upstream=upstream)
    # What passes: Flower's Fleet API routes and the health check, nothing of the Control or Runtime API.
    routes = allowed_routes()
    assert ("POST", "/v1/fleet/pull-messages") in routes and ("POST", "/v1/fleet/push-messages") in routes
    assert ("GET", "/health") in routes
    assert all(path.startswith("/v1/fleet/") or path == "/health" for _, path in routes), sorted(routes)


# -- what the front holds for a peer that has not authenticated: a bounded body, bounded time, bounded connections
# The front runs as `fedpose server front` serves a SuperLink started otherwise; in the SuperLink's place stands a
# TLS HTTP server of the test's own that records every request it is given, so that what the front forwards (and
# what it does not) is counted byte for byte.

MIB = 1 << 20


class _Upstream:
    """A TLS HTTP/1.1 server on 127.0.0.1 in the SuperLink's place: answers every request 200 and records
    (method, path, body bytes received, their SHA-256)."""

    def __init__(self, certs: Path) -> None:
        import hashlib
        import ssl
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        received: list[tuple[str, str, int, str]] = []

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def answer(self) -> None:
                length, got, digest = int(self.headers.get("content-length") or 0), 0, hashlib.sha256()
                while got < length:
                    chunk = self.rfile.read(min(MIB, length - got))
                    if not chunk:
                        break
                    got += len(chunk)
                    digest.update(chunk)
                received.append((self.command, self.path, got, digest.hexdigest()))
                self.send_response(200)
                self.send_header("content-length", "3")
                self.end_headers()
                self.wfile.write(b"ok\n")

            do_GET = do_POST = answer

        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(certs / "server.pem", certs / "server.key")
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        self.received = received
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _front(tmp_path: Path, *limits: str) -> tuple[subprocess.Popen, str, _Upstream]:
    """`fedpose server front` on 127.0.0.1 with ``limits`` (its options), in front of a recording upstream."""
    from fedpose.server.kits.certs import make_certs

    certs = tmp_path / "certs"
    make_certs(certs, nodes=0, hosts=["127.0.0.1"], days=1)
    upstream = _Upstream(certs)
    listen = f"127.0.0.1:{free_port()}"
    proc = start([bin_path("fedpose"), "server", "front", "--listen", listen, "--superlink", upstream.address,
                  "--ca", str(certs / "ca.crt"), "--cert", str(certs / "server.pem"), "--key",
                  str(certs / "server.key"), *limits], tmp_path / "front.log", flower_env(tmp_path / "flwr"))
    try:
        wait_for(lambda: healthy(listen, certs / "ca.crt") or proc.poll() is not None, 60, "the front", poll=0.3)
        assert proc.poll() is None, (tmp_path / "front.log").read_text()[-3000:]
    except BaseException:
        stop(proc)
        upstream.close()
        raise
    return proc, listen, upstream


def _tls(address: str, ca: Path, timeout: float = 10.0) -> Any:
    """A TLS connection to ``address`` checked against ``ca``, handshake done."""
    import socket
    import ssl

    host, port = address.rsplit(":", 1)
    raw = socket.create_connection((host, int(port)), timeout=timeout)
    try:
        return ssl.create_default_context(cafile=str(ca)).wrap_socket(raw, server_hostname=host)
    except BaseException:
        raw.close()
        raise


def _closed(conn: Any, wait: float = 0.0) -> bool:
    """Whether the front closed ``conn``: end of stream or a reset within ``wait`` s (an answer counts too)."""
    import socket

    conn.settimeout(max(wait, 0.001))
    try:
        conn.recv(1)
        return True  # an answer or the end of the stream: either way nothing is left waiting
    except (socket.timeout, TimeoutError):
        return False
    except OSError:
        return True


def _status(conn: Any, wait: float) -> int | None:
    """The status code of the response on ``conn`` within ``wait`` s, its body read (so that the connection can
    carry the next request); None if none came, or the connection broke first."""
    import socket

    conn.settimeout(wait)
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(4096)
            if not chunk:
                return None
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        found = re.search(rb"^content-length: *(\d+)", head, re.I | re.M)
        chunked = re.search(rb"^transfer-encoding: *chunked", head, re.I | re.M)
        while (found and len(body) < int(found.group(1))) or (chunked and not body.endswith(b"0\r\n\r\n")):
            chunk = conn.recv(4096)
            if not chunk:
                break
            body += chunk
    except (socket.timeout, OSError):
        return None
    parts = head.split(b" ", 2)
    return int(parts[1]) if len(parts) > 1 and parts[0].startswith(b"HTTP/1.") and parts[1].isdigit() else None


def _rss(pid: int) -> int:
    """Resident memory of process ``pid`` in bytes (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def _post(path: str, length: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: front\r\nContent-Type: application/protobuf\r\n"
            f"Content-Length: {length}\r\n\r\n").encode("ascii")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads a process's memory from /proc")
def test_the_front_answers_an_oversized_body_413_without_reading_or_forwarding_it(tmp_path: Path) -> None:
    import hashlib
    import threading

    proc, listen, upstream = _front(tmp_path, "--max-body-mib", "1")
    ca = tmp_path / "certs" / "ca.crt"
    try:
        # A body within the cap reaches the SuperLink whole, byte for byte.
        body = os.urandom(MIB - 4096)
        conn = _tls(listen, ca)
        conn.sendall(_post("/v1/fleet/push-object", len(body)) + body)
        assert _status(conn, 30) == 200
        conn.close()
        assert upstream.received[-1] == ("POST", "/v1/fleet/push-object", len(body), hashlib.sha256(body).hexdigest())
        forwarded = len(upstream.received)

        # 200 MB, declared and then sent, with no node credential: refused before it is read, never forwarded.
        size, chunk = 200 * 1000 * 1000, b"\0" * MIB
        before, peak, done = _rss(proc.pid), [0], threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], _rss(proc.pid))
                done.wait(0.05)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        conn = _tls(listen, ca, timeout=120)
        conn.sendall(_post("/v1/fleet/pull-messages", size))
        status = _status(conn, 5)  # the cap is read off the header: the answer comes before any of the body
        sent = 0
        try:
            conn.settimeout(120)
            while sent < size:  # a peer that sends it anyway
                conn.sendall(chunk[:size - sent])
                sent += min(len(chunk), size - sent)
        except OSError:
            pass
        if status is None:
            status = _status(conn, 120)
        conn.close()
        time.sleep(1.0)  # what the front does with what it got (forwarding it, here) shows in its memory
        done.set()
        sampler.join(timeout=10)
        grown = (peak[0] - before) / MIB
        late = upstream.received[forwarded:]
        assert (status, late) == (413, []) and grown < 50, (
            f"HTTP {status}; {sent / MIB:.0f} MiB sent; the front's memory grew by {grown:.0f} MiB; forwarded: "
            f"{[(m, p, n) for m, p, n, _ in late]}")
        # ... and the front serves on: the next site's request goes through.
        conn = _tls(listen, ca)
        conn.sendall(_post("/v1/fleet/pull-messages", 3) + b"abc")
        assert _status(conn, 30) == 200 and upstream.received[-1][:3] == ("POST", "/v1/fleet/pull-messages", 3)
        conn.close()
        assert "1 MiB" in (tmp_path / "front.log").read_text()  # the refusal is logged, with the cap
    finally:
        stop(proc)
        upstream.close()


def test_the_front_closes_connections_that_do_not_send_their_headers_in_time(tmp_path: Path) -> None:
    proc, listen, upstream = _front(tmp_path, "--header-timeout", "1", "--max-connections", "64")
    ca = tmp_path / "certs" / "ca.crt"
    conns = []
    try:
        # 15 that dribble a request's headers a byte at a time, 4 that send nothing, and one that sends a whole
        # request, reads the answer and then dribbles the next request's headers (keep-alive).
        for i in range(15):
            conn = _tls(listen, ca)
            conn.sendall(f"POST /v1/fleet/pull-messages HTTP/1.1\r\nHost: front\r\nX-Slow-{i}: ".encode())
            conns.append(conn)
        conns.extend(_tls(listen, ca) for _ in range(4))
        kept = _tls(listen, ca)
        kept.sendall(b"GET /health HTTP/1.1\r\nHost: front\r\n\r\n")
        assert _status(kept, 30) == 200
        kept.sendall(b"GET /health HTTP/1.1\r\nHo")
        conns.append(kept)
        # A client that keeps its requests coming is served on one connection across several.
        prompt = _tls(listen, ca)
        for _ in range(3):
            prompt.sendall(b"GET /health HTTP/1.1\r\nHost: front\r\n\r\n")
            assert _status(prompt, 30) == 200
            time.sleep(0.3)
        prompt.close()

        silent = conns[15:19]
        deadline, open_ = time.monotonic() + 8, list(conns)
        while open_ and time.monotonic() < deadline:
            still = []
            for conn in open_:
                try:
                    if conn not in silent:
                        conn.sendall(b"a")
                except OSError:
                    continue
                if not _closed(conn):
                    still.append(conn)
            open_ = still
            time.sleep(0.25)
        assert not open_, f"{len(open_)} of {len(conns)} connections still open 8 s into a 1 s header timeout"
        assert proc.poll() is None and healthy(listen, ca)
    finally:
        for conn in conns:
            conn.close()
        stop(proc)
        upstream.close()


def test_the_front_refuses_connections_beyond_its_bound(tmp_path: Path) -> None:
    proc, listen, upstream = _front(tmp_path, "--max-connections", "4", "--header-timeout", "30")
    ca = tmp_path / "certs" / "ca.crt"
    held, extra = [], []
    try:
        held = [_tls(listen, ca) for _ in range(4)]  # silent: each holds one of the four places
        time.sleep(0.5)
        refused = 0
        for _ in range(6):
            try:
                conn = _tls(listen, ca)
            except OSError:
                refused += 1
                continue
            extra.append(conn)
            refused += _closed(conn, wait=3.0)
        assert refused == 6, f"{6 - refused} of 6 connections beyond the bound of 4 were kept open"
        assert not any(_closed(conn) for conn in held)  # those within the bound are untouched, and served
        held[0].sendall(b"GET /health HTTP/1.1\r\nHost: front\r\n\r\n")
        assert _status(held[0], 30) == 200
        for conn in held:
            conn.close()
        wait_for(lambda: healthy(listen, ca), 30, "a place for a new connection once the others closed")
    finally:
        for conn in held + extra:
            conn.close()
        stop(proc)
        upstream.close()


def test_the_body_cap_holds_a_sites_largest_reply_with_little_to_spare() -> None:
    """The cap the server kit passes (``body_limit_mib``) is above the largest request a site sends, its reply
    with the model's weights, for the CPU and the paper-sized configs, whether V travels or not (the basis goes
    from the server to the sites only), and within twice that: a cap, not a hole. Limits out of range are
    refused, naming the value."""
    from flwr.app import MetricRecord, RecordDict

    from fedpose.server.front import MIB, MIN_BODY_MIB, Limits, body_limit_mib
    from fedpose.shared.configuration.schema import load_config, replace
    from fedpose.shared.flower.messages import ARRAYS, METRICS, payload_bytes, weights_record
    from fedpose.shared.model.posenet import build_model

    for name in ("default", "paper"):
        cfg = load_config(name)
        model = build_model(cfg.model, cfg.data.input_size)
        reply = RecordDict({ARRAYS: weights_record(model.state_dict()),
                            METRICS: MetricRecord({"epsilon": 1.0, "sigma": 1.0, "steps": 10})})
        size, cap = payload_bytes(reply), body_limit_mib(cfg) * MIB
        assert size < cap <= max(MIN_BODY_MIB * MIB, 2 * size), (name, size, cap)
        assert body_limit_mib(replace(cfg, **{"federation.basis_mode": "broadcast"})) == body_limit_mib(cfg)
    for bad in ({"max_body_mib": 0}, {"header_timeout": 0.0}, {"header_timeout": float("inf")},
                {"max_connections": 0}, {"max_connections": True}):
        with pytest.raises(ValueError, match=f"{next(iter(bad))}="):
            Limits(**bad)
