"""Every privacy invariant of the design page is enforced in one named function and checked by a marked test.

docs/explanation/design.md lists the invariants (``- P1 ...``) and a table naming, for each, the function that
enforces it and the tests that would fail if it broke. A test says which invariant it checks with
``@pytest.mark.invariant("P7")`` (several names, or a module's ``pytestmark``, also count). This module reads the
sources with ast (nothing imported, fast) and fails when:

- an invariant on the page has no marked test, or a marker names an invariant the page does not list;
- the table misses an invariant, names a function that does not exist, or names a test that does not exist or
  is not marked with that row's invariant, or leaves out a test marked with it.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DESIGN = REPO / "docs" / "explanation" / "design.md"
TESTS = REPO / "tests"


def _invariants() -> list[str]:
    """The invariants the design page states, in its order: the list items ``- P<n> ...``."""
    names = re.findall(r"^- (P\d+) ", DESIGN.read_text(), re.M)
    assert names, f"{DESIGN.relative_to(REPO)} lists no invariant (lines '- P1 ...')"
    return names


def _marker_names(node: ast.expr) -> list[str] | None:
    """The invariant names of ``pytest.mark.invariant("P1", ...)``; None when ``node`` is another expression."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "invariant"):
        return None
    names = []
    for arg in node.args:
        if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
            raise AssertionError(f"pytest.mark.invariant takes invariant names as string literals, got "
                                 f"{ast.unparse(arg)}")
        names.append(arg.value)
    if not names:
        raise AssertionError("pytest.mark.invariant() names no invariant")
    return names


def _module_marks(tree: ast.Module) -> list[str]:
    """Invariants named by a module's ``pytestmark`` (one mark or a list of them)."""
    found: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark"
                                                for t in node.targets):
            values = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
            for value in values:
                found += _marker_names(value) or []
    return found


def marked_tests() -> dict[str, set[str]]:
    """invariant -> {"tests/test_x.py::test_name" or "tests/test_x.py::Class::test_name"} marked with it."""
    marked: dict[str, set[str]] = defaultdict(set)
    for path in sorted(TESTS.glob("test_*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        module = _module_marks(tree)
        rel = path.relative_to(REPO).as_posix()

        def visit(body: list[ast.stmt], prefix: str, inherited: list[str]) -> None:
            for node in body:
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    continue
                own = [n for d in node.decorator_list for n in (_marker_names(d) or [])]
                if isinstance(node, ast.ClassDef):
                    visit(node.body, f"{prefix}{node.name}::", inherited + own)
                elif node.name.startswith("test"):
                    for name in inherited + own:
                        marked[name].add(f"{rel}::{prefix}{node.name}")
                elif own:
                    raise AssertionError(f"{rel}: {node.name} is marked invariant but is not a test")

        visit(tree.body, "", module)
    return dict(marked)


def _table_rows() -> dict[str, tuple[list[str], list[str]]]:
    """invariant -> ([function], tests) of the page's table ``| invariant | enforced by | tested by |``.

    The enforcing function is the first code span of the middle cell (what follows it says how); the tests are
    every code span of the last cell."""
    text = DESIGN.read_text()
    start = re.search(r"^\| invariant \| enforced by \| tested by \|$", text, re.M)
    assert start, ("the design page has no table '| invariant | enforced by | tested by |' naming each "
                   "invariant's enforcing function and tests")
    rows: dict[str, tuple[list[str], list[str]]] = {}
    for line in text[start.end():].lstrip("\n").splitlines()[1:]:  # past the |---| line
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == 3, f"a row of the invariant table has {len(cells)} cells: {line}"
        name = re.match(r"P\d+", cells[0])
        assert name, f"a row of the invariant table names no invariant: {line}"
        assert name.group() not in rows, f"the invariant table has two rows for {name.group()}"
        rows[name.group()] = (re.findall(r"`([^`]+)`", cells[1])[:1], re.findall(r"`([^`]+)`", cells[2]))
    return rows


def _defines(dotted: str) -> bool:
    """True when ``package.module.function`` (or ``...module.Class.method``) is defined in the repository."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        base = REPO.joinpath(*parts[:cut])
        path = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if not path.is_file():
            continue
        body = ast.parse(path.read_text(), filename=str(path)).body
        for name in parts[cut:]:
            node = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                         and n.name == name), None)
            if node is None:
                return False
            body = node.body
        return True
    return False


def test_every_invariant_of_the_design_page_has_a_marked_test():
    invariants = _invariants()
    assert invariants == [f"P{i}" for i in range(1, len(invariants) + 1)], invariants
    marked = marked_tests()
    missing = [name for name in invariants if not marked.get(name)]
    assert not missing, (f"invariants of {DESIGN.relative_to(REPO)} that no test is marked with "
                         f"(@pytest.mark.invariant(...)): {', '.join(missing)}")


def test_every_invariant_marker_names_an_invariant_of_the_design_page():
    unknown = {name: sorted(tests) for name, tests in marked_tests().items() if name not in _invariants()}
    assert not unknown, f"tests marked with invariants the design page does not list: {unknown}"


def test_the_invariant_table_names_each_ones_function_and_its_marked_tests():
    rows, marked = _table_rows(), marked_tests()
    assert list(rows) == _invariants(), f"the table's rows {list(rows)} are not the invariants {_invariants()}"
    problems = []
    for name, (functions, tests) in rows.items():
        if not functions:
            problems.append(f"{name}: names no enforcing function")
        problems += [f"{name}: {f} is not defined" for f in functions if not _defines(f)]
        if not tests:
            problems.append(f"{name}: names no test")
        problems += [f"{name}: {t} is not a test marked invariant({name!r})" for t in tests
                     if t not in marked.get(name, set())]
        problems += [f"{name}: the table leaves out {t}, marked with it" for t in sorted(marked.get(name, set()))
                     if t not in tests]
    assert not problems, "\n".join(problems)
