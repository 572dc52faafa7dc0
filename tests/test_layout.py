"""The layout shows the design: no import circle anywhere in the project (counting imports inside
functions and imports by string), every module says what it owns, and tests import what they
test instead of loading scripts by path."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sparsekv", "train", "data", "eval")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    found = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            if "peers" in path.parts:  # the kvpress peer runs in its own environment
                continue
            found[_module_name(path)] = path
    return found


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                lines.update(range(inner.lineno, (inner.end_lineno or inner.lineno) + 1))
    return lines


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """Project modules `name` imports anywhere in its file (function bodies and
    `importlib.import_module("...")` included; `if TYPE_CHECKING:` blocks excluded)."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_lines(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()

    def add(target: str) -> None:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            out.add(target)

    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        elif (
            path.name == "__init__.py"
            and isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and node.value in modules
        ):  # a package's lazy attributes name their modules by string
            add(node.value)
        elif (
            isinstance(node, ast.Call)
            and ast.unparse(node.func).endswith("import_module")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            add(node.args[0].value)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_even_inside_functions_or_by_string():
    modules = _modules()
    graph = {name: _imports(path, name, modules) for name, path in modules.items()}
    assert _cycles(graph) == []


def test_cycle_finder_sees_an_import_inside_a_function(tmp_path):
    # the checker itself can fail: a function-level import that closes a loop is a cycle
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    mods = {"pkg": tmp_path / "pkg.py", "pkg.x": tmp_path / "x.py"}
    mods["pkg.x"].write_text("def f():\n    import importlib\n    importlib.import_module('pkg')\n")
    assert _imports(mods["pkg.x"], "pkg.x", mods) == {"pkg"}


def test_every_module_opens_with_a_docstring():
    missing = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "sparsekv").rglob("*.py")
        if ast.get_docstring(ast.parse(path.read_text())) is None
    ]
    assert missing == []


def test_tests_import_scripts_instead_of_loading_them_by_path():
    offenders = [
        path.name
        for path in (ROOT / "tests").glob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("spec_from_file_location")
    ]
    assert offenders == []


def test_ruff_finds_nothing_under_the_projects_own_rules():
    """`ruff check .` with the rules pyproject.toml names (pyflakes, pycodestyle's errors, import
    order) is clean: an unused import or an unsorted import block fails here, not in a user's
    editor."""
    pytest.importorskip("ruff", reason="ruff is not installed (pip install -e '.[dev]')")
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr
