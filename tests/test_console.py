"""The web console in a real browser, during a live federation: the numbers it shows are the ledgers'.

A federation runs in a background thread (the server's real round loop, the sites' real handlers and
ledgers; ``support.federation.InProcessGrid``) and is held after round 1. ``fedpose console`` serves the
server's run folder and one site's policy from their own processes; Debian's Chromium, driven by
Playwright, opens both pages. What the pages show is compared with the SQLite ledgers; then the
federation is let go, and the server page must follow it to the end by itself. The ``/metrics`` text is
read too. Its screenshots stay in its temporary folder: the docs' pictures of both pages are a kit's pilot's
(``tools/console_pictures.py``), at the kits' own paths and policies.
"""

from __future__ import annotations

import json
import threading
import urllib.request

import pytest

from support.browser import BROWSER_ARGS, CHROMIUM, console, get, playwright
from support.federation import InProcessGrid, prepare_world, stop, wait_for, world_root

pytestmark = pytest.mark.slow

class HeldGrid(InProcessGrid):
    """The in-process grid, holding every train message of round >= 2 until ``release`` is set."""

    def __init__(self, run_config: dict, sites: int) -> None:
        super().__init__(run_config, sites)
        self.release = threading.Event()

    def push_messages(self, messages):
        from fedpose.shared.flower.messages import CONFIG

        for message in messages:
            config = message.content.config_records.get(CONFIG)
            if config is not None and int(config.get("round", 0)) >= 2:
                assert self.release.wait(timeout=600), "the test never released round 2"
        return super().push_messages(messages)


