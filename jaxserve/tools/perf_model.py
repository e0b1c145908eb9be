"""A deviceless performance model of the compiled GPU step: predicted step time, tokens/s, MBU.

For every kernel the step launches (the thunk sequence XLA dumps, CUDA graph contents included,
loops times their trip count), `kernel_costs` reads the bytes it moves through HBM and the
FLOPs it does from the optimized HLO (jaxserve/tools/hlo_costs.py); Pallas kernels get their
own costs from their operand shapes: paged attention reads the pages of the live context (not
the whole cache operand), int4 matmul its packed weights and scales, a grouped matmul the
weights of the experts its rows can reach. `predict` turns them into

    kernel_s = launch_s + ramp_s + max(bytes / (hbm_bytes_per_s * mem_efficiency),
                                       flops / (flops_per_s * flop_efficiency))
    step_s   = sum(kernel_s)                    (kernels of one CUDA graph run one after another)
    mbu      = (weight_bytes + kv_bytes) / (step_s * peak_hbm_bytes_per_s)

and `fit` refits the constants to a measured per-kernel trace. Constants, sources and the
anchor they reproduce: docs/perf_model.md. Nothing here imports jax.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

from jaxserve.tools import hlo_costs, thunks
from jaxserve.tools.hlo_costs import HloModule, type_bytes

_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TRITON = "__gpu$xla.gpu.triton"
# A plgpu.kernel call: its thunk is a bare kCustomCall, named here by its body function, the
# op_name component before the kernel's "mpmd_map".
_MOSAIC = 'custom_call_target="mosaic_gpu'
_MOSAIC_NAME = re.compile(r'op_name="[^"]*?([\w.\-]+)/mpmd_map')
_FLOATS = ("bf16", "f16", "f32")
_FUSED_MAX_ROWS = 64  # pallas_kernels/fused_linear.py MAX_ROWS (that module imports jax)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hardware:
    """One GPU's constants. Times in seconds, rates per second; see docs/perf_model.md."""

    name: str
    hbm_bytes_per_s: float        # sustained HBM rate: a large device-to-device copy, measured
    peak_hbm_bytes_per_s: float   # the datasheet's HBM bandwidth: MBU's denominator, the floor
    flops_per_s: float            # bf16 dense matmul rate, measured on a large GEMM
    launch_s: float = 1.3e-6      # gap between consecutive kernels of one CUDA graph
    ramp_s: float = 4.5e-6        # per kernel, time not streaming: start, first loads, tail
    mem_efficiency: float = 0.87  # share of hbm_bytes_per_s a streaming kernel sustains
    flop_efficiency: float = 1.0  # share of flops_per_s a kernel's dots sustain

    def __post_init__(self):
        for f in ("hbm_bytes_per_s", "peak_hbm_bytes_per_s", "flops_per_s"):
            if not getattr(self, f) > 0:
                raise ValueError(f"{f} must be > 0, got {getattr(self, f)}")
        if self.launch_s < 0 or self.ramp_s < 0:
            raise ValueError(f"launch_s and ramp_s must be >= 0, got {self.launch_s}, "
                             f"{self.ramp_s}")
        if not 0 < self.mem_efficiency or not 0 < self.flop_efficiency <= 1:
            raise ValueError("mem_efficiency must be > 0 and flop_efficiency in (0, 1]")
        if self.hbm_bytes_per_s * self.mem_efficiency > self.peak_hbm_bytes_per_s:
            raise ValueError(
                f"hbm_bytes_per_s * mem_efficiency = "
                f"{self.hbm_bytes_per_s * self.mem_efficiency:.3g} B/s exceeds the peak "
                f"{self.peak_hbm_bytes_per_s:.3g} B/s: no kernel streams faster than the HBM")

    @property
    def stream_bytes_per_s(self) -> float:
        return self.hbm_bytes_per_s * self.mem_efficiency

    @property
    def dot_flops_per_s(self) -> float:
        return self.flops_per_s * self.flop_efficiency


# H200 SXM: copy rate and bf16 rate measured on the project's H200 (docs/gpu.md), 4.8 TB/s
# datasheet. H100 SXM (the anchor's GPU): 3.35 TB/s datasheet, copy at the H200's measured
# share of its datasheet (0.896); same GH100 die and clocks, so the H200's matmul rate.
H200 = Hardware(name="H200", hbm_bytes_per_s=4.3e12, peak_hbm_bytes_per_s=4.8e12,
                flops_per_s=790e12)
