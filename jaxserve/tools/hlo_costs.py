"""Bytes and FLOPs of one kernel of XLA's optimized HLO, read from the dump's text.

A kernel of the compiled GPU step runs one HLO instruction: a fusion (its fused computation),
a custom call (cuBLAS, or a Pallas/Triton kernel), or a plain op. What it moves through HBM is
what it reads of its operands plus what it writes of its result, where XLA's own in-place and
partial accesses are taken into account as XLA's HloCostAnalysis does:
- an operand consumed only by slices, dynamic slices or gathers is read as far as they read it
  (an embedding row gather does not read the table);
- a scatter or dynamic-update-slice into an operand updates it in place: neither the operand
  nor the untouched part of the result moves, only the updates (the KV-cache write);
everything else is read or written whole. FLOPs: 2 * M * N * K per dot, one per output element
of elementwise ops and per input element of reductions (cheap, never binding at decode).
Pallas kernels' own costs are left to the caller (jaxserve/tools/perf_model.py), which reads
their operand types from `operand_types`. Nothing here imports jax.
"""

from __future__ import annotations

import dataclasses
import math
import re

from jaxserve.tools.hlo_text import ArrayType

_ARRAY = re.compile(r"\b(pred|token|[a-z]+\d+(?:e\d+m\d+\w*)?)\[([\d,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY )?%(\S+) \((.*)\) -> .* \{$")
_INSTR = re.compile(r"^\s*(ROOT )?%(\S+) = ")
_OPERAND = re.compile(r"%([\w.\-]+)(?:#(\d+))?")
_CALLS = re.compile(r"\bcalls=%([\w.\-]+)")
_DIMS = re.compile(r"(\w+)=\{([\d,]*)\}")
_CUBLAS_DIMS = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')

# Bits per element of HLO element types (sub-byte types packed).
_BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "f16": 16,
         "bf16": 16, "s32": 32, "u32": 32, "f32": 32, "s64": 64, "u64": 64, "f64": 64,
         "c64": 64, "c128": 128, "token": 0}
# Ops that only re-view their operand: an access through them is an access to the operand.
_VIEWS = frozenset({"bitcast", "reshape", "get-tuple-element"})
# Ops that read part of their operand 0: as many bytes as their result holds.
_PARTIAL_READS = frozenset({"slice", "dynamic-slice", "gather"})
# Ops that update operand 0 in place: the update operand's index.
_IN_PLACE = {"scatter": 2, "dynamic-update-slice": 1}
_FREE = frozenset({"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "reshape",
                   "broadcast", "iota", "slice", "dynamic-slice", "concatenate", "transpose",
                   "copy", "pad", "after-all"})


def type_bytes(t: ArrayType) -> int:
    dtype, dims = t
    bits = _BITS.get(dtype, 8)  # f8 types and anything unknown: a byte
    return (math.prod(dims) * bits + 7) // 8


def _types(text: str) -> list[ArrayType]:
    return [(m.group(1), tuple(int(d) for d in m.group(2).split(",") if d))
            for m in _ARRAY.finditer(text)]


