"""A hospital follows its kit, exactly as the kit's README says, to a finished pilot on 127.0.0.1.

``fedpose provision`` writes the kits (into a temporary folder standing in for /opt/fedpose, with the
state folder standing in for /var/lib/fedpose). The test then reads the command lines of each kit's
README.txt and runs them as written, substituting only what a reader substitutes: the paths of their
own data and of the bundle the operator sent. What needs root or systemd (the service account, systemctl,
journalctl) is skipped; the README's own "try it in a terminal" line starts the SuperNode instead. The install
lines run as written, from the wheel and constraints.txt the kit holds, into a new virtual environment in
which the lock's packages (but fedpose and Flower) are present beforehand; from then on nothing of this
checkout is importable. Two sites, TLS, node authentication with the sites' own keys, the app gate,
``fedpose server run`` reaching a finished run, then ``fedpose site status`` reporting the spend.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from fedpose.server.front import healthy
from support.federation import flower_env, free_port, prepare_world, start, stop, wait_for, world_root
from fedpose.shared.configuration.schema import dump_config, replace

pytestmark = pytest.mark.slow

# Lines a test cannot run (root, systemd); everything else in the READMEs runs as written, the install included.
SKIP = ("useradd", "chown", "cp fedpose-supernode.service", "systemctl", "journalctl", "fedpose console",
        "Stop it with")
# What the kit's install takes from the package index, made present beforehand (the test's one shortcut): this
# environment's packages, fedpose and Flower left out, so pip installs those two (Flower's scripts included) from
# the kit's wheel and the index, and finds the rest of the lock installed; a full install takes minutes.
NOT_PRESENT = ("fedpose", "__editable__", "flwr", "pip", "setuptools", "_distutils_hack", "distutils-precedence",
               "__pycache__")


def _venv(command: str, cwd: Path, env: dict[str, str], venv: Path, present: Path) -> None:
    """The README's `python3 -m venv` (with this interpreter's Python), then the lock's packages made present."""
    _run(command.replace("python3", sys.executable, 1), cwd, env)
    (site_packages,) = venv.glob("lib/python*/site-packages")
    if not present.exists():
        present.mkdir()
        for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
            if not entry.name.startswith(NOT_PRESENT):
                (present / entry.name).symlink_to(entry)
    (site_packages / "_lock_present.pth").write_text(f"{present}\n")


def _commands(readme: Path) -> list[str]:
    """The command lines of a kit README: indented lines under the numbered steps (continuations joined)."""
    out = []
    for line in readme.read_text().splitlines():
        if line.startswith("     ") and not line.strip().startswith(("[", "address", "root-certificates")):
            out.append(line.strip())
    return out