H100 = Hardware(name="H100", hbm_bytes_per_s=3.0e12, peak_hbm_bytes_per_s=3.35e12,
                flops_per_s=790e12)


@dataclasses.dataclass(frozen=True)
class KernelCost:
    name: str            # the thunk's kernel name (what a profiler trace shows)
    hlo: str | None      # the HLO instruction it runs
    # attention | int4_matmul | grouped_matmul | fused_linear | pallas | gemm | fusion |
    # copy | other
    kind: str
    bytes: int           # read + written in HBM
    flops: int
    kv_bytes: int = 0    # of `bytes`: KV-cache pages attention must read
    scope: str = ""      # layer | sampling | other: where its HLO op comes from


@dataclasses.dataclass(frozen=True)
class StepPrediction:
    step_s: float
    kernel_s: tuple[float, ...]   # per kernel, in `costs` order
    mbu: float                    # (weight + KV bytes) / (step_s * peak HBM bandwidth)
    tokens_per_s: float
    floor_s: float                # max(all bytes / peak bandwidth, all FLOPs / peak rate)
    overhead_s: float             # the launch and ramp terms, summed
    kernels: int

    def as_dict(self) -> dict:
        return {"step_us": self.step_s * 1e6, "tokens_per_s": self.tokens_per_s,
                "mbu": self.mbu, "floor_us": self.floor_s * 1e6,
                "overhead_us": self.overhead_s * 1e6, "kernels": self.kernels}


def kernel_time(c: KernelCost, hw: Hardware) -> float:
    return hw.launch_s + hw.ramp_s + max(c.bytes / hw.stream_bytes_per_s,
                                         c.flops / hw.dot_flops_per_s)


def predict(costs: list[KernelCost], hw: Hardware, *, tokens: int, weight_bytes: int,
            kv_bytes: int | None = None) -> StepPrediction:
    """The step's time on `hw`: its kernels one after another. tokens: tokens the step
    produces (live decode rows); weight_bytes: the weights one step must read; kv_bytes: the
    KV bytes it must read (default: what the attention kernels read)."""
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    times = tuple(kernel_time(c, hw) for c in costs)
    step = sum(times)
    kv = sum(c.kv_bytes for c in costs) if kv_bytes is None else kv_bytes
    floor = max(sum(c.bytes for c in costs) / hw.peak_hbm_bytes_per_s,
                sum(c.flops for c in costs) / hw.flops_per_s)
    return StepPrediction(
        step_s=step, kernel_s=times, mbu=(weight_bytes + kv) / (step * hw.peak_hbm_bytes_per_s)
        if step else 0.0, tokens_per_s=tokens / step if step else 0.0, floor_s=floor,
        overhead_s=len(costs) * (hw.launch_s + hw.ramp_s), kernels=len(costs))


def fit(costs: list[KernelCost], measured_s: dict[str, float], hw: Hardware, *,
        gap_s: float | None = None) -> Hardware:
    """`hw` with ramp_s, mem_efficiency and flop_efficiency fitted (least squares) to measured
    kernel durations: measured_s maps a kernel name (thunk kernel name or HLO name) to its mean
    device duration per launch, as a profiler trace gives it (gaps excluded). gap_s, the mean
    gap between kernels in that trace, replaces launch_s when given. Kernels are split into
    memory- and compute-bound by the current constants, refitted, and split again."""
    pairs = [(c, measured_s.get(c.name, measured_s.get(c.hlo or ""))) for c in costs]
    pairs = [(c, t) for c, t in pairs if t is not None and c.kind != "copy"]
    if len(pairs) < 3:
        raise ValueError(f"fit needs >= 3 measured kernels of the step, got {len(pairs)}")
    out = hw if gap_s is None else dataclasses.replace(hw, launch_s=max(gap_s, 0.0))
    for _ in range(3):
        mem = [c.bytes / out.stream_bytes_per_s >= c.flops / out.dot_flops_per_s
               for c, _ in pairs]
        a = np.array([[1.0, c.bytes if m else 0.0, 0.0 if m else c.flops]
                      for (c, _), m in zip(pairs, mem)])
        y = np.array([t for _, t in pairs])
        keep = [j for j in range(3) if a[:, j].any()]
        coef = np.zeros(3)
        coef[keep] = np.linalg.lstsq(a[:, keep], y, rcond=None)[0]
        ramp = max(float(coef[0]), 0.0)
        # Seconds per byte / FLOP -> efficiencies, bounded by the hardware's peaks.
        mem_eff = out.mem_efficiency if coef[1] <= 0 else min(
            1 / (coef[1] * out.hbm_bytes_per_s),
            out.peak_hbm_bytes_per_s / out.hbm_bytes_per_s)
        flop_eff = out.flop_efficiency if coef[2] <= 0 else min(
            1 / (coef[2] * out.flops_per_s), 1.0)
        out = dataclasses.replace(out, ramp_s=ramp, mem_efficiency=mem_eff,
                                  flop_efficiency=flop_eff)
    return out


