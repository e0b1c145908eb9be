"""XLA:GPU's thunk sequence, read from a compile's dump (`--xla_dump_to`), as a tree.

The thunk sequence is what the GPU runtime executes: kernel launches, copies, CUDA graphs
(`kCommandBuffer`), loops (`kWhile`, condition and body) and conditionals (`kConditional`,
one sub-sequence per branch). XLA writes it as indented text
(`*.thunk_sequence_after_thunk_passes.txt`) and each thunk's HLO instruction in
`*.thunk_metadata.txt`; this module parses both into `Thunk` nodes. Nothing here imports jax.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re

_LINE = re.compile(r"^(\s*)(\d{3}): (k\w+)\s*\[[^\]]*\]\s*(.*)$")
_LABEL = re.compile(r"(condition|body|\w*branch\w*):\s*$")
_META = re.compile(r'profile_annotation: "([^"]*)"\s*(?:thunk_id: (\d+))?')

# Thunks that launch nothing themselves: they hold, order or wait for other thunks.
CONTROL = frozenset({"kWhile", "kConditional", "kCommandBuffer", "kSequential", "kAsyncStart",
                     "kAsyncDone", "kWaitForStreams", "kDynamicSliceFusion"})
# Device-side data movement (XLA emits these as memcpy/memset nodes, not kernels).
COPIES = frozenset({"kCopy", "kMemset32BitValue", "kMemzero", "kDynamicMemcpy",
                    "kDeviceToDevice", "kHostToDevice", "kDeviceToHost"})


@dataclasses.dataclass
class Thunk:
    kind: str
    id: int                  # 0 for thunks XLA does not number (command buffers)
    text: str                # the rest of the line: kernel name, grid, threads, shared memory
    indent: int
    # Sub-sequences by label: "body"/"condition" (kWhile), "false_branch"/"true_branch"/
    # "branch_N" (kConditional), "" (command buffer and async contents).
    children: dict[str, list[Thunk]] = dataclasses.field(default_factory=dict)
    hlo: str | None = None   # the HLO instruction it runs (from the thunk metadata)

    @property
    def kernel_name(self) -> str:
        return self.text.split(" ", 1)[0] if self.text else ""

    def all_children(self) -> list[Thunk]:
        return [t for seq in self.children.values() for t in seq]


def parse_sequence(text: str) -> list[Thunk]:
    """The top-level thunks of a thunk-sequence dump, each with its nested sub-sequences."""
    root = Thunk("root", 0, "", -1)
    stack: list[tuple[Thunk, str]] = [(root, "")]  # (node, the label its next children get)
    for line in text.splitlines():
        m = _LINE.match(line)
        if m is None:
            _apply_label(line, stack)
            continue
        indent = len(m.group(1))
        while stack[-1][0].indent >= indent:
            stack.pop()
        parent, label = stack[-1]
        node = Thunk(m.group(3), int(m.group(2)), m.group(4).strip(), indent)
        parent.children.setdefault(label, []).append(node)
        stack.append((node, ""))
    return root.children.get("", [])


def _apply_label(line: str, stack: list) -> None:
    m = _LABEL.search(line)
    if m is None:
        return
    label = m.group(1)
    if label != "condition":  # XLA prints "condition:" at column 0, right after its kWhile
        start = len(line) - len(line.lstrip())
        indent = start - 2 if line.lstrip().startswith("No thunks.") else m.start()
        while len(stack) > 1 and stack[-1][0].indent >= indent:
            stack.pop()
    stack[-1] = (stack[-1][0], label)


def parse_metadata(text: str) -> dict[int, str]:
    """thunk id -> the HLO instruction name it runs (thunks without an id are left out)."""
    out = {}
    for block in text.split("thunk_metadata {")[1:]:
        m = _META.search(block)
        if m and m.group(2):
            out[int(m.group(2))] = m.group(1)
    return out


def walk(thunks: list[Thunk]):
    """Every thunk, depth first, with whether it sits inside a command buffer (a CUDA graph)."""
    def rec(seq, in_graph):
        for t in seq:
            yield t, in_graph
            yield from rec(t.all_children(), in_graph or t.kind == "kCommandBuffer")
    yield from rec(thunks, False)


def load_dump(directory: str | pathlib.Path, module: str) -> tuple[list[Thunk], str]:
    """(thunk tree with HLO names attached, optimized HLO text) of `module` in a dump dir."""
    d = pathlib.Path(directory)

    def one(suffix: str) -> pathlib.Path:
        found = sorted(d.glob(f"*{module}*{suffix}"))
        if not found:
            raise FileNotFoundError(f"no *{module}*{suffix} in {d}: was the compile run with "
                                    f"xla_dump_to={d}?")
        return found[-1]

    thunks = parse_sequence(one(".thunk_sequence_after_thunk_passes.txt").read_text())
    names = parse_metadata(one(".thunk_metadata.txt").read_text())
    for t, _ in walk(thunks):
        t.hlo = names.get(t.id)
    return thunks, one("gpu_after_optimizations.txt").read_text()
