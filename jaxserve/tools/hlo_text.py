"""What the thunk counts need from XLA's optimized HLO text: instruction types, the parameter
types of called computations, and loops' known trip counts. Nothing here imports jax."""

from __future__ import annotations

import dataclasses
import re

import numpy as np

_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_HEADER = re.compile(r"^%(\S+) \((.*)\) -> .* \{$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = ")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CALLS = re.compile(r"calls=%([\w.\-]+)")

# numpy dtype names -> HLO element types (those model weights and KV caches use).
HLO_DTYPES = {"bfloat16": "bf16", "float16": "f16", "float32": "f32", "int8": "s8",
              "uint8": "u8", "int32": "s32", "uint32": "u32", "int4": "s4", "uint4": "u4"}

# Opcodes that only move data; a fusion rooted at one of them materialises a copy.
DATA_MOVES = frozenset({"copy", "dynamic-slice", "slice", "concatenate", "transpose", "pad"})

ArrayType = tuple[str, tuple[int, ...]]  # (HLO element type, dims)


def array_type(dtype, shape) -> ArrayType:
    return HLO_DTYPES.get(np.dtype(dtype).name, np.dtype(dtype).name), tuple(shape)


def _types(text: str) -> list[ArrayType]:
    return [(m.group(1), tuple(int(d) for d in m.group(2).split(",") if d))
            for m in _ARRAY.finditer(text)]


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    result: list[ArrayType]  # one entry per array in the result (tuples flattened)
    opcode: str
    line: str

    @property
    def called(self) -> list[str]:
        return _CALLS.findall(self.line)

    @property
    def trip_count(self) -> int | None:
        m = _TRIP.search(self.line)
        return int(m.group(1)) if m else None


def _result_and_opcode(rest: str) -> tuple[str, str]:
    """Splits 'TYPE opcode(operands)...' where TYPE may be a parenthesised tuple."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                break
        type_text, tail = rest[:i + 1], rest[i + 1:].lstrip()
    else:
        type_text, _, tail = rest.partition(" ")
    return type_text, tail.split("(", 1)[0]


@dataclasses.dataclass(frozen=True)
class Module:
    instructions: dict[str, Instruction]
    params: dict[str, list[ArrayType]]  # computation -> its parameters' array types
    roots: dict[str, str]                # computation -> its ROOT instruction's opcode

    @classmethod
    def parse(cls, text: str) -> Module:
        instrs, params, roots, comp = {}, {}, {}, None
        for line in text.splitlines():
            h = _HEADER.match(line)
            if h:
                comp = h.group(1)
                params[comp] = _types(h.group(2))
                continue
            m = _INSTR.match(line)
            if m:
                type_text, opcode = _result_and_opcode(line[m.end():])
                instrs[m.group(1)] = Instruction(m.group(1), _types(type_text), opcode, line)
                if line.lstrip().startswith("ROOT ") and comp is not None:
                    roots[comp] = opcode
        return cls(instrs, params, roots)

    def moves_data(self, name: str) -> bool:
        """A copy-like instruction: a copy, slice or concatenation, or a fusion whose result is
        one (what XLA emits to materialise a slice or a concatenation of its inputs)."""
        ins = self.instructions.get(name)
        if ins is None:
            return False
        ops = [ins.opcode] + [self.roots.get(c, "") for c in ins.called]
        return any(op in DATA_MOVES for op in ops)

    def input_types(self, name: str) -> list[ArrayType]:
        """The array types an instruction reads: its called computations' parameters (fusions,
        async wrappers, recursively) or, for a plain op, the types named on its line."""
        ins = self.instructions.get(name)
        if ins is None:
            return []
        out = []
        for comp in ins.called:
            out += self.params.get(comp, [])
        if not out:
            out = _types(ins.line.split("(", 1)[1]) if "(" in ins.line else []
        return out