def compare(costs: list[KernelCost], measured_s: dict[str, float], hw: Hardware) -> dict:
    """Per kernel name: launches per step, bytes and FLOPs per launch, the predicted duration
    per launch (launch gap excluded, as a trace's kernel events exclude it) and the measured
    one (measured_s as for `fit`; None where the trace lacks the kernel), in microseconds."""
    out: dict[str, dict] = {}
    for c in costs:
        row = out.setdefault(c.name, {"kind": c.kind, "launches": 0, "bytes": 0, "flops": 0,
                                      "predicted_us": 0.0, "measured_us": None})
        row["launches"] += 1
        row["bytes"] += c.bytes
        row["flops"] += c.flops
        row["predicted_us"] += (kernel_time(c, hw) - hw.launch_s) * 1e6
        t = measured_s.get(c.name, measured_s.get(c.hlo or ""))
        if t is not None:
            row["measured_us"] = t * 1e6
    for row in out.values():
        for k in ("bytes", "flops", "predicted_us"):
            row[k] /= row["launches"]
    return out


# --- reading a compiled step -------------------------------------------------------------


def kernel_costs(dump_dir, module: str, *, context_len: int, rows: int) -> list[KernelCost]:
    """One KernelCost per kernel launch of `module`'s compiled step in an XLA dump folder
    (thunk sequence + optimized HLO), in launch order. context_len: tokens of context each
    live row attends over; rows: live rows (sequences) of the step."""
    if context_len < 1 or rows < 1:
        raise ValueError(f"context_len and rows must be >= 1, got {context_len}, {rows}")
    tree, text = thunks.load_dump(dump_dir, module)
    return costs_of(tree, HloModule.parse(text), context_len=context_len, rows=rows)


def costs_of(tree: list[thunks.Thunk], hm: HloModule, *, context_len: int,
             rows: int) -> list[KernelCost]:
    trips = {n: int(m.group(1)) for n, i in hm.instrs.items() if i.opcode == "while"
             for m in [_TRIP.search(i.line)] if m}
    return list(_visit(tree, hm, trips, context_len, rows))


def _visit(seq, hm, trips, ctx, rows):
    for t in seq:
        if t.kind == "kWhile":
            body = list(_visit(t.children.get("condition", []) + t.children.get("body", []),
                               hm, trips, ctx, rows))
            yield from body * (trips.get(t.hlo) or 1)
        elif t.kind == "kConditional":
            branches = [list(_visit(s, hm, trips, ctx, rows)) for s in t.children.values()]
            yield from max(branches, key=lambda b: sum(c.bytes for c in b) + len(b),
                           default=[])
        elif t.kind in thunks.CONTROL and t.kind != "kDynamicSliceFusion":
            yield from _visit(t.all_children(), hm, trips, ctx, rows)
        else:
            yield _cost(t, hm, ctx, rows)


def _scope(line: str) -> str:
    m = _OP_NAME.search(line)
    op = m.group(1) if m else ""
    if re.search(r"/layers_\d+/", op):
        return "layer"
    return "sampling" if "/sampling/" in op else "other"


