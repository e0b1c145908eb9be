"""Instruction counts in a PTX kernel's main loop (what `deviceless.compile_for_h200(...,
keep_ptx=True)` keeps), for per-byte figures such as the int4 kernel's unpacking cost.

The main loop is the longest span from a label to a branch back to it; a kernel without one
(a single K step) counts its whole body. Counts are static PTX instructions per thread, one
loop iteration; predicated instructions count once.
"""

from __future__ import annotations

import collections
import re

_LABEL = re.compile(r"^(\$L__\w+):$")
_BRANCH = re.compile(r"\bbra(?:\.uni)?\s+(\$L__\w+);")


def kernel_body(ptx: str, name: str) -> list[str]:
    """The lines of entry `name`'s body."""
    start = ptx.index(f".entry {name}(")
    end = ptx.find("\n}\n", start)
    return ptx[start:end if end >= 0 else len(ptx)].splitlines()


def main_loop(lines: list[str]) -> tuple[list[str], bool]:
    """(the longest label..back-branch span, True), or (all lines, False) without a loop."""
    labels = {m.group(1): i for i, l in enumerate(lines) if (m := _LABEL.match(l.strip()))}
    best = None
    for i, l in enumerate(lines):
        m = _BRANCH.search(l)
        if m and labels.get(m.group(1), i) < i:
            span = (labels[m.group(1)], i)
            if best is None or span[1] - span[0] > best[1] - best[0]:
                best = span
    return (lines, False) if best is None else (lines[best[0] + 1:best[1] + 1], True)


def opcodes(lines: list[str]) -> collections.Counter:
    """Instruction opcodes (e.g. 'and.b32') with their counts; directives and labels skipped."""
    ops = collections.Counter()
    for line in lines:
        s = line.strip()
        if not s or s.startswith(("//", ".", "$", "{", "}", ")", "(")) or not s.endswith(";"):
            continue
        if s.startswith("@"):
            s = s.split(None, 1)[1]
        ops[s.split()[0].rstrip(";")] += 1
    return ops


def threads_per_block(lines: list[str]) -> int:
    """From the entry's .maxntid / .reqntid directive (x * y * z)."""
    for line in lines:
        m = re.search(r"\.(?:maxntid|reqntid)\s+(\d+),\s*(\d+),\s*(\d+)", line)
        if m:
            return int(m.group(1)) * int(m.group(2)) * int(m.group(3))
    raise ValueError("no .maxntid/.reqntid in the kernel")


def entry_ptx(dump_dir, name: str) -> str:
    """The PTX module kept by `compile_for_h200(..., keep_ptx=True)` in `dump_dir` that defines
    entry `name`."""
    import pathlib
    for f in sorted(pathlib.Path(dump_dir, "ptx").glob("*.ptx")):
        text = f.read_text()
        if f".entry {name}(" in text:
            return text
    raise FileNotFoundError(f"no kept PTX file in {dump_dir}/ptx defines .entry {name}")
