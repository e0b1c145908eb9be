"""Scripts import the installed package (`pip install -e .`, as scripts/setup.sh does) like any
other program: none puts a folder on sys.path. What a script shares with the tests lives in the
package (jaxserve/testing, pallas_kernels/cases.py), not in tests/. A script run from another
checkout, e.g. a worktree of an old commit for a before/after benchmark, imports that checkout
with PYTHONPATH=<checkout> (or its own editable install)."""

from __future__ import annotations

import ast
import pathlib

import pytest

SCRIPTS = sorted((pathlib.Path(__file__).resolve().parents[2] / "scripts").glob("*.py"))


def path_changes(tree: ast.Module) -> list[str]:
    """Each use of sys.path (read or written), `from sys import path` and site.addsitedir, as
    'line: code'."""
    found = []
    for node in sorted(ast.walk(tree), key=lambda n: getattr(n, "lineno", 0)):
        hit = (isinstance(node, ast.Attribute) and node.attr == "path"
               and isinstance(node.value, ast.Name) and node.value.id == "sys")
        hit = hit or (isinstance(node, ast.ImportFrom) and node.module == "sys"
                      and any(a.name == "path" for a in node.names))
        hit = hit or (isinstance(node, ast.Attribute) and node.attr == "addsitedir")
        if hit:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_leaves_sys_path_alone(script):
    assert path_changes(ast.parse(script.read_text())) == [], (
        f"{script.name} changes the import path; import the installed package instead (shared "
        "helpers belong in jaxserve/testing or pallas_kernels, not tests/)")


def test_the_scan_finds_each_kind_of_path_change():
    planted = ("import sys\nimport site\nsys.path.insert(0, 'x')\nsys.path.append('y')\n"
               "sys.path = ['z']\nfrom sys import path\nsite.addsitedir('w')\n")
    found = [line.split(":")[0] for line in path_changes(ast.parse(planted))]
    assert found == ["3", "4", "5", "6", "7"]
    assert path_changes(ast.parse("import sys\nprint(sys.argv)\n")) == []
