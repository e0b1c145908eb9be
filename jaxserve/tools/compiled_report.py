"""Counts read from a compiled GPU program: what a step costs the GPU beyond its math.

`analyse` takes a compile's dump (thunk sequence + optimized HLO, jaxserve/tools/thunks.py and
hlo_text.py), its memory analysis and, when captured, ptxas' `-v` output, and returns a
`StepReport`:
- kernels and copies per layer (in the layer loop's body), and **weight copies**: copies whose
  input is a stacked layer weight `[L, ...]` (or whose result is one layer's slice of it, or the
  whole stack): a layer loop that slices each weight into a fresh buffer reads it twice;
- launches per step: what the host issues (a CUDA graph is one launch, loops count each trip);
- CUDA graphs (command buffers) and host-synchronising control flow: a conditional, or a loop
  without a known trip count, outside a graph makes the host read a predicate from the device
  and wait for it mid-step;
- alias (donated, in-place) bytes against the KV cache's bytes, temporaries;
- registers and spills per kernel from ptxas.
Nothing here imports jax; jaxserve/tools/gpu_step.py compiles the engine's step to feed it.
"""

from __future__ import annotations

import dataclasses
import re

from jaxserve.tools import thunks as th
from jaxserve.tools.hlo_text import ArrayType, Module

_PTXAS_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PTXAS_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")


@dataclasses.dataclass(frozen=True)
class StepReport:
    num_layers: int
    layer_loop: bool                 # the layers run as one loop (else unrolled)
    kernels_per_layer: float
    copies_per_layer: float          # all copies in a layer (weights, cache, activations)
    weight_copies_per_layer: float
    launches_per_step: int           # host-issued: kernels, copies and graphs, loops unrolled
    kernels_per_step: int            # device kernels, graph contents included
    command_buffers: int             # CUDA graphs in the program (static count)
    host_sync: int                   # conditionals / unknown-trip loops outside any graph
    layer_loop_in_graph: bool
    alias_bytes: int
    cache_bytes: int
    argument_bytes: int
    temp_bytes: int
    kernels: dict = dataclasses.field(default_factory=dict)  # name -> {registers, spill_bytes}
    approximate: bool = False        # a loop without a known trip count was counted once

    @property
    def cache_aliased(self) -> bool:
        return self.alias_bytes >= self.cache_bytes

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "cache_aliased": self.cache_aliased}


def is_weight_copy(t: th.Thunk, module: Module, stacked: set[ArrayType],
                   slices: set[ArrayType]) -> bool:
    """A thunk that copies layer weights: a copy (or a data-moving fusion: slice,
    concatenation) that reads a stacked weight `[L, ...]`, or writes one layer's slice of it or
    the whole stack. A GEMM or an elementwise fusion reading the weights in place is not one."""
    if t.hlo is None:
        return False
    if not (_is_copy(t) or module.moves_data(t.hlo)):
        return False
    ins = module.instructions.get(t.hlo)
    result = [(dt, tuple(d for d in dims if d != 1)) for dt, dims in
              (ins.result if ins else [])]
    inputs = set(module.input_types(t.hlo))
    return bool(inputs & stacked) or any(r in slices or r in stacked for r in result)


def _is_copy(t: th.Thunk) -> bool:
    # A dynamic-slice fusion around a copy is one slice copy; around a GEMM it is the GEMM
    # reading its operand in place (what XLA's dynamic-slice fusion is for).
    return t.kind in th.COPIES or (t.kind == "kDynamicSliceFusion" and any(
        c.kind in th.COPIES for c in t.all_children()))


def _copy_thunks(seq: list[th.Thunk]):
    """Copies in a sequence: a kDynamicSliceFusion (one slice copy) counts once, not its kCopy."""
    for t in seq:
        if _is_copy(t):
            yield t
        elif t.kind not in ("kWhile", "kConditional"):  # loops and branches are counted apart
            yield from _copy_thunks(t.all_children())


def _count(seq, module: Module, trips: dict, *, graph: bool = False) -> dict:
    """Kernels, copies and host launches of a sequence: loops times their trip count,
    conditionals by their costliest branch. Sets 'approximate' for unknown trip counts."""
    out = {"kernels": 0, "launches": 0, "approximate": False}
    for t in seq:
        if t.kind == "kWhile":
            n = trips.get(t.hlo)
            body = _count(t.children.get("body", []), module, trips, graph=graph)
            cond = _count(t.children.get("condition", []), module, trips, graph=graph)
            reps = n if n is not None else 1
            out["kernels"] += reps * (body["kernels"] + cond["kernels"])
            out["launches"] += reps * (body["launches"] + cond["launches"])
            out["approximate"] |= n is None or body["approximate"]
        elif t.kind == "kConditional":
            branches = [_count(s, module, trips, graph=graph) for s in t.children.values()]
            best = max(branches, key=lambda b: b["kernels"], default=None)
            if best:
                out["kernels"] += best["kernels"]
                out["launches"] += best["launches"]
                out["approximate"] |= best["approximate"]
        elif t.kind == "kCommandBuffer":
            inner = _count(t.all_children(), module, trips, graph=True)
            out["kernels"] += inner["kernels"]
            out["launches"] += 0 if graph else 1
            out["approximate"] |= inner["approximate"]
        elif t.kind in th.CONTROL:
            inner = _count(t.all_children(), module, trips, graph=graph)
            for k in ("kernels", "launches"):
                out[k] += inner[k]
            out["approximate"] |= inner["approximate"]
        else:  # a kernel or a copy
            out["kernels"] += t.kind not in th.COPIES
            out["launches"] += 0 if graph else 1
    return out