def test_the_console_shows_the_ledgers_numbers_during_a_live_federation(tmp_path, tmp_path_factory):
    from fedpose.cli.local_federation import prepare_simulation
    from fedpose.client.status import site_status
    from fedpose.server.run import run_federation
    from fedpose.server.status import server_status
    from fedpose.shared.configuration.schema import replace

    cfg = prepare_world(world_root(tmp_path_factory))
    out = tmp_path / "fed"
    cfg = replace(cfg, **{"federation.out": str(out)})
    config_path = prepare_simulation(cfg, out, progress=False)
    grid = HeldGrid({"config": str(config_path), "overrides": "", "out": str(out), "resume": False}, sites=2)
    errors: list[BaseException] = []

    def federation() -> None:
        try:
            run_federation(grid, cfg, out)
        except BaseException as err:  # noqa: BLE001 - reported by the test below
            errors.append(err)

    runner = threading.Thread(target=federation, daemon=True)
    runner.start()
    rounds = out / "rounds.jsonl"
    wait_for(lambda: rounds.is_file() and rounds.read_text().strip() or errors, 300, "round 1", poll=0.5)
    assert not errors, errors
    policy = out / "sites" / "site-0" / "policy.yaml"
    procs = []
    try:
        server_proc, server_url = console(["--out", str(out)], tmp_path / "console-server.log")
        site_proc, site_url = console(["--policy", str(policy)], tmp_path / "console-site.log")
        procs += [server_proc, site_proc]
        with playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=BROWSER_ARGS)
            page = browser.new_page(viewport={"width": 1280, "height": 900})

            # -- the server's page, live: round 1 done, round 2 held
            page.goto(server_url)
            page.wait_for_selector("[data-testid=round-pckh-1]", timeout=30_000)
            assert page.inner_text("#badge").lower() == "running"
            live = server_status(out)
            for site, s in live["sites"].items():
                shown = float(page.inner_text(f"[data-testid=site-eps-{site}]"))
                assert shown == pytest.approx(s["epsilon"], abs=5e-5), site
                # an epsilon says nothing without its delta: each site's, as its plan holds it
                assert float(page.inner_text(f"[data-testid=site-delta-{site}]")) == s["delta"], site
                # a round asked of the site and not answered yet counts as spent: its line says so
                assert s["unanswered"] == 1  # round 2, asked and held
                assert page.inner_text(f"[data-testid=site-status-{site}]") == (
                    f"{s['status']}; 1 round unanswered, counted as spent"), site
            pckh = float(page.inner_text("[data-testid=round-pckh-1]"))
            assert pckh == pytest.approx(live["rounds"][0]["pckh_mean"], abs=5e-3)
            page.screenshot(path=str(tmp_path / "console-server.png"), full_page=True)

            # -- the site's page: its own ledger
            site_page = browser.new_page(viewport={"width": 1280, "height": 900})
            site_page.goto(site_url)
            site_page.wait_for_selector("[data-testid=lifetime-spent]", timeout=30_000)
            mine = site_status(policy)
            shown = float(site_page.inner_text("[data-testid=lifetime-spent]"))
            assert shown == pytest.approx(mine["budget"]["lifetime"]["spent"], abs=5e-5)
            row = mine["rounds"][0]
            cell = site_page.inner_text(f"[data-testid=round-eps-{row['federation']}-{row['round']}]")
            assert float(cell) == pytest.approx(row["epsilon"], abs=5e-5)
            # a badge that asks for attention says why, beside it
            assert site_page.inner_text("#badge").lower() == ("healthy" if mine["healthy"] else "needs attention")
            assert site_page.inner_text("#badge-reason") == "; ".join(mine["problems"])
            assert mine["healthy"] or mine["problems"]
            # the simulated site runs fpdp, so its policy opted in to Feature-DP: the page says what that gives away
            assert site_page.inner_text("[data-testid=guarantee]") == mine["policy"]["guarantee"]
            assert mine["policy"]["guarantee"].startswith("Feature-DP opted in")
            shown_policy = site_page.inner_text("main")
            assert "can read, exactly, a blurred copy of each image" in shown_policy
            # and what that gives over a whole federation, in plain words
            assert ("over a federation the server sees the blurred copy and labels of every record the public "
                    "term draws, and from the draws it can count them") in shown_policy
            assert "never images, labels or records" not in shown_policy
            site_page.screenshot(path=str(tmp_path / "console-site.png"), full_page=True)

            # -- let the federation finish: the server page follows by itself (it refreshes every 5 s)
            grid.release.set()
            runner.join(timeout=600)
            assert not runner.is_alive() and not errors, errors
            page.wait_for_function("document.querySelector('#badge').textContent.toLowerCase() === 'finished'",
                                   timeout=30_000)
            final = server_status(out)
            assert final["state"] == "finished" and len(final["rounds"]) == 2
            for site, s in final["sites"].items():
                shown = float(page.inner_text(f"[data-testid=site-eps-{site}]"))
                assert shown == pytest.approx(s["epsilon"], abs=5e-5), site
            assert final["claim"] in page.inner_text("main")
            browser.close()

        metrics = get(server_url + "metrics")
        metrics_json = json.loads(get(server_url + "api/status"))
        line = next(line for line in metrics.splitlines()
                    if line.startswith("fedpose_server_site_epsilon{") and 'site="site-0"' in line)
        assert float(line.rsplit(" ", 1)[1]) == pytest.approx(metrics_json["sites"]["site-0"]["epsilon"], rel=1e-9)
        assert "# TYPE fedpose_server_pckh gauge" in metrics
    finally:
        grid.release.set()
        stop(*procs)


def test_a_console_off_loopback_needs_its_token(tmp_path):
    """Bound beyond 127.0.0.1 the console requires a token: the page, the JSON and the metrics."""
    from fedpose.shared.console import start_console

    server, token = start_console("t", lambda: {"kind": "server"}, lambda s: [("x", {}, 1.0, "h")], host="0.0.0.0",
                                  port=0)
    try:
        port = server.server_address[1]
        assert token and get(f"http://127.0.0.1:{port}/api/status") is None  # 401
        assert json.loads(get(f"http://127.0.0.1:{port}/api/status?token={token}")) == {"kind": "server"}
        request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics",
                                         headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(request, timeout=5) as resp:
            assert resp.read().decode() == "# HELP x h\n# TYPE x gauge\nx 1\n"
    finally:
        server.shutdown()


