"""How a pilot on 127.0.0.1 ends when something is wrong, through the operator's and the sites' own commands.

One pilot (TLS, node authentication, two sites with one lifetime round each): ``fedpose server run`` runs the
federation to its end; a second ``server run`` finds every site's rounds spent and must end with one line
that says so and exit 5, no traceback, and ``server status`` must then say ``failed``, not ``running``. A
copied kit (a second SuperNode with a site's key while the first is connected) must be told at once that
the key is in use by another node, not retried for minutes as if it had crashed. A site started before the
operator registered its key (Flower refuses it with the same code 2004) must wait for the registration and
say so, not exit as if its key were in use.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.federation import REPO, Pilot, prepare_world, start, wait_for, world_root
from fedpose.shared.configuration.schema import dump_config, replace

pytestmark = pytest.mark.slow


def _fedpose(pilot: Pilot, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fedpose.cli.main", *args], cwd=REPO, env=pilot.env,
                          capture_output=True, text=True, timeout=timeout)


def test_a_spent_pilot_ends_in_one_line_and_a_copied_kit_is_told_at_once(tmp_path: Path, tmp_path_factory) -> None:
    cfg = prepare_world(world_root(tmp_path_factory), rounds=1, federation={"local_steps": 1, "round_timeout": 120})
    cfg = replace(cfg, **{"train.method": "proj"})
    config = tmp_path / "server.yaml"
    dump_config(cfg, config)
    pilot = Pilot(tmp_path, cfg, sites=2, lifetime_rounds=1)
    try:
        pilot.start_superlink()
        pilot.register(1, 2)
        for i in (0, 1):
            pilot.start_site(i)
        run1 = tmp_path / "run1"
        done = _fedpose(pilot, "server", "run", "--connection", "pilot", "--out", str(run1), "--config", str(config),
                        "--app", str(pilot.app), "--poll", "2")
        assert done.returncode == 0 and "finished: PCKh" in done.stdout, done.stdout + done.stderr
        status = _fedpose(pilot, "server", "status", "--out", str(run1))
        assert "site-0: eps" in status.stdout and status.stdout.count(", finished (") == 2, status.stdout

        # every site's lifetime rounds are spent: one line, exit 5, no traceback; the folder reads failed
        run2 = tmp_path / "run2"
        done = _fedpose(pilot, "server", "run", "--connection", "pilot", "--out", str(run2), "--config", str(config),
                        "--app", str(pilot.app), "--poll", "2")
        assert done.returncode == 5, done.stdout + done.stderr
        err = done.stderr.strip()
        assert "Traceback" not in err and len(err.splitlines()) == 1, err
        assert "no site can take part" in err and "site-0 has no rounds left" in err, err
        status = _fedpose(pilot, "server", "status", "--out", str(run2))
        assert ": failed (no site can take part" in status.stdout, status.stdout

        # a copied kit: site-0's key on a second SuperNode while the first is connected, started from the same
        # folder (the kit's files and its state): told at once by the folder's start lock
        t0 = time.monotonic()
        copy = start([sys.executable, "-m", "fedpose.cli.main", "site", "start", "--approved", str(pilot.approved(0)),
                      "--policy", str(pilot.policy(0)), "--retry-pause", "3", "--",
                      "--root-certificates", str(pilot.certs / "ca.crt"), "--superlink", f"127.0.0.1:{pilot.link}",
                      "--auth-supernode-private-key", str(pilot.certs / "node-1"),
                      "--host", "127.0.0.1", "--port", str(pilot.ports[2])], pilot.log("copied-kit"), pilot.env)
        pilot.procs.append(copy)
        try:
            wait_for(lambda: copy.poll() is not None, 90, "the copied kit's SuperNode to give up")
        except TimeoutError:
            pytest.fail("still retrying after 90 s: " + pilot.log("copied-kit").read_text()[-3000:])
        log = pilot.log("copied-kit").read_text()
        assert copy.returncode == 3 and time.monotonic() - t0 < 60, (copy.returncode, log[-3000:])
        assert "already running from this folder" in log, log[-3000:]
        assert pilot.supernodes[0].poll() is None  # the site's own SuperNode runs on
    finally:
        pilot.close()


def test_a_site_started_before_its_key_is_registered_waits_for_registration(tmp_path: Path, tmp_path_factory) -> None:
    """Flower refuses a key the SuperLink does not know with the same answer as a key another SuperNode holds
    (code 2004, "Failed to activate SuperNode."): a site that never connected with its key must keep waiting,
    say that its key is not registered yet and name the operator's step, and connect once it is registered."""
    cfg = prepare_world(world_root(tmp_path_factory), rounds=1, federation={"local_steps": 1})
    pilot = Pilot(tmp_path, cfg, sites=1, lifetime_rounds=1)
    try:
        pilot.start_superlink()
        site = pilot.start_site(0, None, "--retry-pause", "2", "--retry-for", "120")
        log = pilot.log("supernode-0")
        # the current rule decides after the first refusal; two refusals are past its window
        try:
            wait_for(lambda: log.read_text().count("[code: 2004]") >= 2 or site.poll() is not None, 60,
                     "two refused activations")
        except TimeoutError:
            pytest.fail("not refused twice in 60 s: " + log.read_text()[-3000:])
        text = log.read_text()
        assert site.poll() is None, (site.returncode, text[-3000:])
        assert "already in use by another SuperNode" not in text, text[-3000:]
        assert "not registered yet" in text and "fedpose server register-sites" in text, text[-3000:]

        pilot.register(1)
        try:
            wait_for(lambda: "SuperNode ID:" in log.read_text() or site.poll() is not None, 30,
                     "the site to connect once its key is registered")
        except TimeoutError:
            pytest.fail("not connected 30 s after registration: " + log.read_text()[-3000:])
        assert site.poll() is None, (site.returncode, log.read_text()[-3000:])
    finally:
        pilot.close()


def test_a_site_started_twice_from_its_folder_says_so_and_exits_3_at_once(tmp_path: Path, tmp_path_factory) -> None:
    """A second ``fedpose site start`` of a running site, the same command from the same folder: it says that
    the site already runs (with its pid) and exits with 3, before it checks the site's data again, starts a
    warm-start server or a SuperNode (whose ports the running one holds), and the running site goes on."""
    cfg = prepare_world(world_root(tmp_path_factory), rounds=1, federation={"local_steps": 1})
    pilot = Pilot(tmp_path, cfg, sites=1, lifetime_rounds=1)
    try:
        pilot.start_superlink()
        pilot.register(1)
        first = pilot.start_site(0)
        wait_for(lambda: "SuperNode ID:" in pilot.log("supernode-0").read_text() or first.poll() is not None, 120,
                 "the site to connect")
        assert first.poll() is None, pilot.log("supernode-0").read_text()[-3000:]
        again = pilot.start_site(0, "supernode-0-again")
        try:
            wait_for(lambda: again.poll() is not None, 60, "the second start to exit")
        except TimeoutError:
            pytest.fail("a second start still runs after 60 s: " + pilot.log("supernode-0-again").read_text()[-3000:])
        text = pilot.log("supernode-0-again").read_text()
        assert again.returncode == 3, (again.returncode, text[-3000:])
        assert "already running" in text and f"pid {first.pid}" in text, text[-3000:]
        assert "Traceback" not in text and "checked:" not in text and "SuperNode runs only" not in text, text[-3000:]
        assert first.poll() is None, pilot.log("supernode-0").read_text()[-3000:]
    finally:
        pilot.close()
