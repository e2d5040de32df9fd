"""Draw the console pictures in the docs (docs/img/console-site.png, console-server.png) from the kits' pilot.

    python tools/console_pictures.py [--reuse RUNS] [--rounds-shown 3] [--out docs/img]

The pictures are what the consoles show while the kits take part in a pilot, not a test's pages: hospital-a's
console, as its kit's README starts it, and the federation's, as the server kit's README starts it. The kits
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

Both pictures are taken while the pilot runs, at the same moment: once the server has aggregated
``--rounds-shown`` rounds and hospital-a is charged for the next one. ``--reuse RUNS``
copies ``RUNS/data/ward`` and ``RUNS/pretrained`` (a run of the default config) where ``server prepare`` looks
for them, which then checks them and skips the 20 minutes of public pretraining.
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
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
INSIDE = "FEDPOSE_PICTURE_NAMESPACE"  # set in the re-executed process, inside the namespaces
SITES = {"hospital-a": "site-0", "hospital-b": "site-1"}  # kit -> the default ward's split it stands in for
SERVER = Path("/srv/fedpose")
INSTALL = Path("/opt/fedpose")
PICTURES = {"hospital-a": "console-site.png", "server": "console-server.png"}  # kit -> its console's picture
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


def console_line(readme: Path) -> str:
    """The kit README's line that opens its console (the site's on its policy, the server's on its run folder)."""
    lines = [line for line in readme_commands(readme) if re.match(r"(\S*/)?fedpose console ", line)]
    if len(lines) != 1:
        raise SystemExit(f"{readme} has {len(lines)} lines opening the console, not one")
    return lines[0]


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
        (run_folder,) = re.findall(r"--out (\S+)", run_line)

        rounds = Path(run_folder) / "rounds.jsonl"  # the server's record of each round it aggregated
        _wait("the server's first round", rounds.is_file, 3 * 3600, procs)  # its console opens a run folder
        consoles = [_console(kit, env, logs, 8480 + i) for i, kit in enumerate((site, server))]
        procs += [proc for proc, _ in consoles]
        out = Path(args.out).resolve()
        selectors = ("[data-testid=lifetime-spent]", f"[data-testid=round-pckh-{args.rounds_shown}]")
        shots = [(url, selector, out / PICTURES[kit.name])
                 for kit, (_, url), selector in zip((site, server), consoles, selectors)]

        def moment() -> None:
            """The server has aggregated --rounds-shown rounds and asked for the next, which hospital-a has charged:
            the server counts a round it asked for as spent, so both pages then show the same epsilon."""
            _wait(f"{args.rounds_shown} rounds", lambda: len(rounds.read_text().splitlines()) >= args.rounds_shown,
                  3 * 3600, procs)

            def charged() -> bool:
                with urllib.request.urlopen(consoles[0][1] + "api/status", timeout=30) as answer:
                    return json.load(answer)["budget"]["lifetime"]["rounds"] > args.rounds_shown

            try:
                _wait("hospital-a charged for the next round", charged, 120, procs)
            except SystemExit:  # the last round of the run, or a site that does not take part: as it is
                pass

        pictures(shots, moment)
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


def _console(kit: Path, env: dict[str, str], logs: Path, port: int) -> tuple[subprocess.Popen, str]:
    """The kit README's console line, in the kit's folder, on ``port`` of this namespace's loopback, once it
    answers: (its process, its URL)."""
    proc = _start(f"{console_line(kit / 'README.txt')} --port {port}", kit, env, logs / f"console-{kit.name}.log")
    url = f"http://127.0.0.1:{port}/"

    def answers() -> bool:
        try:
            with urllib.request.urlopen(url + "api/status", timeout=5):
                return True
        except OSError:
            return False

    _wait(f"the console of {kit.name}", answers, 120, [proc])
    return proc, url


def pictures(shots: list[tuple[str, str, Path]], moment: Callable[[], None]) -> None:
    """Each console's page (URL, what shows it has its data, the picture), as Chromium shows it on the operator's
    screen: the pages are open before ``moment`` returns and loaded again at once after it, so that the pictures
    show the same moment of the pilot (a round lasts some 20 seconds here; a page refreshes itself every 5)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=shutil.which("chromium") or "/usr/bin/chromium",
                                     headless=True, args=["--no-sandbox", "--disable-gpu", "--no-first-run"])
        pages = [browser.new_page(viewport={"width": 1280, "height": 900}) for _ in shots]
        for page, (url, _, _) in zip(pages, shots):
            page.goto(url)
        moment()
        for page in pages:
            page.reload()
        for page, (_, selector, _) in zip(pages, shots):
            page.wait_for_selector(selector, timeout=60_000)
        for page, (_, _, out) in zip(pages, shots):
            page.screenshot(path=str(out), full_page=True)
            print(f"wrote {out}", flush=True)
        browser.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(REPO / "docs" / "img"), help="the folder the pictures go to, as "
                        + " and ".join(PICTURES.values()) + " (default docs/img)")
    parser.add_argument("--rounds-shown", type=int, default=3, help="rounds of the pilot the server has aggregated "
                        "when the pictures are taken (default 3)")
    parser.add_argument("--reuse", help="a runs/ folder of the default config whose data/ward and pretrained the "
                        "server's prepare checks and reuses")
    parser.add_argument("--keep-logs", help="copy the pilot's logs (SuperLink, SuperNodes, server run, consoles) here")
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
