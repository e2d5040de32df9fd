"""Write the Layout section of CONTRIBUTING.md from the tree.

    python tools/layout.py            # rewrite the block between <!-- layout --> and <!-- /layout -->
    python tools/layout.py --check    # exit 1 when that block is not what the tree gives (tests/test_layout.py)

The block lists the top-level folders and files, one line each (described below, in FOLDERS and FILES), and for
the packages shared/, client/, server/, edge/ and cli/ every sub-folder and every module with the first sentence
of its docstring (the sub-folder's ``__init__.py``), trimmed to one line. The source is read with ``ast``:
nothing is imported, so the tool runs without torch and in a second. A module that moves, merges or changes its
docstring changes the block; the block is never edited by hand.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGE = "CONTRIBUTING.md"
BEGIN, END = "<!-- layout -->", "<!-- /layout -->"
PACKAGES = ("shared", "client", "server", "edge", "cli")  # listed module by module
WIDTH = 120  # the longest line of the block
INDENT = "  "

# The top-level folders, in the order a reader meets them. A folder that is not here (and not ignored by
# .gitignore or hidden) stops the tool: describe it.
FOLDERS = {
    "fedpose": "The root package (__init__.py) and a link to each top-level package folder: `fedpose.<folder>` is it",
    "configs": "YAML configs shipped as package data, loadable by name (`--config default`)",
    "shared": "Everything both sides need; imports nothing from client/, server/, edge/ or cli/",
    "client": "A hospital site: its ClientApp, policy, checks, budget ledger, app gate and warm start",
    "server": "The federation's server: its ServerApp, plan, basis, aggregation, ledger, report, kits",
    "edge": "The camera: ONNX export, TensorRT build, runtimes, the camera pipeline",
    "cli": "The `fedpose` command: thin, parses arguments and calls the packages lazily",
    "docs": "The documentation site (mkdocs.yml): tutorials, how-to, explanation, reference, results",
    "benchmarks": "Scripts that print side-by-side ratios and write the results' JSON (not tests)",
    "tools": "The lock, generated reference pages, this layout, the rendered results, the console pictures",
    "tests": "The pytest suite: fixtures in conftest.py, harnesses in support/, real samples in ../shared/",
}
# The top-level files a contributor needs to know (the others: LICENSE, CHANGELOG.md, CITATION.cff, SECURITY.md).
FILES = {
    "pyproject.toml": "Dependencies, extras, the `fedpose` script, the Flower app; packages found under fedpose/",
    "constraints.txt": "The lock: every package version (tools/update-lock.sh writes it)",
    "mkdocs.yml": "The documentation site's navigation",
    "README.md": "What it is, for whom, the main command and the test command, install, links into docs/",
    "CONTRIBUTING.md": "This page: commits, layout, conventions",
}

_ABBREVIATIONS = ("e.g.", "i.e.", "etc.", "cf.", "vs.", "approx.")


class LayoutError(Exception):
    """The tree or the page is not what the tool can write from (a folder without a description, no markers)."""


def first_sentence(doc: str | None) -> str:
    """The first sentence of a docstring's first paragraph, on one line, without its full stop."""
    if not doc:
        return ""
    paragraph = " ".join(doc.strip().split("\n\n")[0].split())
    for match in re.finditer(r"(?<!\.)[.!?](?=\s|$)", paragraph):  # not an ellipsis (a -> ... -> b)
        head = paragraph[: match.end()]
        if not head.lower().endswith(_ABBREVIATIONS):
            paragraph = head
            break
    return paragraph.replace("``", "`").removesuffix(".")


def trim(text: str, room: int) -> str:
    """``text`` cut at a word to fit ``room`` characters, ending in '...' when cut; a cut that would leave a
    parenthesis or a backtick open is made before it instead (when that keeps half the room)."""
    if len(text) <= room:
        return text
    cut = text[: room - 3].rsplit(" ", 1)[0]
    while cut.count("(") > cut.count(")") or cut.count("`") % 2:
        opener = max(cut.rfind(" ("), cut.rfind(" `") if cut.count("`") % 2 else -1)
        if opener < room // 2:
            break
        cut = cut[:opener]
    return cut.rstrip(" ,;:") + "..."


