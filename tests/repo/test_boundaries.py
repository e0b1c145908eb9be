"""The boundaries between the engine and its parts, checked on the source rather than stated:

- nothing outside the engine's module reads the engine's private attributes;
- a runner is built in one place outside tests (the factory);
- the engine asks request states questions instead of testing their types.
"""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
PRODUCT = ("jaxserve", "models", "pallas_kernels", "scripts")


def _sources():
    for top in PRODUCT:
        for path in sorted((ROOT / top).rglob("*.py")):
            yield path, path.read_text()


def test_sources_are_found():
    paths = {p.relative_to(ROOT).as_posix() for p, _ in _sources()}
    assert {"jaxserve/engine.py", "jaxserve/spec_engine.py",
            "jaxserve/runtime/runner.py"} <= paths


def test_nothing_outside_the_engine_reads_its_private_attributes():
    private = re.compile(r"\bengine\._[a-z]")
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
             for p, src in _sources() if p != ROOT / "jaxserve" / "engine.py"
             for i, line in enumerate(src.splitlines(), 1) if private.search(line)]
    assert not found, "\n".join(found)


def _calls(src: str, name: str) -> int:
    return sum(1 for node in ast.walk(ast.parse(src)) if isinstance(node, ast.Call)
               and (getattr(node.func, "id", None) == name
                    or getattr(node.func, "attr", None) == name))


def test_one_construction_site_of_the_runner():
    sites = {p.relative_to(ROOT).as_posix(): n for p, src in _sources()
             if (n := _calls(src, "ModelRunner"))}
    assert list(sites.values()) == [1], sites


def test_the_engine_does_not_test_request_state_types():
    tree = ast.parse((ROOT / "jaxserve" / "engine.py").read_text())
    bad = []
    def is_type_call(node) -> bool:
        return isinstance(node, ast.Call) and getattr(node.func, "id", None) == "type"

    for node in ast.walk(tree):
        # type(x) in a comparison is a type test; type(e).__name__ in a message is not.
        if isinstance(node, ast.Compare) and any(map(is_type_call,
                                                     [node.left, *node.comparators])):
            bad.append(f"line {node.lineno}: {ast.unparse(node)}")
        if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance"
                and getattr(node.args[0], "id", None) not in ("prompt", "params", "t")):
            bad.append(f"line {node.lineno}: isinstance({ast.unparse(node.args[0])}, ...)")
    assert not bad, bad
