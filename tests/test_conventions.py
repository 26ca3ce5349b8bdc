"""The suite's own conventions, checked statically: no module under tests/, benchmarks/ or
examples/ imports a test module (what modules share lives in tests/support/), and no source
file there is longer than MAX_LINES lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
CHECKED = [TESTS, ROOT / "benchmarks", ROOT / "examples"]
#: the longest a test, benchmark or example source file may be (split it by topic past this)
MAX_LINES = 600
SOURCE_SUFFIXES = {".py", ".sh", ".c", ".cc", ".cpp", ".h", ".cu", ".cuh"}


def _files(suffixes: set[str]) -> list[Path]:
    """The files under CHECKED with one of ``suffixes``, outside hidden and cache folders."""
    found = []
    for top in CHECKED:
        for path in sorted(top.rglob("*")):
            parts = path.relative_to(ROOT).parts
            if any(p.startswith(".") or p == "__pycache__" for p in parts):
                continue
            if path.is_file() and path.suffix in suffixes:
                found.append(path)
    return found


#: what no module may import: the test modules (by the plain name conftest.py makes them
#: importable under) and conftest itself
FORBIDDEN = {p.stem for p in TESTS.rglob("test_*.py")} | {"conftest"}


def _imported(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) for every import in ``tree``, at any depth (in functions too), and every
    importlib.import_module / __import__ call with a literal name; a relative import as its
    dotted form."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, "." * node.level + (node.module or "")))
            if node.level:  # from . import test_x
                found += [(node.lineno, "." + alias.name) for alias in node.names]
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            arg = node.args[0]
            if name in ("import_module", "__import__") and isinstance(arg, ast.Constant):
                found.append((node.lineno, str(arg.value)))
    return found


def test_no_module_imports_a_test_module() -> None:
    """Test modules share helpers through tests/support/, never by importing each other."""
    bad = []
    for path in _files({".py"}):
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, module in _imported(tree):
            top = module.lstrip(".").split(".")[0]
            if top in FORBIDDEN and path.stem != top:
                bad.append(f"{path.relative_to(ROOT)}:{line}: imports {module}")
    assert not bad, "move what they share to tests/support/:\n" + "\n".join(bad)


def test_source_files_are_at_most_max_lines_long() -> None:
    long = []
    for path in _files(SOURCE_SUFFIXES):
        with path.open("rb") as f:
            lines = sum(1 for _ in f)
        if lines > MAX_LINES:
            long.append(f"{path.relative_to(ROOT)}: {lines} lines")
    assert not long, f"over {MAX_LINES} lines (split by topic):\n" + "\n".join(long)


@pytest.mark.parametrize(
    "source,caught",
    [
        ("from test_sparse import Case", True),
        ("import test_sparse as s", True),
        ("def f():\n    from test_nan_check import x", True),
        ("from . import test_sparse", True),
        ("import importlib\nimportlib.import_module('test_sparse')", True),
        ("import conftest", True),
        ("from sparse_models import SparseCase", False),
        ("import torch.testing", False),
    ],
    ids=[
        "from",
        "import-as",
        "in-a-function",
        "relative",
        "import_module",
        "conftest",
        "support",
        "other",
    ],
)
def test_the_import_check_sees_every_form(source: str, caught: bool) -> None:
    """(The check above against the forms an import of a test module can take.)"""
    tops = {m.lstrip(".").split(".")[0] for _, m in _imported(ast.parse(source))}
    assert bool(tops & FORBIDDEN) == caught, tops
