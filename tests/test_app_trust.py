"""The site's app-bundle gate (client/app_trust.py, ``fedpose site approve|start``): issue #8, finding 8.9.

The end-to-end check (a real SuperLink and SuperNodes refusing an unapproved
bundle and running the approved one) is in tests/test_federation_deploy.py.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from fedpose.cli.main import main as cli_main
from fedpose.client.app_trust import (
    UnapprovedAppError,
    check_fab,
    fab_digest,
    install_gate,
    load_approved,
    parse_approved,
    write_shim,
)
from support.federation import REPO, bin_path

A = hashlib.sha256(b"bundle a").hexdigest()
B = hashlib.sha256(b"bundle b").hexdigest()


def test_approved_file_format(tmp_path):
    text = f"# reviewed by the DPO\n{A}  # fedpose 0.1.0\n\n{B.upper()}\n"
    assert parse_approved(text) == {A, B}
    with pytest.raises(ValueError, match="line 2"):
        parse_approved(f"{A}\nnot-a-digest\n")
    with pytest.raises(FileNotFoundError):
        load_approved(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("# nothing yet\n")
    with pytest.raises(ValueError, match="lists no digest"):
        load_approved(tmp_path / "empty.txt")


def test_check_fab_recomputes_the_digest():
    approved = frozenset({A})
    assert check_fab(A, b"bundle a", approved) == A
    with pytest.raises(UnapprovedAppError, match="not approved"):
        check_fab(B, b"bundle b", approved)
    # A hostile SuperLink cannot relabel other content with an approved hash.
    with pytest.raises(UnapprovedAppError, match="does not match"):
        check_fab(A, b"bundle b", approved)


@pytest.fixture(scope="module")
def bundle() -> bytes:
    """This repository's app bundle, as `flwr run` builds and submits it."""
    from flwr.cli.build import build_fab_from_disk

    return build_fab_from_disk(REPO)


def _project() -> tuple[str, str]:
    import tomllib

    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    return f"{config['tool']['flwr']['app']['publisher']}/{config['project']['name']}", config["project"]["version"]


RUN = SimpleNamespace(fab_id=_project()[0], fab_version=_project()[1])


def test_gate_refuses_at_install_after_flower_holds_the_message(bundle):
    """Unapproved: refused in place of install_from_fab (so Flower can still reply); approved: installed."""
    installed: list[bytes] = []
    digest = hashlib.sha256(bundle).hexdigest()

    def runtime_with(fab, run=RUN):
        return SimpleNamespace(pull_task_input=lambda client: ("msg", "ctx", run, fab),
                               install_from_fab=lambda content, **kw: installed.append(content))

    rt = runtime_with(SimpleNamespace(hash_str=B, content=b"bundle b"))
    install_gate(rt, frozenset({A}))
    message, context, _, fab = rt.pull_task_input(None)  # Flower gets the message and context to reply to
    assert (message, context) == ("msg", "ctx")
    with pytest.raises(UnapprovedAppError, match="not approved"):
        rt.install_from_fab(fab.content, skip_prompt=True)
    rt = runtime_with(SimpleNamespace(hash_str=digest, content=bundle))
    install_gate(rt, frozenset({digest}))
    fab = rt.pull_task_input(None)[3]
    with pytest.raises(UnapprovedAppError, match="not the one checked"):
        rt.install_from_fab(b"bundle b", skip_prompt=True)
    rt.install_from_fab(fab.content, skip_prompt=True)
    assert installed == [bundle]


def test_gate_refuses_a_run_whose_app_id_or_version_differ_from_the_bundle(bundle):
    """#21 finding 8: Flower loads the app from a path built from the SuperLink's fab_id / fab_version; a
    version holding '/..' would load code that was never checked. Only the bundle's own names pass."""
    from fedpose.client.app_trust import bundle_metadata

    digest = hashlib.sha256(bundle).hexdigest()
    assert bundle_metadata(bundle) == (RUN.fab_id, RUN.fab_version)
    installed: list[bytes] = []
    for run in (SimpleNamespace(fab_id=RUN.fab_id, fab_version=RUN.fab_version + "/../../../evil"),
                SimpleNamespace(fab_id=RUN.fab_id + "-other", fab_version=RUN.fab_version),
                SimpleNamespace(fab_id="../" + RUN.fab_id, fab_version=RUN.fab_version)):
        rt = SimpleNamespace(pull_task_input=lambda client, run=run: ("msg", "ctx", run,
                                                                      SimpleNamespace(hash_str=digest, content=bundle)),
                             install_from_fab=lambda content, **kw: installed.append(content))
        install_gate(rt, frozenset({digest}))
        rt.pull_task_input(None)
        with pytest.raises(UnapprovedAppError, match="refused"):
            rt.install_from_fab(bundle, skip_prompt=True)
    assert installed == []


