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
from pathlib import Path

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
    # The kit serves the sites on every interface; here on loopback only (nothing else of the script changes).
    assert f"--listen 0.0.0.0:{port} " in script
    (server / "start-superlink-loopback.sh").write_text(script.replace(f"0.0.0.0:{port}", f"127.0.0.1:{port}"))
    link = start(["sh", str(server / "start-superlink-loopback.sh")], tmp_path / "superlink.log", operator)
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