def _docstring(path: Path) -> str:
    return first_sentence(ast.get_docstring(ast.parse(path.read_text(), filename=str(path))))


def _ignored(root: Path) -> list[str]:
    """The folder patterns of .gitignore (``/runs/``, ``*.egg-info/``): build outputs and local data."""
    gitignore = root / ".gitignore"
    lines = gitignore.read_text().splitlines() if gitignore.is_file() else []
    return [line.strip().strip("/") for line in lines if line.strip().endswith("/") and not line.startswith("#")]


def _top_folders(root: Path) -> list[str]:
    ignored = _ignored(root)
    found = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))
                   and not any(fnmatch.fnmatch(p.name, pattern) for pattern in ignored))
    unknown = [name for name in found if name not in FOLDERS]
    if unknown:
        raise LayoutError(f"describe the top-level folders {unknown} in FOLDERS of tools/layout.py")
    return [name for name in FOLDERS if name in found]


def _package_entries(folder: Path, depth: int) -> list[tuple[str, str]]:
    """(indented name, description) for the sub-folders of a package folder, then its modules, depth first."""
    entries: list[tuple[str, str]] = []
    subs = sorted(p for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").is_file())
    for sub in subs:
        entries.append((INDENT * depth + sub.name + "/", _docstring(sub / "__init__.py")))
        entries += _package_entries(sub, depth + 1)
    for module in sorted(p for p in folder.glob("*.py") if p.name != "__init__.py"):
        entries.append((INDENT * depth + module.name, _docstring(module)))
    return entries


def entries(root: Path = REPO) -> list[tuple[str, str]]:
    """Every line of the block as (indented name, description), top-level files first."""
    missing = [name for name in FILES if not (root / name).is_file()]
    if missing:
        raise LayoutError(f"FILES of tools/layout.py names files that are not there: {missing}")
    out = list(FILES.items())
    for name in _top_folders(root):
        out.append((name + "/", FOLDERS[name]))
        if name in PACKAGES:
            out += _package_entries(root / name, 1)
    return out


def render(root: Path = REPO) -> str:
    """The block between the markers: a code block, names in one column and their descriptions beside them."""
    rows = entries(root)
    column = max(len(name) for name, _ in rows) + 2
    lines = [(name.ljust(column) + trim(text, WIDTH - column)).rstrip() for name, text in rows]
    return "\n".join(["```", *lines, "```"])


def block(page: str) -> str:
    """What stands between the markers of ``page`` (without the newlines next to them)."""
    if page.count(BEGIN) != 1 or page.count(END) != 1 or page.index(BEGIN) > page.index(END):
        raise LayoutError(f"{PAGE} needs one {BEGIN} ... {END} pair around its layout")
    return page[page.index(BEGIN) + len(BEGIN): page.index(END)].strip("\n")


def paths(text: str) -> list[str]:
    """The paths the names of a block stand for (its indentation says which folder a name is in)."""
    out: list[str] = []
    stack: list[str] = []
    for line in text.splitlines():
        if not line.strip() or line.startswith("```"):
            continue
        name = line.split()[0]
        depth = (len(line) - len(line.lstrip(" "))) // len(INDENT)
        stack = stack[:depth]
        out.append("/".join([*stack, name.rstrip("/")]))
        if name.endswith("/"):
            stack.append(name.rstrip("/"))
    return out


def write(root: Path = REPO) -> bool:
    """Rewrite the block of the page under ``root``; whether it changed."""
    page_path = root / PAGE
    page = page_path.read_text()
    old = block(page)
    new = render(root)
    if old == new:
        return False
    start = page.index(BEGIN) + len(BEGIN)
    page_path.write_text(page[:start] + "\n" + new + "\n" + page[page.index(END):])
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="exit 1 when the layout block is not current")
    args = parser.parse_args(argv)
    try:
        if args.check:
            if block((REPO / PAGE).read_text()) != render(REPO):
                print(f"{PAGE}'s layout is not the tree's: run python tools/layout.py", file=sys.stderr)
                return 1
            return 0
        print(f"{PAGE}: layout {'written' if write(REPO) else 'already current'}")
    except LayoutError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