def test_each_gated_clientapp_installs_into_a_fresh_home_never_reusing_a_directory(bundle, tmp_path, monkeypatch):
    """Flower reuses an existing install directory unchecked: a tampered one must never be what is loaded."""
    from flwr.cli.install import install_from_fab
    from flwr.common.config import get_project_dir

    from fedpose.client.app_trust import private_flower_home

    digest = hashlib.sha256(bundle).hexdigest()
    shared = tmp_path / "supernode-home"
    monkeypatch.setenv("FLWR_HOME", str(shared))
    tampered = get_project_dir(RUN.fab_id, RUN.fab_version, digest)
    (tampered / "client").mkdir(parents=True)
    (tampered / "client" / "client_app.py").write_text("raise SystemExit('tampered code ran')\n")
    home = private_flower_home()
    assert home != shared and os.environ["FLWR_HOME"] == str(home)
    installed = install_from_fab(bundle, skip_prompt=True)
    assert installed == get_project_dir(RUN.fab_id, RUN.fab_version, digest) and home in installed.parents
    assert "tampered" not in (installed / "client" / "client_app.py").read_text()
    # The gate replaces names that Flower's run_clientapp looks up as module globals, in this order: pull the
    # task input (message and context bound), install the FAB, load the ClientApp. If a Flower upgrade changes
    # this, the gate must change too.
    import flwr.supernode.runtime.run_clientapp as runtime

    assert callable(runtime.pull_task_input) and callable(runtime.install_from_fab)
    source = inspect.getsource(runtime.run_clientapp)
    assert source.index("message, context, run, fab = pull_task_input(client)") < source.index(
        "install_from_fab(fab.content") < source.index("load_client_app_fn(")


