"""One command reproduces every results table and figure of the README (issue #14): benchmarks/reproduce.py."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _reproduce():
    spec = importlib.util.spec_from_file_location("reproduce", REPO / "benchmarks" / "reproduce.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["reproduce"] = module
    spec.loader.exec_module(module)
    return module


def _blocks(text: str) -> dict[str, tuple[int, int]]:
    """results-NAME -> (first line, last line) of its block."""
    lines = text.splitlines()
    opened, blocks = {}, {}
    for i, line in enumerate(lines):
        if m := re.fullmatch(r"<!-- results-([a-z-]+) -->", line.strip()):
            opened[m.group(1)] = i
        elif m := re.fullmatch(r"<!-- /results-([a-z-]+) -->", line.strip()):
            assert m.group(1) in opened, f"README line {i + 1}: {line} closes a block never opened"
            blocks[m.group(1)] = (opened.pop(m.group(1)), i)
    assert not opened, f"README blocks never closed: {sorted(opened)}"
    return blocks


def test_every_results_table_and_figure_of_the_readme_is_in_a_block_the_command_reproduces():
    text = (REPO / "README.md").read_text()
    blocks = _blocks(text)
    entries = {e.name for e in _reproduce().ENTRIES}
    assert set(blocks) == entries, f"README blocks {sorted(blocks)} vs reproduce.py entries {sorted(entries)}"
    lines = text.splitlines()
    measured = [i for i, line in enumerate(lines) if line.startswith(("## Results", "## What the guarantee means"))]
    assert len(measured) == 2
    outside = []
    for start in measured:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        for i in range(start, end):
            is_result = lines[i].startswith("|---") or re.search(r"!\[|benchmarks/results/\S+\.png", lines[i])
            if is_result and not any(a < i < b for a, b in blocks.values()):
                outside.append(f"{i + 1}: {lines[i][:80]}")
    assert not outside, "results tables or figures outside any <!-- results-NAME --> block:\n" + "\n".join(outside)


def test_every_command_parses_with_the_tools_it_names(tmp_path):
    """Each fedpose command parses with fedpose's own parser; each script knows every flag given to it."""
    from cli.main import build_parser

    reproduce = _reproduce()
    helps: dict[str, str] = {}
    for entry in reproduce.ENTRIES:
        for part in entry.commands:
            argv = reproduce.command(part, tmp_path / entry.name)
            assert argv[0] == sys.executable
            if argv[1:3] == ["-m", "cli.main"]:
                try:
                    build_parser().parse_args(argv[3:])
                except SystemExit as err:
                    pytest.fail(f"{entry.name}: fedpose does not parse {argv[3:]} ({err})")
            else:
                script = argv[1]
                assert (REPO / script).is_file(), script
                if script not in helps:
                    done = subprocess.run([sys.executable, script, "--help"], cwd=REPO, capture_output=True, text=True,
                                          timeout=120)
                    assert done.returncode == 0, done.stderr[-2000:]
                    helps[script] = done.stdout
                for flag in (a for a in argv[2:] if a.startswith("--")):
                    assert flag in helps[script], f"{entry.name}: {script} has no {flag}"
            for arg in argv:
                if arg.startswith("configs/"):
                    assert (REPO / arg).is_file(), arg


def test_an_entry_runs_its_commands_logs_them_and_is_not_rerun(tmp_path, capsys):
    reproduce = _reproduce()
    demo = reproduce.Entry("demo", "a real command", (
        ("{py}", "-m", "cli.main", "edge", "demo-video", "--out", "{out}/demo.mp4", "--frames", "4"),))
    assert reproduce.run_entry(demo, tmp_path / "demo")
    done = json.loads((tmp_path / "demo" / "done.json").read_text())
    assert done["steps"][0]["exit_code"] == 0 and (tmp_path / "demo" / "demo.mp4").stat().st_size > 0
    assert (tmp_path / "demo" / "1.log").exists()
    broken = reproduce.Entry("broken", "a command that fails", (
        ("{py}", "-m", "cli.main", "edge", "demo-video", "--out", "{out}/x.mp4", "--size", "not-a-size"),
        ("{py}", "-m", "cli.main", "edge", "demo-video", "--out", "{out}/never.mp4", "--frames", "4"),))
    assert not reproduce.run_entry(broken, tmp_path / "broken")
    assert not (tmp_path / "broken" / "done.json").exists() and not (tmp_path / "broken" / "never.mp4").exists()
    assert "failed (exit" in capsys.readouterr().out
    # The command itself: an entry that is done is skipped; --list says which are.
    (tmp_path / "out" / "benchmarks").mkdir(parents=True)
    (tmp_path / "out" / "benchmarks" / "done.json").write_text("{}")
    assert reproduce.main(["--out", str(tmp_path / "out"), "--only", "benchmarks"]) == 0
    assert "benchmarks: done (rerun with --force)" in capsys.readouterr().out
    assert reproduce.main(["--out", str(tmp_path / "out"), "--list"]) == 0
    listed = capsys.readouterr().out
    assert re.search(r"benchmarks\s+done", listed) and re.search(r"study\s+to run", listed)