def _cost(t: thunks.Thunk, hm: HloModule, ctx: int, rows: int) -> KernelCost:
    ins = hm.instrs.get(t.hlo) if t.hlo else None
    name = t.kernel_name if t.kind not in thunks.COPIES else (t.hlo or "copy")
    if ins is None:
        return KernelCost(name, t.hlo, "copy" if t.kind in thunks.COPIES else "other", 0, 0)
    scope = _scope(ins.line)
    if t.kind in thunks.COPIES:  # a memcpy node: reads and writes its result's bytes
        return KernelCost(name, t.hlo, "copy", 2 * sum(map(type_bytes, ins.result)), 0,
                          scope=scope)
    if ins.opcode == "custom-call" and _TRITON in ins.line:
        return _pallas_cost(name, ins, hm, ctx, rows, scope)
    if ins.opcode == "custom-call" and _MOSAIC in ins.line:
        return _pallas_cost(mosaic_kernel_name(ins.line), ins, hm, ctx, rows, scope)
    if ins.opcode == "custom-call" and "cublas" in ins.line:
        moved = sum(map(type_bytes, hm.operand_types(ins.name))) + type_bytes(ins.result[0])
        return KernelCost(name, ins.name, "gemm", moved, hlo_costs.cublas_flops(hm, ins),
                          scope=scope)
    inner = _wrapped_pallas_call(hm, ins)
    if inner is not None:  # XLA's dynamic-slice fusion hands a Pallas call operand slices
        label = mosaic_kernel_name(inner.line) if _MOSAIC in inner.line else name
        return _pallas_cost(label, inner, hm, ctx, rows, scope)
    if ins.opcode == "fusion":
        moved, flops = hlo_costs.fusion_cost(hm, ins.name)
        has_dot = any(hm.instrs[n].opcode == "dot" for n in hm.computations.get(ins.called, []))
        return KernelCost(name, ins.name, "gemm" if has_dot else "fusion", moved, flops,
                          scope=scope)
    moved, flops = hlo_costs.plain_cost(hm, ins.name)
    return KernelCost(name, ins.name, "other", moved, flops, scope=scope)


def _wrapped_pallas_call(hm: HloModule, ins):
    """The Pallas custom call (Triton or Mosaic GPU) a kCustom fusion wraps, or None. XLA
    wraps one in a `dynamic_slice_fusion` to pass it slices of buffers without copies (the
    q heads of a packed q/k/v array): costed as the call on its operands' (sliced) shapes, not
    as a fusion reading every parameter (the whole KV cache) whole."""
    if ins.opcode != "fusion" or "kind=kCustom" not in ins.line:
        return None
    for n in hm.computations.get(ins.called, []):
        inner = hm.instrs[n]
        if inner.opcode == "custom-call" and (_TRITON in inner.line or _MOSAIC in inner.line):
            return inner
    return None


def mosaic_kernel_name(line: str) -> str:
    """A Mosaic GPU custom call's kernel (its body function's name) from its HLO line."""
    m = _MOSAIC_NAME.search(line)
    return m.group(1) if m else "mosaic_gpu"


