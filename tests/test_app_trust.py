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
from pathlib import Path
from types import SimpleNamespace

import pytest

from cli.main import main as cli_main
from client.app_trust import (
    UnapprovedAppError,
    check_fab,
    fab_digest,
    gated_pull,
    load_approved,
    parse_approved,
    write_shim,
)
from federation_support import REPO, bin_path

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


def test_gate_checks_before_flower_installs_or_loads_the_bundle():
    fab = SimpleNamespace(hash_str=B, content=b"bundle b")
    pulled = gated_pull(lambda client: ("msg", "ctx", "run", fab), frozenset({A}))
    with pytest.raises(UnapprovedAppError):
        pulled(None)
    ok = SimpleNamespace(hash_str=A, content=b"bundle a")
    assert gated_pull(lambda client: ("m", "c", "r", ok), frozenset({A}))(None)[3] is ok
    # The gate replaces Flower's pull_task_input, which run_clientapp calls by its module-global name before
    # install_from_fab and the ClientApp import: if a Flower upgrade moves this, the gate must move too.
    import flwr.supernode.runtime.run_clientapp as runtime

    source = inspect.getsource(runtime.run_clientapp)
    assert source.index("pull_task_input(client)") < source.index("install_from_fab(") < source.index(
        "load_client_app_fn(")


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
    assert cli_main(["site", "start", "--approved", str(approved), "--", "--isolation", "process"]) == 2
    assert "--isolation subprocess" in capsys.readouterr().err
    assert cli_main(["site", "start", "--approved", str(tmp_path / "none.txt"), "--", "--insecure"]) == 2
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