def _ask(port: int, path: str, headers: dict[str, str]) -> tuple[int, str]:
    """GET ``path`` from the console on 127.0.0.1:``port`` with exactly these headers (Host among them)."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.putrequest("GET", path, skip_host=True, skip_accept_encoding=True)
        for name, value in headers.items():
            conn.putheader(name, value)
        conn.endheaders()
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


def test_a_loopback_console_answers_only_to_loopback_names(tmp_path):
    """DNS rebinding: a web page on attacker.example, its name now resolving to 127.0.0.1, must not read the console.

    Its browser sends ``Host: attacker.example:8480``; the console (no token on loopback) refuses every path
    for any Host that is not a loopback name, and a cross-site Origin too; 127.0.0.1, localhost and [::1] work.
    """
    from fedpose.shared.console import start_console

    status = {"kind": "site", "records": 1234, "refusals": 3}
    server, token = start_console("t", lambda: status, lambda s: [("x", {}, 1.0, "h")], host="127.0.0.1", port=0)
    try:
        port = server.server_address[1]
        assert token is None
        for path in ("/api/status", "/", "/metrics"):
            for host in (f"attacker.example:{port}", "attacker.example", f"127.0.0.1.attacker.example:{port}",
                         f"localhost.attacker.example:{port}", f"127.0.0.2:{port}", ""):
                code, body = _ask(port, path, {"Host": host})
                assert code in (400, 403, 421), (path, host, code)
                assert "1234" not in body and "Host" in body, (path, host, body)
            code, body = _ask(port, path, {})  # no Host at all
            assert code in (400, 403, 421) and "1234" not in body, (path, code)
            code, body = _ask(port, path, {"Host": f"127.0.0.1:{port}", "Origin": f"http://attacker.example:{port}"})
            assert code in (400, 403, 421) and "1234" not in body and "Origin" in body, (path, code, body)
        for host in (f"127.0.0.1:{port}", "127.0.0.1", f"localhost:{port}", f"LocalHost:{port}", f"[::1]:{port}"):
            code, body = _ask(port, "/api/status", {"Host": host})
            assert (code, json.loads(body)) == (200, status), host
        code, body = _ask(port, "/api/status", {"Host": f"127.0.0.1:{port}", "Origin": f"http://127.0.0.1:{port}"})
        assert (code, json.loads(body)) == (200, status)  # the page's own fetch, should a browser send its Origin
        code, body = _ask(port, "/", {"Host": f"localhost:{port}"})
        assert code == 200 and "<html" in body.lower()
    finally:
        server.shutdown()


def test_a_console_off_loopback_takes_any_host_name_with_its_token(tmp_path):
    """Bound beyond loopback (behind a name, a proxy) the token protects it: any Host with the token is served."""
    from fedpose.shared.console import start_console

    server, token = start_console("t", lambda: {"kind": "server"}, lambda s: [], host="0.0.0.0", port=0)
    try:
        port = server.server_address[1]
        host = f"fedpose-console.hospital-a.example:{port}"
        assert _ask(port, "/api/status", {"Host": host})[0] == 401
        code, body = _ask(port, f"/api/status?token={token}", {"Host": host})
        assert (code, json.loads(body)) == (200, {"kind": "server"})
        code, body = _ask(port, "/api/status", {"Host": host, "Authorization": f"Bearer {token}"})
        assert (code, json.loads(body)) == (200, {"kind": "server"})
    finally:
        server.shutdown()


def test_a_console_on_ipv6_loopback_serves_its_page(tmp_path):
    """``--host ::1`` (a loopback name the console accepts) binds the IPv6 loopback and answers at [::1]."""
    import http.client
    import socket

    from fedpose.shared.console import start_console

    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("this machine has no IPv6 loopback")
    server, token = start_console("t", lambda: {"kind": "site"}, lambda s: [], host="::1", port=0)
    try:
        port = server.server_address[1]
        assert token is None
        conn = http.client.HTTPConnection("::1", port, timeout=5)
        conn.request("GET", "/api/status")  # Host: [::1]:<port>
        resp = conn.getresponse()
        assert (resp.status, json.loads(resp.read())) == (200, {"kind": "site"})
        conn.close()
    finally:
        server.shutdown()


def test_a_second_console_on_a_taken_port_names_the_port_and_the_flag():
    """Before: '[Errno 98] Address already in use', naming neither the port nor --port."""
    from fedpose.shared.console import start_console

    first, _ = start_console("t", lambda: {"kind": "site"}, lambda s: [], port=0)
    port = first.server_address[1]
    try:
        with pytest.raises(ValueError, match=rf"port {port} on 127.0.0.1 is in use.*--port"):
            start_console("t", lambda: {"kind": "site"}, lambda s: [], port=port)
    finally:
        first.shutdown()