def _split_call(rest: str) -> tuple[str, str, str]:
    """'TYPE opcode(operands), attrs' -> (TYPE, opcode, operands text)."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += (ch == "(") - (ch == ")")
            if depth == 0:
                break
        type_text, tail = rest[:i + 1], rest[i + 1:].lstrip()
    else:
        type_text, _, tail = rest.partition(" ")
    opcode, _, args = tail.partition("(")
    depth, end = 1, len(args)
    for i, ch in enumerate(args):
        depth += (ch == "(") - (ch == ")")
        if depth == 0:
            end = i
            break
    return type_text, opcode, args[:end]


@dataclasses.dataclass(frozen=True)
class Instr:
    name: str
    result: tuple[ArrayType, ...]   # tuple results flattened
    opcode: str
    operands: tuple[tuple[str, int | None], ...]  # (name, tuple index of `%name#i`, or None)
    line: str
    root: bool

    @property
    def called(self) -> str | None:
        m = _CALLS.search(self.line)
        return m.group(1) if m else None

    def attr_dims(self, key: str) -> tuple[int, ...]:
        for k, v in _DIMS.findall(self.line):
            if k == key:
                return tuple(int(d) for d in v.split(",") if d)
        return ()


@dataclasses.dataclass(frozen=True)
class HloModule:
    instrs: dict[str, Instr]
    computations: dict[str, list[str]]  # computation -> its instruction names, in order

    @classmethod
    def parse(cls, text: str) -> HloModule:
        instrs, comps, comp = {}, {}, None
        for line in text.splitlines():
            h = _HEADER.match(line)
            if h:
                comp = h.group(1)
                comps[comp] = []
                continue
            m = _INSTR.match(line)
            if m is None or comp is None:
                continue
            type_text, opcode, args = _split_call(line[m.end():])
            ops = tuple((o.group(1), int(o.group(2)) if o.group(2) else None)
                        for o in _OPERAND.finditer(args))
            name = m.group(2)
            instrs[name] = Instr(name, tuple(_types(type_text)), opcode.strip(), ops, line,
                                 bool(m.group(1)))
            comps[comp].append(name)
        return cls(instrs, comps)

    def operand_types(self, name: str) -> list[ArrayType]:
        """The array type of each operand of `name` (a tuple operand flattened)."""
        out = []
        for op, index in self.instrs[name].operands:
            src = self.instrs.get(op)
            if src is None:
                continue
            out += [src.result[index]] if index is not None else list(src.result)
        return out


def _users(module: HloModule, comp: str) -> dict[str, list[tuple[Instr, int]]]:
    users: dict[str, list[tuple[Instr, int]]] = {}
    for n in module.computations.get(comp, []):
        ins = module.instrs[n]
        for i, (op, _) in enumerate(ins.operands):
            users.setdefault(op, []).append((ins, i))
    return users


def _read_bytes(name: str, full: int, users: dict) -> int:
    """Bytes a fused computation reads of value `name` (`full` bytes): partial reads and
    in-place updates count what they touch; any other use reads it whole."""
    total = 0
    for ins, i in users.get(name, []):
        if ins.opcode in _VIEWS:
            total += _read_bytes(ins.name, full, users)
        elif ins.opcode in _PARTIAL_READS and i == 0:
            total += sum(type_bytes(t) for t in ins.result)
        elif ins.opcode in _IN_PLACE and i == 0:
            continue
        else:
            return full
    return min(total, full)


def _written_bytes(module: HloModule, name: str) -> int:
    """Bytes a fused computation writes for value `name`: an in-place update writes its
    updates, a tuple its elements, anything else its whole result."""
    ins = module.instrs[name]
    if ins.opcode in _VIEWS and ins.operands and ins.opcode != "get-tuple-element":
        return _written_bytes(module, ins.operands[0][0])
    if ins.opcode in _IN_PLACE:
        update = ins.operands[_IN_PLACE[ins.opcode]][0]
        return sum(type_bytes(t) for t in module.instrs[update].result)
    if ins.opcode == "tuple":
        return sum(_written_bytes(module, op) for op, _ in ins.operands)
    return sum(type_bytes(t) for t in ins.result)


def dot_flops(module: HloModule, ins: Instr) -> int:
    """2 * (result elements) * (contracted elements) of a dot."""
    lhs = module.instrs.get(ins.operands[0][0]) if ins.operands else None
    if lhs is None or not lhs.result:
        return 0
    dims = lhs.result[ins.operands[0][1] or 0][1]
    k = math.prod(dims[d] for d in ins.attr_dims("lhs_contracting_dims") if d < len(dims))
    return 2 * math.prod(ins.result[0][1]) * k


def _computation_flops(module: HloModule, comp: str) -> int:
    flops = 0
    for n in module.computations.get(comp, []):
        ins = module.instrs[n]
        if ins.opcode == "dot":
            flops += dot_flops(module, ins)
        elif ins.opcode == "fusion" and ins.called:
            flops += _computation_flops(module, ins.called)
        elif ins.opcode in _IN_PLACE:  # touches its updates only
            upd = module.instrs.get(ins.operands[_IN_PLACE[ins.opcode]][0])
            flops += math.prod(upd.result[0][1]) if upd and upd.result else 0
        elif ins.opcode in ("reduce", "reduce-window"):
            flops += sum(math.prod(t[1]) for t in module.operand_types(n))
        elif ins.opcode not in _FREE and ins.result:
            flops += math.prod(ins.result[0][1])
    return flops


def cublas_flops(module: HloModule, ins: Instr) -> int:
    """FLOPs of a cuBLAS GEMM custom call: its dimension numbers are in the backend config."""
    m = _CUBLAS_DIMS.search(ins.line)
    lhs = module.operand_types(ins.name)[:1]
    if m is None or not lhs:
        return 0
    dims = lhs[0][1]
    k = math.prod(dims[int(d.strip('" '))] for d in m.group(1).split(",") if d.strip('" '))
    return 2 * math.prod(ins.result[0][1]) * k


def fusion_cost(module: HloModule, name: str) -> tuple[int, int]:
    """(bytes read + written, FLOPs) of a fusion kernel."""
    ins = module.instrs[name]
    comp = ins.called
    if comp is None or comp not in module.computations:
        return plain_cost(module, name)
    users = _users(module, comp)
    params = [module.instrs[n] for n in module.computations[comp]
              if module.instrs[n].opcode == "parameter"]
    read = sum(_read_bytes(p.name, sum(type_bytes(t) for t in p.result), users) for p in params)
    root = next(n for n in module.computations[comp] if module.instrs[n].root)
    return read + _written_bytes(module, root), _computation_flops(module, comp)


def plain_cost(module: HloModule, name: str) -> tuple[int, int]:
    """(bytes, FLOPs) of an unfused instruction or a custom call: operands and result whole."""
    ins = module.instrs[name]
    moved = sum(type_bytes(t) for t in module.operand_types(name))
    moved += sum(type_bytes(t) for t in ins.result)
    if ins.opcode == "dot":
        return moved, dot_flops(module, ins)
    return moved, 0