_LAYER_OP = re.compile(r'op_name="[^"]*/layers_\d+/')


def _in_a_layer(t: th.Thunk, module: Module) -> bool:
    ins = module.instructions.get(t.hlo) if t.hlo else None
    return ins is not None and _LAYER_OP.search(ins.line) is not None


def _layer_loops(tree, trips: dict, num_layers: int) -> list[tuple[th.Thunk, bool]]:
    return [(t, g) for t, g in th.walk(tree) if t.kind == "kWhile"
            and trips.get(t.hlo) == num_layers]


def ptxas_kernels(log: str) -> dict:
    """{entry function: {registers, spill_bytes}} from `ptxas -v` output."""
    out, current = {}, None
    for line in log.splitlines():
        m = _PTXAS_ENTRY.search(line)
        if m:
            current = m.group(1)
            out.setdefault(current, {"registers": None, "spill_bytes": 0})
            continue
        if current is None:
            continue
        s, r = _PTXAS_SPILL.search(line), _PTXAS_REGS.search(line)
        if s:
            out[current]["spill_bytes"] = int(s.group(1)) + int(s.group(2))
        if r:
            out[current]["registers"] = int(r.group(1))
    return out


def analyse(tree: list[th.Thunk], module: Module, *, num_layers: int,
            stacked: set[ArrayType], memory, cache_bytes: int, ptxas_log: str = "") -> StepReport:
    """The report of one compiled step. stacked: the array types of the layer weights as the
    step receives them, `[L, ...]` each; memory: `compiled.memory_analysis()`."""
    trips = {n: i.trip_count for n, i in module.instructions.items() if i.opcode == "while"}
    slices = {(dt, tuple(d for d in dims[1:] if d != 1)) for dt, dims in stacked}
    loops = _layer_loops(tree, trips, num_layers)
    total = _count(tree, module, trips)
    weight_copies = _weight_copy_runs(tree, module, trips, stacked, slices)
    if loops:
        loop, in_graph = max(loops, key=lambda lg: _count([lg[0]], module, trips)["kernels"])
        body = loop.children.get("body", [])
        kernels = _count(body, module, trips)["kernels"]
        copies = sum(1 for _ in _copy_thunks(body))
    else:  # unrolled: the thunks whose HLO op comes from a layer's module ("layers_3/...")
        in_graph = False
        in_layers = [t for t, _ in th.walk(tree) if _in_a_layer(t, module)]
        kernels = sum(t.kind not in th.CONTROL and t.kind not in th.COPIES
                      for t in in_layers) / num_layers
        copies = sum(_is_copy(t) for t in in_layers) / num_layers
    sync = sum(1 for t, g in th.walk(tree) if not g and (
        t.kind == "kConditional" or (t.kind == "kWhile" and trips.get(t.hlo) is None)))
    return StepReport(
        num_layers=num_layers, layer_loop=bool(loops), kernels_per_layer=kernels,
        copies_per_layer=copies, weight_copies_per_layer=weight_copies / num_layers,
        launches_per_step=total["launches"], kernels_per_step=total["kernels"],
        command_buffers=sum(1 for t, _ in th.walk(tree) if t.kind == "kCommandBuffer"),
        host_sync=sync, layer_loop_in_graph=in_graph,
        alias_bytes=memory.alias_size_in_bytes, cache_bytes=cache_bytes,
        argument_bytes=memory.argument_size_in_bytes, temp_bytes=memory.temp_size_in_bytes,
        kernels=ptxas_kernels(ptxas_log), approximate=total["approximate"])


def _weight_copy_runs(seq, module: Module, trips: dict, stacked, slices) -> int:
    """Weight copies executed per step: loops times their trip count, the costliest branch."""
    n = 0
    for t in seq:
        if t.kind == "kWhile":
            n += (trips.get(t.hlo) or 1) * _weight_copy_runs(
                t.children.get("body", []), module, trips, stacked, slices)
        elif t.kind == "kConditional":
            n += max((_weight_copy_runs(s, module, trips, stacked, slices)
                      for s in t.children.values()), default=0)
        elif _is_copy(t) or t.kind not in th.CONTROL:
            n += is_weight_copy(t, module, stacked, slices)
        else:
            n += _weight_copy_runs(t.all_children(), module, trips, stacked, slices)
    return n


def summarise_dump(directory) -> dict:
    """Per step module found in an XLA dump folder (gpu_check's `step_dump`): launches and
    kernels per step, copies, CUDA graphs and host-synchronising control flow. Without the
    step's weights and memory analysis, weight copies and aliasing are left to `analyse`."""
    import pathlib
    d = pathlib.Path(directory)
    out = {}
    for seq_file in sorted(d.glob("*.thunk_sequence_after_thunk_passes.txt")):
        name = seq_file.name.split(".thunk_sequence")[0]
        try:
            tree, hlo = th.load_dump(d, name)
        except FileNotFoundError as e:
            out[name] = {"error": str(e)}
            continue
        module = Module.parse(hlo)
        trips = {n: i.trip_count for n, i in module.instructions.items() if i.opcode == "while"}
        total = _count(tree, module, trips)
        out[name] = {
            "launches_per_step": total["launches"], "kernels_per_step": total["kernels"],
            "approximate": total["approximate"],
            "copies": sum(1 for _ in _copy_thunks(tree)),
            "command_buffers": sum(1 for t, _ in th.walk(tree) if t.kind == "kCommandBuffer"),
            "host_sync": sum(1 for t, g in th.walk(tree) if not g and (
                t.kind == "kConditional" or (t.kind == "kWhile" and trips.get(t.hlo) is None)))}
    return out
