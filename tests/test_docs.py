"""The documentation is built and checked like code.

- The site builds with ``mkdocs build --strict`` (a dead link, a missing anchor or a page left out of the
  navigation fails it).
- The generated references (CLI, configuration, the kit files the guides show) and the rendered results
  tables are current.
- Every ``fedpose ...`` command the README and the docs show parses with the real parser.
- User docs speak to users: no issue numbers, no session talk, no acceptance targets; the README is a short
  entry point whose first two code blocks are the main command and the test command.
- The centralized tutorial's command, run on a tiny ward, prints the lines the page shows.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from support.federation import REPO, tiny_dict

DOCS = REPO / "docs"
USER_DOCS = [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]
GENERATED = {DOCS / "reference" / "cli.md"}  # usage lines written from the parser itself


def _fenced_lines(text: str) -> list[str]:
    """The lines of the fenced code blocks, backslash continuations joined."""
    out, inside, current = [], False, ""
    for line in text.splitlines():
        if line.strip().startswith("```"):
            inside = not inside
            continue
        if not inside:
            continue
        current += line.rstrip()[:-1] + " " if line.rstrip().endswith("\\") else line
        if not line.rstrip().endswith("\\"):
            out.append(current.strip())
            current = ""
    return out


def _fedpose_commands(text: str) -> list[list[str]]:
    commands = []
    for line in _fenced_lines(text):
        for part in re.split(r"\s&&\s|\s\|\s", line):
            if not re.match(r"^(?:\S+=\S+\s+)*(?:sudo(?:\s+-u\s+\S+)?\s+)?(?:\S*/)?fedpose\s", part.strip()):
                continue
            try:
                words = shlex.split(part, comments=True)
            except ValueError as err:
                raise AssertionError(f"cannot split the shell line {part!r}: {err}") from err
            at = next(i for i, w in enumerate(words) if Path(w).name == "fedpose")
            commands.append(words[at + 1:])
    return commands


def test_the_site_builds_strictly(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "site" / "results" / "index.html").is_file()


@pytest.mark.parametrize("tool", ["tools/docs_reference.py", "tools/render_results.py"])
def test_generated_pages_are_current(tool):
    done = subprocess.run([sys.executable, tool, "--check"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_cli_reference_lists_no_hidden_option():
    """An option hidden from --help (argparse.SUPPRESS) showed on the CLI page as '==SUPPRESS=='."""
    sys.path.insert(0, str(REPO / "tools"))
    try:
        from docs_reference import cli_page
    finally:
        sys.path.remove(str(REPO / "tools"))
    page = cli_page()
    assert "SUPPRESS" not in page and "--tolerance" not in page


def test_every_fedpose_command_in_the_docs_parses():
    from fedpose.cli.main import build_parser

    bad, seen = [], 0
    for page in USER_DOCS:
        if page in GENERATED:
            continue
        for argv in _fedpose_commands(page.read_text()):
            seen += 1
            try:
                build_parser().parse_args(argv)
            except SystemExit as err:
                if err.code == 0:  # --version, --help
                    continue
                bad.append(f"{page.relative_to(REPO)}: fedpose {' '.join(argv)}")
    assert seen > 30, seen  # the extraction finds the commands
    assert not bad, "commands the parser refuses:\n" + "\n".join(bad)


CODE_DIRS = ("shared", "client", "server", "edge", "cli", "configs", "benchmarks", "tools", "tests")


def test_every_docs_path_cited_in_code_exists():
    """A page under docs/ that code cites is there (pages move; references rot). A path inside another
    repository (``onnx-tensorrt/docs/...``) is not ours."""
    cited = re.compile(r"(?<![\w/.-])docs/[\w./-]*?\.md\b")
    files = [p for d in CODE_DIRS for p in sorted((REPO / d).rglob("*.py"))]
    seen, bad = 0, []
    for path in files:
        for i, line in enumerate(path.read_text().splitlines()):
            for ref in cited.findall(line):
                seen += 1
                if not (REPO / ref).is_file():
                    bad.append(f"{path.relative_to(REPO)}:{i + 1}: {ref}")
    assert seen > 10, seen  # the scan finds the references
    assert not bad, "docs pages cited in code that do not exist:\n" + "\n".join(bad)


def test_user_docs_speak_to_users():
    talk = re.compile(r"issue ?#?\d+|#\d{2}\b|this session|acceptance target|\bturn \d|\bround \d of the", re.I)
    found = [f"{p.relative_to(REPO)}:{i + 1}: {line.strip()[:90]}" for p in USER_DOCS
             for i, line in enumerate(p.read_text().splitlines()) if talk.search(line)]
    assert not found, "\n".join(found)
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    blocks = re.findall(r"```\n(.*?)\n```", readme, re.S)
    assert "fedpose simulate" in blocks[0] and "pytest" in blocks[1]
    for name in ("LICENSE", "CITATION.cff", "SECURITY.md", "CHANGELOG.md"):
        assert (REPO / name).is_file(), name


def test_the_centralized_tutorial_prints_what_its_page_shows(tmp_path):
    """tutorials/centralized.md's first command, on a tiny ward with a few steps: the lines the page shows."""
    import json

    page = (DOCS / "tutorials" / "centralized.md").read_text()
    argv = _fedpose_commands(page)[0]
    assert argv[:5] == ["train", "--config", "default", "--method", "fpdp"]
    data = tiny_dict(tmp_path / "w")
    sets = [f"{k}={json.dumps(v)}" for k, v in _flat(data).items() if not k.startswith(("federation.", "runtime."))]
    sets.append("train.epochs=2")
    argv = [a if a != "runs/fpdp" else str(tmp_path / "fpdp") for a in argv]
    done = subprocess.run([sys.executable, "-m", "fedpose.cli.main", *argv, *[x for s in sets for x in ("--set", s)],
                           "--quiet"], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    for shown in re.findall(r"^(PCKh@0.5 mean: |data: synthetic ward at |privacy: epsilon spent = )", page, re.M):
        assert shown in done.stdout, (shown, done.stdout[-2000:])
    assert (tmp_path / "fpdp" / "metrics.json").is_file()


def _flat(data: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and k != "synth":
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def test_the_quickstart_runs_as_its_page_says_on_a_tiny_ward(tmp_path):
    """tutorials/quickstart.md's commands in order (the federation on a tiny ward of 2 sites and 2 rounds, the
    camera step as written): the outputs the page names exist and the lines it shows are printed."""
    import json

    page = (DOCS / "tutorials" / "quickstart.md").read_text()
    commands = _fedpose_commands(page)
    assert [c[:2] for c in commands] == [["simulate", "--config"], ["edge", "demo-video"], ["edge", "export"],
                                         ["edge", "run"]]
    data = tiny_dict(tmp_path / "w")
    sets = [f"{k}={json.dumps(v)}" for k, v in _flat(data).items() if not k.startswith("runtime.")]
    outputs = []
    for argv in commands:
        argv = [a.replace("runs/", f"{tmp_path}/runs/") for a in argv]
        if argv[0] == "simulate":  # as the page runs it, not --quiet: its output is what a user reads
            argv += [x for s in sets for x in ("--set", s)]
        done = subprocess.run([sys.executable, "-m", "fedpose.cli.main", *argv], cwd=tmp_path, capture_output=True,
                              text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert done.returncode == 0, (argv, done.stdout[-2000:], done.stderr[-3000:])
        outputs.append(done.stdout)
        if argv[0] == "simulate":  # read through a pipe: no terminal codes, no Ray markers, Flower's lines once
            printed = done.stdout + done.stderr
            assert "\x1b[" not in printed, [line for line in printed.splitlines() if "\x1b[" in line][:5]
            assert "[repeated" not in printed and "RAY_DEDUP_LOGS" not in printed
            assert "DEBUG" not in printed, [line for line in printed.splitlines() if "DEBUG" in line][:5]
            claim = json.loads((tmp_path / "runs" / "federation" / "metrics.json").read_text())["claim"]
            assert printed.count(claim) == 1, printed.count(claim)
    shown = re.search(r"```\n(Method .*?)\n```", page, re.S).group(1)
    for prefix in ("PCKh@0.5: start ", "data: synthetic ward at ", "privacy spent per site", "claim: (eps="):
        assert prefix in shown and prefix in outputs[0], prefix
    runs = tmp_path / "runs"
    for name in ("federation/model.pt", "federation/metrics.json", "federation/rounds.jsonl", "federation/report.md",
                 "federation/federation.png", "model.onnx", "edge/keypoints.jsonl", "edge/annotated.mp4"):
        assert (runs / name).is_file(), name
    assert any((runs / "edge" / "pixelized").iterdir()) and "Released by this run" in outputs[-1]


def test_the_edge_outputs_reference_lists_every_box_source_the_camera_writes():
    """keypoints.jsonl's ``box_source``: every value the pipeline returns with a box is named on the reference page."""
    code = "\n".join(p.read_text() for p in sorted((REPO / "edge" / "pipeline").glob("*.py")))
    written = set(re.findall(r"^\s*return .*\),\s*\"([a-z]+)\"\s*$", code, re.M))
    assert {"track", "roi", "full", "external"} <= written, written  # the extraction finds them
    page = (DOCS / "reference" / "file-formats.md").read_text()
    listed = re.search(r"`box_source` \((.*?)\)", page, re.S)
    assert listed, "file-formats.md names box_source with its values in parentheses"
    named = set(re.findall(r"`([a-z]+)`", listed.group(1)))
    assert written <= named, f"box_source values written but not on the page: {sorted(written - named)}"


def test_the_readme_states_a_start_that_covers_every_cpu_measured():
    """The main command's start moves with the CPU (its kernels sum in their own order): the README names the start
    on each CPU measured and a range that holds every one of them, so a fresh run on any of them falls inside."""
    import json

    machines = json.loads((REPO / "benchmarks" / "results" / "start_by_cpu.json").read_text())["machines"]
    assert {m["cpu"] for m in machines} >= {"AMD EPYC", "Intel Xeon"}
    readme = (REPO / "README.md").read_text()
    stated = re.search(r"expect a start between (\d+(?:\.\d+)?) and (\d+(?:\.\d+)?)", readme)
    assert stated, "the README states no range for the start a user should expect"
    low, high = float(stated[1]), float(stated[2])
    for m in machines:
        assert low <= m["start"] <= high, (m, low, high)
        assert f"{m['start']:.2f} on {m['cpu']} ({m['cpu_capability']}" in readme, m


def test_the_console_pictures_come_from_kits_provisioned_as_the_operators_guide_writes_them(tmp_path):
    """tools/console_pictures.py draws both console pictures the docs show (docs/img/console-site.png and
    console-server.png) from a kit's pilot: the kits are provisioned with the guide's own command (its config and
    every --set of its record-level recipe), only the pilot's host and names changed, at the paths provision lays
    out by default (no --install-dir, --state-dir or --venv), and each kit README's command lines are what it runs,
    its console line included (the site's and the server's, as each kit writes it)."""
    sys.path.insert(0, str(REPO / "tools"))
    try:
        from console_pictures import PICTURES, console_line, provision_command, readme_commands, trial_command
    finally:
        sys.path.remove(str(REPO / "tools"))
    shown = {m for doc in USER_DOCS for m in re.findall(r"\(\.\./img/(console-[\w-]+\.png)\)", doc.read_text())}
    assert shown == {"console-site.png", "console-server.png"}, shown
    assert set(PICTURES.values()) == shown  # every console picture the docs show is the pilot's, none a test's
    guide = (DOCS / "how-to" / "server.md").read_text()
    command = provision_command(guide)
    written = re.search(r"```sh\n(fedpose provision .*?)```", guide, re.S).group(1)
    assert set(re.findall(r"--set (\S+)", command)) == set(re.findall(r"--set (\S+)", written)) != set()
    assert "--config default" in command and "--host 127.0.0.1" in command and "--out /opt/fedpose" in command
    assert not re.search(r"--(install-dir|state-dir|venv|user) ", command), command
    steps = re.search(r"<!-- kit:SITE_STEPS -->\n```text\n(.*?)```", (DOCS / "how-to" / "site-install.md").read_text(),
                      re.S).group(1)
    (tmp_path / "README.txt").write_text(steps)
    lines = readme_commands(tmp_path / "README.txt")
    assert "/opt/fedpose/venv/bin/fedpose site set-data --policy policy.yaml /path/to/your/split" in lines, lines
    assert trial_command(tmp_path / "README.txt") == "STATE_DIRECTORY=/var/lib/fedpose/hospital-a ./start-supernode.sh"
    assert console_line(tmp_path / "README.txt") == "/opt/fedpose/venv/bin/fedpose console --policy policy.yaml"
    server_steps = re.search(r"<!-- kit:SERVER_STEPS -->\n```text\n(.*?)```", guide, re.S).group(1)
    (tmp_path / "README.txt").write_text(server_steps)
    assert console_line(tmp_path / "README.txt") == "fedpose console --out /srv/fedpose/run1"
