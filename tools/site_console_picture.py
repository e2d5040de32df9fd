"""Draw the site console's picture in the docs (docs/img/console-site.png) from a site kit's pilot.

    python tools/site_console_picture.py [--reuse RUNS] [--rounds-shown 3] [--out docs/img/console-site.png]

The picture is what a hospital's console shows while its kit takes part in a pilot, not a test's page. The kits
are provisioned with the operator's guide's own command (docs/how-to/server.md: the default config and its
record-level recipe; two hospitals on this machine, ``--host 127.0.0.1``), so each site's policy is the kit's
default (epsilon 0.8, delta 1e-5, no Feature-DP opt-in). The server kit's and the sites' README lines then run as
written, but for what needs systemd or a service account (the README's own "to try it in a terminal" line starts
each SuperNode) and the install: this environment stands in for the kits' ``/opt/fedpose/venv``.

Everything runs in private namespaces, so nothing is left on the machine and nothing else is reached: its own
loopback network, and its own ``/opt``, ``/srv`` and ``/var/lib`` (overlays on this machine's, discarded at the
end). The kits therefore lie where they are laid out for a hospital: ``/opt/fedpose/hospital-a``, the site's
state in ``/var/lib/fedpose/hospital-a``, the server's files in ``/srv/fedpose``. Needs root or unprivileged user
namespaces (``unshare``), Chromium and Playwright (the test extra).

The picture is taken once hospital-a's ledger holds ``--rounds-shown`` finished rounds of the pilot, while it
runs. ``--reuse RUNS`` copies ``RUNS/data/ward`` and ``RUNS/pretrained`` (a run of the default config) where
``server prepare`` looks for them, which then checks them and skips the 20 minutes of public pretraining.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
INSIDE = "FEDPOSE_PICTURE_NAMESPACE"  # set in the re-executed process, inside the namespaces
SITES = {"hospital-a": "site-0", "hospital-b": "site-1"}  # kit -> the default ward's split it stands in for
SERVER = Path("/srv/fedpose")
INSTALL = Path("/opt/fedpose")
SKIP = ("python3 -m venv", "/bin/pip install", "useradd", "chown", "cp fedpose-supernode.service", "systemctl",
        "journalctl", "fedpose console", "fedpose site status", "fedpose server status", "Stop it with")


def provision_command(guide: str) -> str:
    """The operator's guide's ``fedpose provision`` command, for a pilot on this machine: the kits written to the
    install folder they are laid out for, the sites dialling 127.0.0.1. Everything else as the guide writes it."""
    block = re.search(r"```sh\n(fedpose provision .*?)```", guide, re.S)
    if block is None:
        raise SystemExit("docs/how-to/server.md has no ```sh block with the fedpose provision command")
    command = " ".join(line.rstrip("\\").strip() for line in block.group(1).splitlines())
    command = re.sub(r"--out \S+", f"--out {INSTALL}", command)
    command = re.sub(r"--sites \S+", f"--sites {','.join(SITES)}", command)
    return re.sub(r"--host \S+", "--host 127.0.0.1", command)


def readme_commands(readme: Path) -> list[str]:
    """The command lines of a kit's README.txt: the indented lines under its numbered steps."""
    return [line.strip() for line in readme.read_text().splitlines()
            if line.startswith("     ") and not line.strip().startswith(("[", "address", "root-certificates"))]


def trial_command(readme: Path) -> str:
    """The kit README's line that starts the SuperNode in a terminal, without systemd (its state where the service
    would keep it)."""
    found = re.search(r"(STATE_DIRECTORY=\S+ \./start-supernode\.sh)", readme.read_text())
    if found is None:
        raise SystemExit(f"{readme} has no line starting the SuperNode in a terminal")
    return found.group(1)


def _run(command: str, cwd: Path, env: dict[str, str]) -> str:
    print(f"$ {command}", flush=True)
    done = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"{command} exited {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done.stdout


def _start(command: str, cwd: Path, env: dict[str, str], log: Path) -> subprocess.Popen:
    print(f"$ {command} &  (log: {log})", flush=True)
    with log.open("w") as out:
        return subprocess.Popen(["bash", "-c", command], cwd=cwd, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _wait(what: str, ready, seconds: float, procs: list[subprocess.Popen]) -> None:
    end = time.monotonic() + seconds
    while not ready():
        if any(p.poll() is not None for p in procs) or time.monotonic() > end:
            raise SystemExit(f"gave up waiting for {what}")
        time.sleep(2)


def _isolate(scratch: Path) -> None:
    """Inside the new namespaces: loopback up; /opt, /srv and /var/lib as overlays whose changes live in a
    tmpfs that goes with the namespace."""
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(scratch)], check=True)
    for folder in ("/opt", "/srv", "/var/lib"):
        name = folder.strip("/").replace("/", "-")
        upper, work = scratch / name, scratch / f"{name}-work"
        upper.mkdir()
        work.mkdir()
        subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                        f"lowerdir={folder},upperdir={upper},workdir={work}", folder], check=True)


