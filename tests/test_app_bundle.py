"""The app bundle the sites approve, written from what a fedpose install holds (no source checkout).

``fedpose server build-app --out DIR`` writes the Flower app (pyproject.toml with ``[tool.flwr.app]`` and the
apps' packages and configs, copied from the installed package) and its bundle ``DIR.fab``; ``flwr build --app
DIR``, and ``flwr run DIR`` (what ``fedpose server run --app DIR`` submits), give the same bytes. The test in
tests/test_site_kit.py runs it from a wheel installed from a kit.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tomllib

from support.federation import REPO, bin_path, flower_env

from fedpose.server.kits.bundle import PACKAGES


def test_build_app_writes_the_app_that_flwr_builds_into_the_bundle_it_wrote(tmp_path, capsys):
    from fedpose.cli.main import main

    app = tmp_path / "srv" / "app"
    assert main(["server", "build-app", "--out", str(app)]) == 0
    out = capsys.readouterr().out
    fab = tmp_path / "srv" / "app.fab"
    digest = hashlib.sha256(fab.read_bytes()).hexdigest()
    assert str(app) in out and str(fab) in out and digest in out
    # the app's Flower configuration is the repository's own, from one description
    ours = tomllib.loads((app / "pyproject.toml").read_text())
    repo = tomllib.loads((REPO / "pyproject.toml").read_text())
    # (but for what it carries: the installed fedpose package here, the same packages' folders in a checkout)
    carried = ["fedpose/**", "pyproject.toml"]
    assert ours["tool"]["flwr"]["app"].pop("fab-include") == carried
    assert repo["tool"]["flwr"]["app"].pop("fab-include") == [f"{p}/**" for p in PACKAGES] + ["pyproject.toml"]
    assert ours["tool"]["flwr"]["app"] == repo["tool"]["flwr"]["app"]
    assert (ours["project"]["name"], ours["project"]["version"]) == (repo["project"]["name"],
                                                                     repo["project"]["version"])
    assert (app / "fedpose" / "configs" / "default.yaml").is_file()
    assert (app / "fedpose" / "server" / "server_app.py").is_file()
    assert not list(app.rglob("__pycache__"))
    # `flwr build`, as the kit's README says it (in a folder of its own), gives the same bytes
    build = tmp_path / "build"
    build.mkdir()
    done = subprocess.run([bin_path("flwr"), "build", "--app", str(app)], cwd=build, env=flower_env(tmp_path / "h"),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    (built,) = build.glob("*.fab")
    assert built.read_bytes() == fab.read_bytes()
    # the components load from the app folder alone (what a SuperNode does with the bundle)
    code = "import fedpose.server.server_app as s, fedpose.client.client_app, sys; print(s.__file__)"
    env = {k: v for k, v in flower_env(tmp_path / "h").items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", code], cwd=app, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith(str(app)), done.stdout + done.stderr

    # again (a new release): the folder build-app wrote is replaced, the same bytes come out
    (app / "fedpose" / "server" / "stale.py").write_text("x = 1\n")
    assert main(["server", "build-app", "--out", str(app)]) == 0
    assert not (app / "fedpose" / "server" / "stale.py").exists()
    assert hashlib.sha256(fab.read_bytes()).hexdigest() == digest
    # a folder it did not write is never emptied
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep\n")
    capsys.readouterr()
    assert main(["server", "build-app", "--out", str(other)]) != 0
    assert "not written by fedpose server build-app" in capsys.readouterr().err
    assert (other / "notes.txt").read_text() == "keep\n"


def test_server_run_names_build_app_when_its_app_folder_is_not_an_app(tmp_path, capsys):
    from fedpose.cli.main import main

    assert main(["server", "run", "--connection", "pilot", "--out", str(tmp_path / "run"), "--app",
                 str(tmp_path)]) != 0
    assert "fedpose server build-app" in capsys.readouterr().err
