"""Layout rules (CONTRIBUTING.md: layout), checked by reading the source with ast, so nothing is
imported and the test is fast. They check the direction of the imports, not the size of files:

- the project's import graph (module level and function-level lazy imports alike) has no circle;
- shared imports nothing from client, server or edge; those three never import each other (the CLI sits
  on top and may import all of them); every project import goes through the fedpose root;
- the library never imports the experiments (shared/experiments/);
- CONTRIBUTING.md's layout section is the one tools/layout.py writes from the tree.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("shared", "client", "server", "edge", "cli")
ROOT_PACKAGE = "fedpose"  # the one import root: fedpose.shared is shared/, and so on (pyproject.toml)

# Which top-level package may import which (besides itself).
ALLOWED = {
    "shared": set(),
    "client": {"shared"},
    "server": {"shared"},
    "edge": {"shared"},
    "cli": {"shared", "client", "server", "edge"},
}


def _files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in _files()}


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """Absolute name of the module a `from ... import` names."""
    if node.level == 0:
        return node.module or ""
    base = [ROOT_PACKAGE, *module.split(".")]
    if not is_package:
        base = base[:-1]
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules that `module` imports anywhere in its body."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    bare: list[str] = []

    def add(name: str) -> None:
        # The longest project module that `name` is or lies inside (imported through the fedpose root).
        if name.split(".")[0] in PACKAGES:
            bare.append(name)
        parts = name.removeprefix(ROOT_PACKAGE + ".").split(".")
        while parts:
            candidate = ".".join(parts)
            if candidate in modules:
                found.add(candidate)
                return
            parts.pop()

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, is_package, node)
            for alias in node.names:
                sub = f"{target}.{alias.name}".removeprefix(ROOT_PACKAGE + ".")
                if sub in modules:
                    found.add(sub)  # `from pkg import submodule`
                else:
                    add(target)
    found.discard(module)
    if bare:
        found.add("BARE:" + ",".join(sorted(set(bare))))
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(m, p, modules) for m, p in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):  # (a BARE: entry is no module: skipped below)
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    cycles = _cycles(_graph())
    assert not cycles, "import cycles:\n  " + "\n  ".join(
        " <-> ".join(c) for c in cycles
    )


def test_every_import_goes_through_the_fedpose_root():
    """`import shared...` would find a user's own shared/ (or another distribution's) before ours."""
    bare = [f"{m}: {t[5:]}" for m, targets in sorted(_graph().items()) for t in targets if t.startswith("BARE:")]
    assert not bare, "imports not under fedpose.:\n  " + "\n  ".join(bare)


def test_dependency_direction():
    bad = []
    for module, targets in sorted(_graph().items()):
        top = module.split(".")[0]
        for t in sorted(t for t in targets if not t.startswith("BARE:")):
            other = t.split(".")[0]
            if other != top and other not in ALLOWED[top]:
                bad.append(f"{module} imports {t}")
    assert not bad, "imports against the dependency direction:\n  " + "\n  ".join(bad)


def test_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_the_library_never_imports_the_experiments():
    """shared/experiments/ (study, audit, membership) is built on the library; nothing else in shared/ imports it."""
    bad = [f"{m} imports {t}" for m, targets in sorted(_graph().items()) for t in sorted(targets)
           if m.startswith("shared.") and not m.startswith("shared.experiments") and t.startswith("shared.experiments")]
    assert not bad, "\n".join(bad)


def test_every_package_folder_is_under_the_import_root_and_in_the_distribution():
    """fedpose/<folder> is a relative link to each top-level folder, so `fedpose.server.run` is the file
    fedpose/server/run.py for any tool that resolves imports by path; and setuptools finds every package folder
    through those links (one left out would be missing from the wheel a site or a camera installs)."""
    from setuptools import find_packages

    for top in (*PACKAGES, "configs"):
        link = ROOT / ROOT_PACKAGE / top
        assert link.is_symlink() and Path(os.readlink(link)) == Path("..") / top, f"{link} must link to ../{top}"
    folders = {ROOT_PACKAGE} | {
        ".".join((ROOT_PACKAGE, *init.parent.relative_to(ROOT).parts))
        for top in (*PACKAGES, "configs") for init in (ROOT / top).rglob("__init__.py")}
    assert set(find_packages(str(ROOT), include=[f"{ROOT_PACKAGE}*"])) == folders


def _layout_tool():
    """tools/layout.py, loaded from its file (tools/ is no package); it reads the tree with ast, imports nothing."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("layout_tool", ROOT / "tools" / "layout.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_contributing_layout_names_only_files_that_exist_and_is_what_the_tool_writes():
    """CONTRIBUTING.md's layout block is generated (python tools/layout.py): a file moved, merged or removed, or
    a module whose first docstring sentence changed, leaves it stale."""
    layout = _layout_tool()
    block = layout.block((ROOT / "CONTRIBUTING.md").read_text())
    missing = [path for path in layout.paths(block) if not (ROOT / path).exists()]
    assert not missing, f"CONTRIBUTING.md's layout names missing files (run python tools/layout.py): {missing}"
    assert block == layout.render(ROOT), "CONTRIBUTING.md's layout is not the tree's: run python tools/layout.py"


def test_the_layout_tool_lists_every_module_of_the_packages_once():
    layout = _layout_tool()
    listed = [path for path in layout.paths(layout.render(ROOT)) if path.endswith(".py")]
    modules = sorted(p.relative_to(ROOT).as_posix() for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
                     if p.name != "__init__.py" and "__pycache__" not in p.parts)
    assert sorted(listed) == modules


def test_the_layout_tool_takes_a_docstrings_first_sentence_and_trims_it_to_one_line():
    layout = _layout_tool()
    assert layout.first_sentence("A thing, e.g. this one. And more.\n\nDetails.") == "A thing, e.g. this one"
    assert layout.first_sentence("Shape -> ... -> Pad chains\nfold. Then.") == "Shape -> ... -> Pad chains fold"
    assert layout.first_sentence("``fedpose x``: does y") == "`fedpose x`: does y" and layout.first_sentence(None) == ""
    assert layout.trim("short", 10) == "short"
    cut = layout.trim("one two three four five six seven eight nine ten", 20)
    assert cut == "one two three..." and len(cut) <= 20
    assert layout.trim("a long sentence here (with an aside that is cut)", 40) == "a long sentence here..."