def _pallas_cost(name, ins, hm, ctx, rows, scope) -> KernelCost:
    ops = hm.operand_types(ins.name)
    out = sum(map(type_bytes, ins.result))
    if "attention" in name:
        return _attention_cost(name, ins.name, ops, list(ins.result), ctx, rows, scope)
    moved = sum(map(type_bytes, ops)) + out
    if "grouped_matmul" in name:
        gmm = _grouped_matmul_cost(name, ins.name, ops, list(ins.result), scope)
        if gmm is not None:
            return gmm
    if "int4" in name:
        # Packed codes [..., N], two per byte over K (however the kernel views K: [K/2] or
        # [K/g, g/2]); activations: the first float operand, M * K elements.
        packed = next((o for o in ops if o[0] in ("u8", "s8") and len(o[1]) >= 2), None)
        x = next((o for o in ops if o[0] in _FLOATS), None)
        flops = 0
        if packed and x:
            k, n = 2 * math.prod(packed[1][:-1]), packed[1][-1]
            flops = 2 * (math.prod(x[1]) // k) * n * k
        return KernelCost(name, ins.name, "int4_matmul", moved, flops, scope=scope)
    if "kv_cache_write" in name:
        # pallas_kernels/kv_write.py: the caches come back aliased (updated in place); it
        # reads the step's new values (a packed q/k/v array: q's heads too) and writes as many
        # bytes at most, not the caches it is handed.
        caches = set(ins.result)
        new = [o for o in ops if o not in caches and o[0] in _FLOATS + ("s8",) and o[1]]
        return KernelCost(name, ins.name, "pallas", 2 * sum(map(type_bytes, new)), 0,
                          scope=scope)
    if "fused_linear" in name:
        # x [M, K] first (the LM head: x [T, K], then the M rows it takes, [M] int32), then
        # the weights [K, N_i] (a tied head's [N, K]): 2 M K N_i FLOPs each. The norm scale,
        # biases and RoPE vectors are 1-D; a residual [M, N] (M <= 64 rows) would pass for a
        # weight only where M = K (K a model width).
        (_, (m, k)), flops = ops[0], 0
        if len(ops) > 1 and ops[1][0] == "s32" and len(ops[1][1]) == 1:
            m = ops[1][1][0]
        for _, shape in ops[1:]:
            if len(shape) == 2 and shape[0] == k:
                flops += 2 * m * k * shape[1]
            elif len(shape) == 2 and shape[1] == k and shape[0] > _FUSED_MAX_ROWS:
                flops += 2 * m * k * shape[0]
        return KernelCost(name, ins.name, "fused_linear", moved, flops, scope=scope)
    return KernelCost(name, ins.name, "pallas", moved, 0, scope=scope)


def _grouped_matmul_cost(name, hlo, ops, results, scope) -> KernelCost | None:
    """A grouped matmul (pallas_kernels/grouped_matmul*.py: the MoE experts) reads the weights
    of the experts its rows are routed to, not all E of the `[E, ...]` weights: at most
    min(E, M, I), each row having one expert and each of the I work items (the item outputs'
    leading dimension, `[I, tm, N]` or `[I, N, tm]`) one; the rest (schedule or metadata, x,
    scales) and its item outputs whole. None when no weights and x are found among the
    operands."""
    w = next((o for o in ops if len(o[1]) == 3), None)
    if w is None:
        return None
    e, a, b = w[1]
    # int8 codes are stored output-major [E, N, K], float weights [E, K, N].
    k, n = (b, a) if w[0] in ("s8", "u8") else (a, b)
    # x [M, K]: the first match, as it precedes the weights in both kernels' operands and the
    # scales [E, N] follow (which would match too where N == K).
    x = next((o for o in ops if o[0] in _FLOATS and len(o[1]) == 2 and o[1][1] == k), None)
    if x is None:
        return None
    # M: x's rows as the kernel gets them, padded to whole row tiles: an upper bound on the
    # call's rows, so on its useful FLOPs; the items bound the experts tighter where a tile
    # is taller than the rows (one token's top-8 in 16-row tiles: 8 items, 16 rows).
    m = x[1][0]
    items = results[0][1][0] if results and results[0][1] else m
    weights = type_bytes((w[0], (min(e, m, items), a, b)))
    rest = sum(map(type_bytes, ops)) - type_bytes(w)
    out = sum(map(type_bytes, results))
    return KernelCost(name, hlo, "grouped_matmul", weights + rest + out, 2 * m * k * n,
                      scope=scope)


def _attention_cost(name, hlo, ops, results, ctx, rows, scope) -> KernelCost:
    """Paged attention reads, per live row, the pages holding its context in one layer of the
    K and V caches `[L, NB, BS, K, Dh]` (and of int8 scales `[L, NB, BS, K]`, or flattened),
    not the whole cache operands; everything else it reads whole (q, page table, lengths). A
    kernel that writes the step's keys and values too returns the caches (aliased, updated in
    place): it writes one token's K and V per query token, not the caches."""
    caches = [o for o in ops if len(o[1]) == 5]
    if not caches:
        raise ValueError(f"attention kernel {name}: no [L, NB, BS, K, Dh] cache operand among "
                         f"{ops}")
    block, kv_heads, head_dim = caches[0][1][2:]
    # Scales as the cache's shape less head_dim, or flattened (the Mosaic kernel's operands).
    scale_size = math.prod(caches[0][1][:4])
    scales = [o for o in ops if (len(o[1]) == 4 and o[1] == caches[0][1][:4])
              or (len(o[1]) == 1 and o[1][0] >= scale_size)]
    slots = rows * -(-ctx // block) * block  # whole pages
    kv = sum(type_bytes((o[0], (slots, kv_heads, head_dim))) for o in caches)
    kv += sum(type_bytes((o[0], (slots, kv_heads))) for o in scales)
    rest = [o for o in ops if o not in caches and o not in scales]
    q = max((o for o in rest if o[0] in _FLOATS), key=lambda o: math.prod(o[1]), default=None)
    # Each query row: a QK dot over the context and a PV dot back (2 * 2 * Dh * ctx), padded
    # query rows included (the kernel computes them).
    flops = 4 * math.prod(q[1]) * ctx if q else 0
    tokens = q[1][0] if q else 0  # q [T, heads, Dh]: the packed q/k/v or q alone
    out = sum(type_bytes((r[0], (tokens, kv_heads, head_dim))) if len(r[1]) == 5
              else type_bytes(r) for r in results)
    return KernelCost(name, hlo, "attention", sum(map(type_bytes, rest)) + out + kv, flops,
                      kv_bytes=kv, scope=scope)