def _run(command: str, cwd: Path, env: dict[str, str], timeout: float = 600) -> str:
    done = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_a_hospital_follows_its_kit_to_a_finished_pilot(tmp_path: Path, tmp_path_factory) -> None:
    cfg = prepare_world(world_root(tmp_path_factory), rounds=2, federation={"local_steps": 1, "round_timeout": 240})
    cfg = replace(cfg, **{"train.method": "proj"})  # record-level: what a kit's policy accepts without an opt-in
    config = tmp_path / "federation.yaml"
    dump_config(cfg, config)
    data = Path(cfg.data.root)
    kits, state, srv = tmp_path / "kits", tmp_path / "state", tmp_path / "srv"
    venv = tmp_path / "venv"  # the kits' --venv: made and filled by the READMEs' own install lines
    env = flower_env(tmp_path / "flwr-home")
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]])
    port, control_port = free_port(), free_port()
    sites = ["site-0", "site-1"]
    # the operator provisions from this checkout: the kits get the wheel built from it and its constraints.txt
    _run(f"fedpose provision --out {kits} --sites {','.join(sites)} --host 127.0.0.1 --port {port} "
         f"--control-port {control_port} "
         f"--config {config} --install-dir {kits} --state-dir {state} --venv {venv}", tmp_path, env)
    # from here on only what the kits installed runs: their venv first on PATH, nothing of this checkout
    env.pop("PYTHONPATH", None)
    env["PATH"] = os.pathsep.join([str(venv / "bin"), os.environ["PATH"]])
    server = kits / "server"
    bundle = digest = None
    procs = []
    try:
        # -- the operator, first half: prepare, SuperLink, connection (the README's steps 2-4), the app (6)
        server_cmds = _commands(server / "README.txt")
        subst = {"/srv/fedpose": str(srv)}

        def fill(command: str, mapping: dict[str, str]) -> str:
            for key, value in mapping.items():
                command = command.replace(key, value)
            return command

        for command in server_cmds:
            if command.startswith("python3 -m venv"):
                _venv(command, server, env, venv, tmp_path / "present")
            elif "/bin/pip install" in command:
                _run(command, server, env)
            elif command.startswith("fedpose server prepare"):
                _run(fill(command, subst), server, env)
            elif command.startswith("fedpose server export-public"):
                (digest,) = set(re.findall(r"digest ([0-9a-f]{64})", _run(fill(command, subst), server, env)))
            elif command == "./start-superlink.sh":
                procs.append(start(["bash", "-c", f"cd {server} && {command}"], tmp_path / "superlink.log", env))
            elif command.startswith("fedpose server build-app"):
                _run(fill(command, subst), server, env)
                bundle = srv / "app.fab"
                # built from the kit's wheel as installed (no checkout), and a site's own rebuild is the same bytes
                where = _run("python -c 'import fedpose.server.server_app as s; print(s.__file__)'", tmp_path, env)
                assert where.startswith(str(venv)) and "site-packages" in where, where
                _run(f"fedpose server build-app --out {tmp_path / 'site-check' / 'app'}", tmp_path, env)
                assert (tmp_path / "site-check" / "app.fab").read_bytes() == bundle.read_bytes()
        assert bundle is not None and digest is not None, server_cmds
        wait_for(lambda: healthy(f"127.0.0.1:{port}", server / "ca.crt") or procs[0].poll() is not None, 120,
                 "the SuperLink", poll=1.0)
        assert procs[0].poll() is None, (tmp_path / "superlink.log").read_text()[-3000:]
        # step 4 of the server README, as it says: the connection in $FLWR_HOME/config.toml (the SuperLink's own
        # address on this machine; the sites dial 127.0.0.1:{port}, which passes the Fleet API only)
        (address,) = re.findall(r'address = "([^"]+)"', (server / "README.txt").read_text())
        assert address == f"127.0.0.1:{control_port}"
        (tmp_path / "flwr-home" / "config.toml").write_text(
            f'[superlink]\ndefault = "pilot"\n\n[superlink.pilot]\naddress = "{address}"\n'
            f'root-certificates = "{server / "ca.crt"}"\n')

        # -- each hospital: its kit README, as written
        starts = []
        for i, site in enumerate(sites):
            kit = kits / site
            # what the operator sent: the public split's archive, its digest, the bundle
            mapping = {"/path/to/your/split": str(data / site), "/path/to/public-split.tar.gz":
                       str(srv / "public-split.tar.gz"), "DIGEST": digest, "APP.fab": str(bundle)}
            cwd = kit
            for command in _commands(kit / "README.txt"):
                if command.startswith(SKIP) or any(skip in command for skip in SKIP):
                    continue
                if command.startswith("cd "):
                    cwd = Path(shlex.split(command)[1])
                    continue
                if command.startswith("(To try it in a terminal"):
                    continue
                if command.startswith("python3 -m venv"):
                    _venv(command, cwd, env, venv, tmp_path / "present")
                    continue
                _run(fill(command, mapping), cwd, env)
            assert (kit / "node.key").is_file() and oct((kit / "node.key").stat().st_mode & 0o777) == "0o600"
            # the site sends node.key.pub; the operator puts it where the server README says
            (server / "site-keys" / f"{site}.pub").write_text((kit / "node.key.pub").read_text())
            trial = next(line for line in (kit / "README.txt").read_text().splitlines()
                         if "./start-supernode.sh" in line)
            command = re.search(r"(STATE_DIRECTORY=\S+ \./start-supernode\.sh)", trial).group(1)
            starts.append((kit, command, site))
        # -- the operator registers the keys the sites sent (the README's step 5; before the bundle of step 6
        # reaches the sites, which approve it in their step 4): then the sites start (their step 5)
        assert "./register-sites.sh" in server_cmds
        _run("./register-sites.sh", server, env)
        for kit, command, site in starts:
            procs.append(start(["bash", "-c", f"cd {kit} && {command}"], tmp_path / f"supernode-{site}.log", env))

        # -- the operator, second half: run and follow (the README's step 6), its status (7)
        run_line = None
        for command in server_cmds:
            if command.startswith("fedpose server run") and "--resume" not in command:
                run_line = fill(command, subst)
        assert run_line is not None
        out = _run(run_line + " --poll 3", server, env, timeout=900)
        assert "finished: PCKh" in out, out
        metrics = json.loads((srv / "run1" / "metrics.json").read_text())
        assert metrics["rounds"] == 2 and set(metrics["sites"]) == set(sites)
        # the README's status line (step 7): the run ended, and each site's spend
        (status_line,) = [c for c in server_cmds if c.startswith("fedpose server status")]
        status = _run(fill(status_line, subst), server, env)
        assert "finished" in status.splitlines()[0] and all(f"  {site}: eps " in status for site in sites), status

        # the README's status line, while the SuperLink is up: everything checks out; the rounds are used up
        for site in sites:
            done = subprocess.run(["bash", "-c", "fedpose site status --policy policy.yaml --json"], cwd=kits / site,
                                  env=env, capture_output=True, text=True, timeout=120)
            report = json.loads(done.stdout)
            assert report["problems"] == [p for p in report["problems"] if "lifetime rounds are used" in p], report
            life = report["budget"]["lifetime"]
            assert life["rounds"] == 2 and life["spent"] > 0
            assert life["spent"] == pytest.approx(metrics["sites"][site]["epsilon_lifetime"], rel=1e-6)
            assert report["superlink"]["reachable"] and report["checks"]["current"]
            assert len(report["bundles"]["approved"]) == 1 and report["certificate"]["days_left"] > 300
            # the kit's record-level default, as the site's console shows it
            assert report["policy"]["guarantee"].startswith("record-level DP")
            assert report["policy"]["methods"] == ["dpsgd", "proj"]
            assert {r["method"] for r in report["rounds"]} == {"proj"}
    finally:
        stop(*procs)