def test_digest_of_the_app_directory_is_the_hash_of_flwr_build(tmp_path):
    """What a hospital approves (fab_digest of the reviewed source) is exactly what Flower builds and submits."""
    env = dict(os.environ, FLWR_HOME=str(tmp_path / "home"), FLWR_TELEMETRY_ENABLED="0",
               FLWR_DISABLE_UPDATE_CHECK="1")
    done = subprocess.run([bin_path("flwr"), "build", "--app", str(REPO)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    (fab,) = tmp_path.glob("*.fab")
    digest = fab_digest(fab)
    assert digest == hashlib.sha256(fab.read_bytes()).hexdigest()
    assert fab.name.split(".")[-2] == digest[:8]  # Flower's file name carries the hash prefix
    assert fab_digest(REPO) == digest


def test_cli_approve_and_start_arguments(tmp_path, capsys):
    bundle = tmp_path / "app.fab"
    bundle.write_bytes(b"bundle a")
    approved = tmp_path / "site" / "approved-apps.txt"
    assert cli_main(["site", "approve", "--bundle", str(bundle), "--approved", str(approved), "--note",
                     "fedpose 0.1.0 reviewed"]) == 0
    assert cli_main(["site", "approve", "--bundle", str(bundle), "--approved", str(approved)]) == 0
    assert "already approved" in capsys.readouterr().out
    assert load_approved(approved) == {A}
    assert approved.read_text() == f"{A}  # fedpose 0.1.0 reviewed\n"
    # The gate only covers ClientApps the SuperNode starts itself.
    assert cli_main(["site", "start", "--approved", str(approved), "--", "--isolation", "process"]) == 3
    assert "--isolation subprocess" in capsys.readouterr().err
    assert cli_main(["site", "start", "--approved", str(tmp_path / "none.txt"), "--", "--insecure"]) == 3
    assert "does not exist" in capsys.readouterr().err


def test_shim_runs_flowers_clientapp_through_the_gate(tmp_path):
    approved = tmp_path / "approved.txt"
    approved.write_text(f"{A}\n")
    shim = write_shim(tmp_path / "gate-bin", approved=approved)
    assert shim.name == "flwr-clientapp" and os.access(shim, os.X_OK)
    assert str(approved.resolve()) in shim.read_text() and sys.executable in shim.read_text()
    env = dict(os.environ, FLWR_TELEMETRY_ENABLED="0", FLWR_DISABLE_UPDATE_CHECK="1")
    done = subprocess.run([str(shim), "--help"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "--runtime-api-address" in done.stdout, done.stdout + done.stderr
    approved.write_text("# emptied\n")
    done = subprocess.run([str(shim), "--help"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "lists no digest" in done.stderr


def test_warm_start_forks_the_gated_clientapp_and_the_shim_falls_back_cold(tmp_path):
    """With the warm-start server the shim's ClientApp is a fork of it: same arguments, streams, exit code, and the
    approved list read again per message; without the server the shim runs the gate itself."""
    import time

    approved = tmp_path / "approved.txt"
    approved.write_text(f"{A}\n")
    sock = Path(tempfile.mkdtemp(prefix="fedpose-test-")) / "s.sock"
    env = dict(os.environ, FLWR_TELEMETRY_ENABLED="0", FLWR_DISABLE_UPDATE_CHECK="1",
               PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    server = subprocess.Popen([sys.executable, "-m", "fedpose.client.warm", "--socket", str(sock), "--approved",
                               str(approved)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not sock.exists() and server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sock.exists(), server.stdout.read() if server.poll() is not None else "no socket"
        assert oct(sock.stat().st_mode & 0o777) == "0o600"
        shim = write_shim(tmp_path / "gate-bin", approved=approved, warm_socket=sock)
        done = subprocess.run([str(shim), "--help"], env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and "--runtime-api-address" in done.stdout, done.stdout + done.stderr
        done = subprocess.run([str(shim), "--no-such-flag"], env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and "flwr-clientapp: error" in done.stderr  # argparse's exit code and stream
        approved.write_text("# emptied\n")  # read again at every message, by the forked child
        done = subprocess.run([str(shim), "--help"], env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode != 0 and "lists no digest" in done.stderr
        assert server.poll() is None  # a failing child never takes the server down
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert not sock.exists()
    approved.write_text(f"{A}\n")
    done = subprocess.run([str(shim), "--help"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "--runtime-api-address" in done.stdout  # cold: the shim ran the gate itself


def test_the_site_looks_for_messages_at_its_own_interval_in_the_installed_flowers_loop(tmp_path, monkeypatch, capsys):
    """Flower's SuperNode waits 3 s between two pulls that found nothing, and 0.5 s between two looks for a reply;
    ``fedpose site start --poll`` caps those waits of the installed Flower's loop (and refuses what it cannot)."""
    import importlib
    import time

    from fedpose.client.supernode import LOOP_MODULE
    from fedpose.shared.flower.waits import cap_waits

    loop = importlib.import_module(LOOP_MODULE)
    source = inspect.getsource(loop.start_client_internal) + inspect.getsource(loop._push_messages)
    assert "time.sleep(3)" in source and "time.sleep(0.5)" in source  # the waits this Flower has
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    monkeypatch.setattr(loop, "time", time)  # restored after the test
    assert cap_waits(loop, 0.2)
    loop.time.sleep(3)
    loop.time.sleep(0.5)
    loop.time.sleep(0.1)
    assert slept == [0.2, 0.2, 0.1]
    assert loop.time.monotonic is time.monotonic  # everything else is the time module's
    assert not cap_waits(SimpleNamespace(time=None), 0.2)  # a loop that does not wait through `time`: untouched

    # The SuperNode behind the cap is Flower's own entry point, with the site's arguments and exit codes.
    env = dict(os.environ, FLWR_TELEMETRY_ENABLED="0", FLWR_DISABLE_UPDATE_CHECK="1")
    done = subprocess.run([sys.executable, "-m", "fedpose.client.supernode", "--poll", "0.2", "--", "--help"],
                          env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0 and "--superlink" in done.stdout, done.stdout + done.stderr
    done = subprocess.run([sys.executable, "-m", "fedpose.client.supernode", "--", "--no-such-flag"], env=env,
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 2, done.stdout + done.stderr  # a usage error, which the supervisor never retries

    approved = tmp_path / "approved.txt"
    approved.write_text(f"{A}\n")
    for bad in ("0", "5", "-1"):
        assert cli_main(["site", "start", "--approved", str(approved), "--poll", bad, "--", "--insecure"]) == 3
        assert "--poll" in capsys.readouterr().err


def test_processes_that_wait_for_a_messages_objects_look_again_soon_in_the_installed_flower(monkeypatch):
    """A ClientApp starts while its SuperNode still fetches the message's objects, and the server lists a reply
    before its objects arrive; Flower then waits 1 s, 2 s, ... before it looks again. The site's SuperNode, its
    gated ClientApp and the ServerApp retry after 0.05 s (at most 0.5 s apart, within Flower's time limit)."""
    import importlib

    from fedpose.shared.flower.waits import FIRST_RETRY, LONGEST_RETRY, quick_pulls
    from flwr.supercore.constant import PULL_INITIAL_BACKOFF, PULL_MAX_TIME

    assert PULL_INITIAL_BACKOFF >= 1  # what the site would wait otherwise
    sites = {"flwr.supernode.start_client_internal": "pull_objects",  # the SuperNode (client.supernode)
             "flwr.supernode.runtime.run_clientapp": "pull_and_inflate_object_from_tree",  # the ClientApp (gate)
             "flwr.superlink.grid.http_grid": "pull_objects"}  # the ServerApp (server.server_app)
    for module_name, name in sites.items():
        module = importlib.import_module(module_name)
        monkeypatch.setattr(module, name, getattr(module, name))  # restored after the test
        assert quick_pulls(module, name), module_name
        assert quick_pulls(module, name)  # once is enough: wrapping again changes nothing
        defaults = inspect.signature(getattr(module, name)).parameters
        assert defaults["initial_backoff"].default == FIRST_RETRY < PULL_INITIAL_BACKOFF
        assert defaults["backoff_cap"].default == LONGEST_RETRY
        assert defaults["max_time"].default == PULL_MAX_TIME and defaults["max_tries_per_object"].default is None
    assert not quick_pulls(SimpleNamespace(pull_objects=lambda object_ids: None), "pull_objects")
    assert not quick_pulls(SimpleNamespace(), "pull_objects")