def pilot(args: argparse.Namespace, scratch: Path) -> None:
    _isolate(scratch)
    logs = scratch / "logs"
    logs.mkdir()
    env = dict(os.environ)
    env.update({"PATH": os.pathsep.join([str(INSTALL / "venv" / "bin"), str(Path(sys.executable).parent), env["PATH"]]),
                "FLWR_HOME": str(SERVER / "flwr"), "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
                "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
                "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])})
    (SERVER / "flwr").mkdir(parents=True)
    _run(provision_command((REPO / "docs" / "how-to" / "server.md").read_text()), REPO, env)
    (INSTALL / "venv").symlink_to(sys.prefix)  # this environment is the kits' install
    if args.reuse:
        runs = Path(args.reuse).resolve()
        shutil.copytree(runs / "data" / "ward", SERVER / "runs" / "data" / "ward")
        shutil.copytree(runs / "pretrained", SERVER / "runs" / "pretrained")
    server = INSTALL / "server"
    procs: list[subprocess.Popen] = []
    try:
        digest, run_line = None, None
        for command in readme_commands(server / "README.txt"):
            if command.startswith(SKIP) or any(part in command for part in SKIP):
                continue
            if command == "./start-superlink.sh":
                procs.append(_start(command, server, env, logs / "superlink.log"))
            elif command.startswith("fedpose server run") and "--resume" not in command:
                run_line = command
            elif command.startswith("fedpose server export-public"):
                (digest,) = set(re.findall(r"digest ([0-9a-f]{64})", _run(command, server, env)))
            elif command.startswith("fedpose "):
                _run(command, server, env)
            # ./register-sites.sh runs once the sites have sent their keys (below)
        (address,) = re.findall(r'address = "([^"]+)"', (server / "README.txt").read_text())
        (SERVER / "flwr" / "config.toml").write_text(f'[superlink]\ndefault = "pilot"\n\n[superlink.pilot]\n'
                                                     f'address = "{address}"\nroot-certificates = '
                                                     f'"{server / "ca.crt"}"\n')
        if digest is None or run_line is None:
            raise SystemExit("the server README has no export-public or server run line")
        starts = []
        for kit_name, split in SITES.items():
            kit = INSTALL / kit_name
            values = {"/path/to/your/split": str(SERVER / "runs" / "data" / "ward" / split),
                      "/path/to/public-split.tar.gz": str(SERVER / "public-split.tar.gz"), "DIGEST": digest,
                      "APP.fab": str(SERVER / "app.fab")}
            cwd = kit
            for command in readme_commands(kit / "README.txt"):
                if command.startswith("cd "):
                    cwd = Path(shlex.split(command)[1])
                    continue
                if command.startswith(("(To try it", "Stop it")) or any(part in command for part in SKIP):
                    continue
                for placeholder, value in values.items():
                    command = command.replace(placeholder, value)
                _run(command, cwd, env)
            shutil.copyfile(kit / "node.key.pub", server / "site-keys" / f"{kit_name}.pub")  # what a site sends
            starts.append((kit, trial_command(kit / "README.txt"), kit_name))
        _run("./register-sites.sh", server, env)
        for kit, command, kit_name in starts:
            procs.append(_start(command, kit, env, logs / f"supernode-{kit_name}.log"))
        procs.append(_start(run_line, server, env, logs / "server-run.log"))
        site = INSTALL / "hospital-a"

        def rounds_done() -> bool:
            done = subprocess.run(["bash", "-c", "fedpose site status --policy policy.yaml --json"], cwd=site,
                                  env=env, capture_output=True, text=True, timeout=300)
            try:
                report = json.loads(done.stdout)
            except ValueError:
                return False
            return sum(r.get("state") == "done" for r in report.get("rounds", [])) >= args.rounds_shown

        _wait(f"{args.rounds_shown} rounds at hospital-a", rounds_done, 3 * 3600, procs)
        picture(site, env, logs, Path(args.out).resolve())
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                os.killpg(proc.pid, 15)
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
        if args.keep_logs:
            shutil.copytree(logs, Path(args.keep_logs), dirs_exist_ok=True)


def picture(site: Path, env: dict[str, str], logs: Path, out: Path) -> None:
    """The kit README's console line, as Chromium shows it on a hospital's screen."""
    from playwright.sync_api import sync_playwright

    port = 8480  # the console's own default, on this namespace's loopback
    proc = _start(f"fedpose console --policy policy.yaml --port {port}", site, env, logs / "console.log")
    url = f"http://127.0.0.1:{port}/"

    def answers() -> bool:
        try:
            with urllib.request.urlopen(url + "api/status", timeout=5):
                return True
        except OSError:
            return False

    try:
        _wait("the site console", answers, 120, [proc])
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=shutil.which("chromium") or "/usr/bin/chromium",
                                         headless=True, args=["--no-sandbox", "--disable-gpu", "--no-first-run"])
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(url)
            page.wait_for_selector("[data-testid=lifetime-spent]", timeout=60_000)
            time.sleep(6)  # one refresh of the page's own, so it shows what the ledger holds now
            page.screenshot(path=str(out), full_page=True)
            browser.close()
        print(f"wrote {out}", flush=True)
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=30)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(REPO / "docs" / "img" / "console-site.png"), help="the picture")
    parser.add_argument("--rounds-shown", type=int, default=3, help="rounds of the pilot done at hospital-a when "
                        "the picture is taken (default 3)")
    parser.add_argument("--reuse", help="a runs/ folder of the default config whose data/ward and pretrained the "
                        "server's prepare checks and reuses")
    parser.add_argument("--keep-logs", help="copy the pilot's logs (SuperLink, SuperNodes, server run) here")
    args = parser.parse_args(argv)
    if os.environ.get(INSIDE):
        pilot(args, Path(os.environ[INSIDE]))
        return 0
    scratch = Path(tempfile.mkdtemp(prefix="fedpose-picture-"))
    try:
        unshare = ["unshare", "--mount", "--net", "--propagation", "private"]
        if os.geteuid() != 0:
            unshare.append("--map-root-user")
        return subprocess.run([*unshare, sys.executable, __file__, *(argv if argv is not None else sys.argv[1:])],
                              env={**os.environ, INSIDE: str(scratch)}).returncode
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
