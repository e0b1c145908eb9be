"""Every script that imports this project puts its own checkout first on sys.path before it
does: run from a worktree of an old commit (the before/after benchmarks), it must measure that
commit, not whichever checkout the environment's editable install points at."""

from __future__ import annotations

import ast
import pathlib

import pytest

SCRIPTS = sorted((pathlib.Path(__file__).resolve().parent.parent / "scripts").glob("*.py"))
PROJECT = ("jaxserve", "models", "pallas_kernels")


def first_project_import(tree: ast.Module) -> int | None:
    for node in tree.body:  # module level: imports inside functions run after the insert
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        if any(n.split(".")[0] in PROJECT for n in names):
            return node.lineno
    return None


def first_path_insert(tree: ast.Module) -> int | None:
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "insert" and ast.unparse(node.func.value) == "sys.path"):
            return node.lineno
    return None


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_puts_its_checkout_first(script):
    tree = ast.parse(script.read_text())
    first = first_project_import(tree)
    if first is None:
        return  # imports nothing of this project at module level
    insert = first_path_insert(tree)
    assert insert is not None and insert < first, (
        f"{script.name} imports the project at line {first} before putting its checkout on "
        "sys.path (REPO = parent of scripts/; sys.path.insert(0, str(REPO)))")
