"""GPU check: the one prepared script to run when an H200 is lent (see docs/gpu.md).

One call fits 8 minutes on a fresh H200 with start-up: a default budget of 330 s, checked
between sections, cases, engine variants and batches (what would start after it is skipped,
with a reason); every section on its own (a failure is recorded and the rest still runs):

  environment        python / jax / jaxlib / plugin versions, devices, device memory
  bandwidth          measured device copy and read bandwidth, dispatch floor, bf16 matmul rate
  kernel_correctness paged attention (decode and ragged) and int4 matmul on the device vs
                     their jnp references, plus an f32 ragged step and one over a > 4 GiB cache
                     (Pallas indexes it with 64-bit offsets)
  kernel_timings     the same cases timed (warm, median) against the nominal 4.3 TB/s and the
                     measured bandwidth, side by side with the XLA paths the engine runs
                     (its XLA ragged attention on the same rows and pages, laid out by
                     step_layout.build; XLA int4 dequantize-matmul)
  e2e_smollm2        engine decode tok/s on SmolLM2-135M (from --gguf if loadable, else random
                     weights), bf16 vs int4, batch 1/64, with the engine's per-step host /
                     device-wait breakdown
  llm_defaults       a short run of plain `LLM(model)`: every engine setting at its default
  e2e_llama3_8b      the same as e2e_smollm2 on a random Llama-3-8B-shaped model
  step_dump          the XLA dump of every engine step compiled above (--xla_dump_to, limited
                     to the step module), saved under --out-dir/xla_dump_step
  hf_peer            HF transformers `generate` on the same GPU, SmolLM2 shapes, bf16
  kernel_tests       the kernel test suite compiled on the GPU (`pytest -m gpu`), where pytest
                     is installed

Kernel inputs and tolerances are the kernel tests' own (pallas_kernels/cases.py), at GPU sizes.

    python scripts/gpu_check.py --out-dir $OUT [--gguf SmolLM2.gguf] [--time-budget 330]
    python scripts/gpu_check.py --dry-run --out-dir /tmp/gc    # CPU, interpret-mode kernels

Writes gpu_check.json after every section (a killed run keeps what it finished) and
gpu_check.md at the end, and prints the markdown. Exit status 1 when a section errored or a
kernel was out of tolerance, else 0. Imports only jax, numpy, flax (and torch/transformers for
the peer, pytest for kernel_tests) besides this repository.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.metadata
import json
import math
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time
import traceback
import warnings
import zlib

from pallas_kernels.cases import (ATTENTION_MODELS, ATTENTION_TOLERANCE, INT4_MODEL_SHAPES,
                                  INT4_TOLERANCE)

REPO = pathlib.Path(__file__).resolve().parent.parent

NOMINAL_BW = 4.3e12          # B/s, H200 device copy bandwidth measured on the H200 machine (docs/peers.md)
NOMINAL_BF16_FLOPS = 790e12  # FLOP/s, H200 dense bf16 (docs/peers.md)
L2_BYTES = 50 * 2**20        # H200 L2; timed inputs cycle through > 2x this so reads hit HBM
TOKEN_LOW = 100              # random prompt ids start here (skips special tokens)
GPU_BUDGET_S = 330.0         # default --time-budget on a GPU: one call in 8 min with start-up
DRY_BUDGET_S = 1200.0        # a CPU dry run is not on the clock; interpreted kernels are slow

warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")


# ---- what to run: the GPU profile and the tiny CPU dry-run profile ----------------------------

def model_configs(dry: bool) -> dict:
    from models.config import ModelConfig, RopeScaling
    if dry:  # same head layouts (K, G, Dh) as the real models, tiny widths and depths
        return {
            "llama3_8b": ModelConfig(vocab_size=512, hidden_size=512, intermediate_size=256,
                                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=128,
                                     max_position_embeddings=256),
            "smollm2": ModelConfig(vocab_size=512, hidden_size=576, intermediate_size=256,
                                   num_layers=2, num_heads=9, num_kv_heads=3, head_dim=64,
                                   tie_word_embeddings=True, max_position_embeddings=256)}
    return {
        "llama3_8b": ModelConfig(
            vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
            num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
            rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                     original_max_position_embeddings=8192),
            max_position_embeddings=8192, bos_token_id=128000, eos_token_ids=(128009,)),
        "smollm2": ModelConfig(
            vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
            num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
            max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1,
            eos_token_ids=(2,))}


ATTN_HEADS = {m: heads[:3] for m, heads in ATTENTION_MODELS.items()}  # (K, G, Dh)
INT4_SHAPES = INT4_MODEL_SHAPES


@dataclasses.dataclass(frozen=True)
class Profile:
    interpret: bool
    backend: str                 # engine attention/linear backend
    attn_cases: tuple            # (model, block_size, batch)
    max_context: int
    int4_cases: tuple            # (model, K, N, M)
    iters: int                   # calls per timing sample
    reps: int                    # samples; the median is reported
    copy_bytes: int
    matmul_n: int
    max_layers: int              # timed attention caches cycle through up to this many layers
    max_copies: int              # timed int4/dense weights cycle through up to this many copies
    e2e_batches: tuple
    e2e_variants: tuple          # quantizations benchmarked per model (None = bf16)
    prompt_len: int
    new_tokens: int
    max_model_len: int
    block_size: int = 16
    # Ragged steps (model, block_size, max_context, decode rows): one mixed step each.
    ragged_cases: tuple = ()
    # Checked only: (model, block_size, max_context, decode rows, dtype, min cache GiB).
    ragged_extra_cases: tuple = ()
    defaults_prompts: int = 4    # plain LLM() run: prompts of prompt_len, new_tokens each
    # (section, seconds): a section starts only with this much budget left (8B init + compiles).
    section_min_s: tuple = ()
    variant_min_s: float = 0.0   # an engine variant (bf16, int4) starts only with this left


GPU_PROFILE = Profile(
    interpret=False, backend="pallas",
    attn_cases=tuple((mo, bs, b) for mo in ATTN_HEADS for bs in (16, 32) for b in (1, 64)),
    max_context=4096,
    int4_cases=tuple((mo, k, n, m) for mo, shapes in INT4_SHAPES.items() for k, n in shapes
                     for m in (1, 64)),
    iters=20, reps=7, copy_bytes=2 << 30, matmul_n=8192, max_layers=32, max_copies=64,
    e2e_batches=(1, 64), e2e_variants=(None, "int4"), prompt_len=136, new_tokens=64,
    max_model_len=256, ragged_cases=(("llama3_8b", 16, 2048, 48),),
    ragged_extra_cases=(("smollm2", 16, 1024, 8, "float32", 0.0),
                        ("llama3_8b", 16, 2048, 8, "bfloat16", 4.5)),
    # llm_defaults warms up every bucket (its construct_s is that start-up cost).
    section_min_s=(("e2e_llama3_8b", 90.0), ("llm_defaults", 60.0), ("hf_peer", 20.0)),
    variant_min_s=25.0)

# CPU: the same code paths through the Pallas interpreter, each at a fraction of a second of
# work. Cases cover both head layouts, both block sizes, the split (batch 1) and batched paths;
# compile time, not run time, is what costs here, so the grids are not cross products.
DRY_PROFILE = Profile(
    interpret=True, backend="pallas-interpret",
    attn_cases=(("smollm2", 16, 4), ("llama3_8b", 32, 1)), max_context=64,
    int4_cases=(("smollm2", 128, 256, 1), ("llama3_8b", 256, 128, 4)),
    iters=2, reps=2, copy_bytes=8 << 20, matmul_n=256, max_layers=2, max_copies=2,
    e2e_batches=(2,), e2e_variants=(None, "int4"), prompt_len=20, new_tokens=6,
    max_model_len=64, ragged_cases=(("smollm2", 16, 64, 4),),
    # The large-cache case at a few MiB: the same code path; the > 4 GiB indexing itself is
    # compiled deviceless in tests/test_ragged_paged_attention.py.
    ragged_extra_cases=(("smollm2", 16, 64, 2, "float32", 0.0),
                        ("llama3_8b", 16, 64, 2, "bfloat16", 1 / 256)),
    defaults_prompts=2)



class Ctx:
    """Run state shared by the sections."""

    def __init__(self, args, prof: Profile):
        self.args, self.prof = args, prof
        self.start = time.monotonic()
        self.deadline = self.start + args.time_budget
        self.bandwidth: dict = {}   # measured copy/read B/s (bandwidth section)
        self.cases: dict = {}       # kernel inputs shared by correctness and timings
        self.engine_results: dict = {}

    def over_budget(self) -> bool:
        return time.monotonic() > self.deadline

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def log(self, msg: str) -> None:
        print(f"[gpu_check {time.monotonic() - self.start:6.1f}s] {msg}", flush=True)


# ---- helpers -----------------------------------------------------------------------------------

def time_calls(fn, arg_sets, iters: int, reps: int) -> dict:
    """Median seconds per call: `iters` back-to-back calls cycling over `arg_sets`, then one
    block_until_ready (the device runs them in order), `reps` samples. First call warms up."""
    import jax
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*arg_sets[0]))
    first = time.perf_counter() - t0
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = None
        for i in range(iters):
            out = fn(*arg_sets[i % len(arg_sets)])
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / iters)
    return {"median_s": statistics.median(samples), "min_s": min(samples),
            "first_call_s": first}


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def package_versions() -> dict:
    wanted = ("jax", "jaxlib", "flax", "numpy", "orbax-checkpoint", "ml_dtypes", "torch",
              "transformers", "safetensors", "tokenizers", "gguf", "jinja2", "tqdm", "flask")
    out = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name in wanted or name.startswith(("jax-cuda", "jax_cuda", "nvidia-cuda-runtime")):
            out[name] = dist.version
    return dict(sorted(out.items()))


def importable(name: str) -> str | None:
    """None when `name` imports, else the reason it does not."""
    try:
        __import__(name)
        return None
    except Exception as e:  # noqa: BLE001 - any import failure is a reason to skip
        return f"{type(e).__name__}: {e}"


# ---- sections: environment and bandwidth -------------------------------------------------------

def section_environment(ctx: Ctx) -> dict:
    import jax
    dev = jax.devices()
    res = {"python": platform.python_version(), "platform": platform.platform(),
           "jax": jax.__version__, "jaxlib": importlib.metadata.version("jaxlib"),
           "packages": package_versions(), "default_backend": jax.default_backend(),
           "devices": [f"{d.platform}:{d.id} {d.device_kind}" for d in dev],
           "cpu_count": os.cpu_count(), "dry_run": ctx.args.dry_run,
           "xla_env": {k: v for k, v in os.environ.items() if k.startswith(("XLA_", "JAX_"))},
           "importable": {m: importable(m) or "ok" for m in
                          ("gguf", "jinja2", "tqdm", "torch", "transformers")}}
    stats = dev[0].memory_stats() or {}
    res["device_memory"] = {k: stats[k] for k in ("bytes_limit", "bytes_in_use",
                                                  "peak_bytes_in_use") if k in stats}
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,"
                              "clocks.max.sm,clocks.max.mem,power.limit", "--format=csv"],
                             capture_output=True, text=True, timeout=20)
        res["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except Exception as e:  # noqa: BLE001 - CPU machines have no nvidia-smi
        res["nvidia_smi"] = f"unavailable ({type(e).__name__})"
    return res


def section_bandwidth(ctx: Ctx) -> dict:
    import jax
    import jax.numpy as jnp
    p = ctx.prof
    n = p.copy_bytes // 4
    x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
    copy = time_calls(jax.jit(lambda a: a + 1.0), [(x,)], p.iters, p.reps)
    read = time_calls(jax.jit(lambda a: jnp.max(a)), [(x,)], p.iters, p.reps)
    tiny = jnp.ones((16,), jnp.float32)
    floor = time_calls(jax.jit(lambda a: a + 1.0), [(tiny,)], max(p.iters, 50), p.reps)
    m = p.matmul_n
    a = jax.random.normal(jax.random.key(1), (m, m), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (m, m), jnp.bfloat16)
    mm = time_calls(jax.jit(lambda u, v: jnp.dot(u, v)), [(a, b)], p.iters, p.reps)
    del x, a, b
    ctx.bandwidth = {"copy": 2 * p.copy_bytes / copy["median_s"],
                     "read": p.copy_bytes / read["median_s"]}
    flops = 2 * m ** 3 / mm["median_s"]
    return {"array_bytes": p.copy_bytes,
            "copy_bw_Bps": ctx.bandwidth["copy"], "copy_note": "read + write bytes / time",
            "read_bw_Bps": ctx.bandwidth["read"], "read_note": "max-reduction, bytes / time",
            "copy_vs_nominal": ctx.bandwidth["copy"] / NOMINAL_BW,
            "dispatch_floor_s": floor["median_s"],
            "dispatch_note": "per-call time of a 16-element jitted add: calls faster than "
                             "about twice this are dispatch-bound",
            "matmul_n": m, "matmul_bf16_flops": flops,
            "matmul_vs_nominal": flops / NOMINAL_BF16_FLOPS}


# ---- kernel inputs ----------------------------------------------------------------------------

def context_lengths(batch: int, max_ctx: int, block: int, seed: int) -> list[int]:
    """Mixed lengths up to max_ctx: one full, edge cases (1, a block, a block + 1), the rest
    uniform. A batch of one gets max_ctx - 3 (a long context ending inside a page)."""
    import numpy as np
    if batch == 1:
        return [max_ctx - 3]
    lens = np.random.default_rng(seed).integers(1, max_ctx + 1, size=batch)
    lens[0] = max_ctx
    for i, v in zip(range(1, batch), (1, block, block + 1)):
        lens[i] = v
    return [int(v) for v in lens]


def attention_case(ctx: Ctx, model: str, block: int, batch: int) -> dict:
    """The kernel tests' NaN-filled case (pallas_kernels/cases.py) at GPU size, bf16, with L
    layers, all live, chosen so the cycled layers exceed 2x L2 (timed reads then come from
    HBM)."""
    import numpy as np
    from pallas_kernels.cases import paged_case
    key = (model, block, batch)
    if key in ctx.cases:
        return ctx.cases[key]
    kh, g, dh = ATTN_HEADS[model]
    lens = context_lengths(batch, ctx.prof.max_context, block, seed=block * 1000 + batch)
    pages = [-(-n // block) for n in lens]
    per_layer = sum(pages) * block * kh * dh * 2 * 2  # K + V pages, bf16
    layers = int(min(ctx.prof.max_layers, max(2, math.ceil(2 * L2_BYTES / per_layer))))
    q, k, v, table, context_lens = paged_case(
        zlib.crc32(repr(key).encode()), dtype="bfloat16", block_size=block, num_kv_heads=kh,
        group=g, head_dim=dh, lens=lens, num_pages=max(pages), num_layers=layers)
    case = {"q": q, "k": k, "v": v, "page_table": table, "context_lens": context_lens,
            "layers": layers, "bytes_per_call": per_layer,
            "desc": {"model": model, "kv_heads": kh, "group": g, "head_dim": dh,
                     "block_size": block, "batch": batch, "max_len": max(lens),
                     "mean_len": float(np.mean(lens)), "pages": max(pages),
                     "cache_shape": list(k.shape)}}
    ctx.cases[key] = case
    return case


def ragged_rows(max_ctx: int, decode: int, block: int) -> list[tuple[int, int]]:
    """`decode` rows of 1 query (lengths as context_lengths), 4 speculative rows of 4, a later
    prefill chunk of max_ctx / 8 at context max_ctx / 2, a first chunk of max_ctx / 16 and a
    padding row: (q_len, context_len) each."""
    rows = [(1, n) for n in context_lengths(decode, max_ctx, block, seed=decode)]
    rows += [(4, max_ctx // 4 + i) for i in range(4)]
    return rows + [(max_ctx // 8, max_ctx // 2), (max_ctx // 16, max_ctx // 16), (0, 0)]


def ragged_step_case(ctx: Ctx, model: str, block: int, max_ctx: int, decode: int,
                     dtype: str = "bfloat16", cache_gib: float = 0.0) -> dict:
    """One mixed engine step (`ragged_rows`, a padded tail) on the kernel tests' NaN-filled
    ragged case; layers cycled to exceed 2x L2 as attention_case does. cache_gib > 0: two
    layers and spare blocks until each of K and V exceeds that many GiB (not cached in ctx)."""
    import jax.numpy as jnp
    from pallas_kernels.cases import ragged_case
    key = ("ragged", model, block, max_ctx, decode, dtype, cache_gib)
    if key in ctx.cases:
        return ctx.cases[key]
    kh, g, dh = ATTN_HEADS[model]
    rows = ragged_rows(max_ctx, decode, block)
    pages = [-(-c // block) for _, c in rows]
    block_bytes = block * kh * dh * jnp.dtype(dtype).itemsize  # one layer's K (or V) block
    per_layer = sum(pages) * block_bytes * 2  # K + V pages, each read once
    layers = int(min(ctx.prof.max_layers, max(2, math.ceil(2 * L2_BYTES / per_layer))))
    spare = 5
    if cache_gib:
        layers = 2
        spare = max(5, math.ceil(cache_gib * 2**30 / (layers * block_bytes)) - sum(pages))
    q, k, v, table, qs, lens = ragged_case(
        zlib.crc32(repr(key).encode()), dtype=dtype, block_size=block, num_kv_heads=kh,
        group=g, head_dim=dh, rows=rows, num_pages=max(pages), tail=5, num_layers=layers,
        num_spare=spare)
    case = {"args": (q, k, v, table, qs, lens), "layers": layers, "bytes_per_call": per_layer,
            "desc": {"model": model, "kv_heads": kh, "group": g, "head_dim": dh,
                     "block_size": block, "rows": len(rows), "tokens": int(q.shape[0]),
                     "max_len": max_ctx, "pages": max(pages), "cache_shape": list(k.shape),
                     "dtype": dtype, "cache_bytes": int(k.nbytes)}}
    if not cache_gib:
        ctx.cases[key] = case
    return case


def int4_weights(ctx: Ctx, k: int, n: int) -> dict:
    """The kernel tests' random codes with per-group scales and offsets (asymmetric, the
    engine's RTN format), in as many copies as make > 2x L2, plus bf16 dense copies for the
    dense baseline. Shared by every M of a (K, N)."""
    import jax
    import jax.numpy as jnp
    from pallas_kernels.cases import int4_group_size
    from pallas_kernels.cases import int4_weights as case_weights
    key = ("int4", k, n)
    if key in ctx.cases:
        return ctx.cases[key]
    g = int4_group_size(k)
    wbytes = k * n // 2 + 2 * (k // g) * n * 4
    copies = int(min(ctx.prof.max_copies, max(1, math.ceil(2 * L2_BYTES / wbytes))))
    dense_copies = int(min(ctx.prof.max_copies, max(1, math.ceil(2 * L2_BYTES / (2 * k * n)))))
    weights = [case_weights(k, n, g, symmetric=False, seed=i) for i in range(copies)]
    keys = jax.random.split(jax.random.key(k * 7 + n), dense_copies)
    dense = [jax.random.normal(keys[i], (k, n), jnp.bfloat16) * 0.02
             for i in range(dense_copies)]
    ctx.cases[key] = {"weights": weights, "dense": dense, "group_size": g,
                      "bytes_per_call": wbytes, "copies": copies}
    return ctx.cases[key]


def int4_case(ctx: Ctx, model: str, k: int, n: int, m: int) -> dict:
    """The (K, N) weights with bf16 activations x [M, K]."""
    import jax
    import jax.numpy as jnp
    w = int4_weights(ctx, k, n)
    x = jax.random.normal(jax.random.key(m * 31 + k), (m, k), jnp.bfloat16)
    return {**w, "x": x, "desc": {"model": model, "K": k, "N": n, "M": m,
                                  "group_size": w["group_size"], "copies": w["copies"]}}


# ---- section: kernel correctness ---------------------------------------------------------------

def check_attention(ctx: Ctx, model: str, block: int, batch: int) -> dict:
    import jax.numpy as jnp
    import numpy as np
    from pallas_kernels.paged_attention import paged_attention, paged_attention_reference
    c = attention_case(ctx, model, block, batch)
    layer = jnp.int32(c["layers"] - 1)
    args = (c["q"], c["k"], c["v"], layer, c["page_table"], c["context_lens"])
    out = np.asarray(paged_attention(*args, interpret=ctx.prof.interpret), np.float32)
    ref = np.asarray(paged_attention_reference(*args), np.float32)
    tol = ATTENTION_TOLERANCE["bfloat16"]
    err = np.abs(out - ref)
    finite = bool(np.isfinite(out).all())
    ok = finite and bool(np.all(err <= tol["atol"] + tol["rtol"] * np.abs(ref)))
    return {**c["desc"], "dtype": "bfloat16", "finite": finite,
            "max_abs_err": float(np.nanmax(err)) if finite else float("nan"),
            "max_rel_err": float(np.nanmax(err / np.maximum(np.abs(ref), tol["atol"]))),
            "max_abs_ref": float(np.max(np.abs(ref))), "tolerance": tol, "within_tol": ok}


def check_ragged(ctx: Ctx, model: str, block: int, max_ctx: int, decode: int,
                 dtype: str = "bfloat16", cache_gib: float = 0.0) -> dict:
    """The kernel vs its reference on one step; cache_gib > 0 builds a cache over that size
    (Pallas indexes it with 64-bit offsets above 4 GiB) and frees it afterwards."""
    import jax.numpy as jnp
    import numpy as np
    from pallas_kernels.ragged_paged_attention import (ragged_paged_attention,
                                                       ragged_paged_attention_reference)
    c = ragged_step_case(ctx, model, block, max_ctx, decode, dtype, cache_gib)
    q, k, v, table, qs, lens = c["args"]
    args = (q, k, v, jnp.int32(c["layers"] - 1), table, qs, lens)
    out = np.asarray(ragged_paged_attention(*args, interpret=ctx.prof.interpret), np.float32)
    ref = np.asarray(ragged_paged_attention_reference(*args), np.float32)
    ragged_desc = c["desc"]
    del c, q, k, v, args
    tol = ATTENTION_TOLERANCE[dtype]
    err = np.abs(out - ref)
    finite = bool(np.isfinite(out).all())
    ok = finite and bool(np.all(err <= tol["atol"] + tol["rtol"] * np.abs(ref)))
    return {**ragged_desc, "dtype": dtype, "finite": finite,
            "max_abs_err": float(np.nanmax(err)) if finite else float("nan"),
            "max_rel_err": float(np.nanmax(err / np.maximum(np.abs(ref), tol["atol"]))),
            "max_abs_ref": float(np.max(np.abs(ref))), "tolerance": tol, "within_tol": ok}


def check_int4(ctx: Ctx, model: str, k: int, n: int, m: int) -> dict:
    import jax.numpy as jnp
    import numpy as np
    from pallas_kernels.int4_matmul import int4_matmul, int4_matmul_reference
    from pallas_kernels.cases import int4_error_bound
    c = int4_case(ctx, model, k, n, m)
    packed, scales, offsets = c["weights"][0]
    g = c["group_size"]
    y = np.asarray(int4_matmul(c["x"], packed, scales, offsets, group_size=g,
                               interpret=ctx.prof.interpret).astype(jnp.float32))
    ref = np.asarray(int4_matmul_reference(c["x"].astype(jnp.float32), packed, scales, offsets,
                                           group_size=g))
    tol = INT4_TOLERANCE["bfloat16"]
    scale = float(np.max(np.abs(ref)))
    err = np.abs(y - ref)
    finite = bool(np.isfinite(y).all())
    ok = finite and bool(np.all(err < int4_error_bound(ref, jnp.bfloat16)))
    return {**c["desc"], "dtype": "bfloat16", "finite": finite,
            "max_abs_err": float(err.max()), "max_rel_err": float(err.max() / scale),
            "rel_err_note": "normalised by max|reference|", "tolerance": tol, "within_tol": ok}


def run_cases(ctx: Ctx, keys, fn, what: str) -> tuple[list, list]:
    """Runs fn(ctx, *key) per key; one failing case is recorded, the rest still run."""
    rows, skipped = [], []
    for key in keys:
        if ctx.over_budget():
            skipped.append(list(key))
            continue
        try:
            rows.append(fn(ctx, *key))
        except Exception as e:  # noqa: BLE001 - recorded per case
            rows.append({"case": list(key), "error": f"{type(e).__name__}: {e}",
                         "traceback": traceback.format_exc()[-2000:]})
        ctx.log(f"{what} {key}: {summarise_row(rows[-1])}")
    return rows, skipped


def summarise_row(row: dict) -> str:
    if "error" in row:
        return "ERROR " + row["error"][:200]
    if "within_tol" in row:
        return f"max_abs_err={row['max_abs_err']:.3g} ok={row['within_tol']}"
    return f"kernel {row['kernel']['median_s'] * 1e6:.1f} us"


def section_kernel_correctness(ctx: Ctx) -> dict:
    attn, s1 = run_cases(ctx, ctx.prof.attn_cases, check_attention, "attention")
    int4, s2 = run_cases(ctx, ctx.prof.int4_cases, check_int4, "int4")
    ragged, s3 = run_cases(ctx, ctx.prof.ragged_cases, check_ragged, "ragged attention")
    # An f32 step (the kernel's other dtype) and a cache over 4 GiB (64-bit offsets).
    extra, s4 = run_cases(ctx, ctx.prof.ragged_extra_cases, check_ragged, "ragged extra")
    gc.collect()
    rows = attn + int4 + ragged + extra
    bad = [r for r in rows if "error" in r or not r.get("within_tol")]
    res = {"paged_attention": attn, "int4_matmul": int4, "ragged_attention": ragged,
           "ragged_extra": extra, "num_cases": len(rows), "num_bad": len(bad)}
    s3 = s3 + s4
    if s1 or s2 or s3:
        res["skipped_cases"] = s1 + s2 + s3
    if bad:
        res["_status"] = "failed"
    elif s1 or s2 or s3:
        res["_status"], res["_reason"] = "partial", "time budget exceeded"
    return res


# ---- section: kernel timings -------------------------------------------------------------------

def xla_step_inputs(page_table, context_lens, block_size: int, query_start=None,
                    num_tokens: int | None = None):
    """The kernel case's rows laid out as the engine lays out a step for its XLA attention
    (step_layout.build with ragged=True: multi-query rows aligned to QUERY_CHUNK, decodes
    packed, the (query, block) pair list and each chunk's pages), over the same pages.

    page_table [R, P], context_lens [R]; query_start [R + 1] and num_tokens (N) for a ragged
    case (packed rows), None for a decode case (one query per row). Rows of no query or no
    context, and tokens of no row, go to idle flat tokens. Returns (PagedMeta as the runner builds it, flat_index
    [N] int32: the flat token each case token is at, pairs in use).
    """
    import jax.numpy as jnp
    import numpy as np
    from jaxserve.runtime import buckets, step_layout
    from jaxserve.runtime.kv_cache import PagedMeta
    table, lens = np.asarray(page_table), np.asarray(context_lens)
    qs = np.arange(len(lens) + 1) if query_start is None else np.asarray(query_start)
    n_tokens = num_tokens or int(qs[-1])
    live = [r for r in range(len(lens)) if qs[r + 1] > qs[r] and lens[r] > 0]
    rows = [step_layout.Row(slot=r, start=int(lens[r] - qs[r + 1] + qs[r]),
                            tokens=[0] * int(qs[r + 1] - qs[r]), samples=True) for r in live]
    idle = np.zeros((1, table.shape[1]), table.dtype)  # the idle slot's row: the null block
    slots = np.concatenate([table, idle])  # [R + 1, P]
    owned = sum(len(row.tokens) for row in rows)
    need = step_layout.flat_tokens_needed([len(row.tokens) for row in rows]) + n_tokens - owned
    tokens = buckets.pick(step_layout.token_buckets(next_pow2(need), max(len(rows), 1)), need)
    lay = step_layout.build(rows, slots, tokens=tokens, max_num_seqs=max(len(rows), 1),
                            block_size=block_size, idle_slot=len(lens), ragged=True)
    flat = np.full((n_tokens,), -1, np.int64)
    for i, r in enumerate(live):
        at = lay.query_start[lay.row_index[i]]
        flat[qs[r]:qs[r + 1]] = np.arange(at, at + qs[r + 1] - qs[r])
    orphans = np.flatnonzero(flat < 0)
    flat[orphans] = lay.query_start[-1] + np.arange(orphans.size)
    r_ = lay.context_lens.shape[0]
    meta = PagedMeta(positions=jnp.asarray(lay.positions[None]),
                     slots=jnp.asarray(lay.write_slots[None]),
                     query_start=jnp.asarray(lay.query_start),
                     context_lens=jnp.asarray(lay.context_lens),
                     page_table=jnp.zeros((r_, 1), jnp.int32), pairs=jnp.asarray(lay.pairs),
                     num_pairs=jnp.asarray(lay.num_pairs), multi=jnp.asarray(lay.multi),
                     chunk_pages=jnp.asarray(lay.chunk_pages))
    return meta, jnp.asarray(flat, jnp.int32), int(lay.num_pairs)


def xla_engine_attention():
    """The engine's XLA attention (jaxserve/runtime/attention.py `ragged_attention_xla`, what
    the XlaAttention backend runs) on the kernel's inputs, less its KV write (the kernel does
    not write either, and a write into a cache that is not donated would copy all of it).
    Returns fn(q, k, v, layer, meta, flat_index) -> the case's tokens' outputs `[N, H, Dh]`;
    tests/test_gpu_check.py checks it against ragged_attention_xla itself."""
    import jax
    import jax.numpy as jnp
    from jaxserve.runtime import attention
    from jaxserve.runtime.kv_cache import KVCache
    from jaxserve.runtime.step_layout import QUERY_CHUNK

    @jax.jit
    def fn(q, k_cache, v_cache, layer, meta, flat_index):
        cache = KVCache(k=k_cache, v=v_cache)
        qf = jnp.zeros((meta.positions.shape[1],) + q.shape[1:], q.dtype)  # [T, H, Dh]
        qf = qf.at[flat_index].set(q)
        logits = attention._Logits(None, None, None)  # no window, soft-cap or query scale
        out = attention._single_query_attention(qf, cache, layer, meta, True, logits)
        if qf.shape[0] >= QUERY_CHUNK:  # as ragged_attention_xla: no multi rows below
            chunked = attention._chunked_attention(qf, cache, layer, meta, logits)
            out = jnp.where(meta.multi[:, None, None], chunked, out)
        return out[flat_index].astype(q.dtype)  # [N, H, Dh]
    return fn


def rates(ctx: Ctx, seconds: float, nbytes: int, flops: int | None = None) -> dict:
    out = {"median_s": seconds, "bytes_per_s": nbytes / seconds,
           "vs_nominal_bw": nbytes / seconds / NOMINAL_BW}
    for kind in ("copy", "read"):
        if ctx.bandwidth.get(kind):
            out[f"vs_measured_{kind}_bw"] = nbytes / seconds / ctx.bandwidth[kind]
    if flops:
        out["flops_per_s"] = flops / seconds
        out["vs_nominal_bf16_flops"] = flops / seconds / NOMINAL_BF16_FLOPS
    return out


def time_attention(ctx: Ctx, model: str, block: int, batch: int) -> dict:
    import jax
    import jax.numpy as jnp
    from pallas_kernels.paged_attention import paged_attention, paged_attention_reference
    c = attention_case(ctx, model, block, batch)
    p = ctx.prof
    sets = [(c["q"], c["k"], c["v"], jnp.int32(i), c["page_table"], c["context_lens"])
            for i in range(c["layers"])]
    meta, flat, in_use = xla_step_inputs(c["page_table"], c["context_lens"], block)
    xla_sets = [(c["q"], c["k"], c["v"], jnp.int32(i), meta, flat) for i in range(c["layers"])]

    def kernel(*a):
        return paged_attention(*a, interpret=p.interpret)

    impls = {"kernel": (kernel, sets), "xla_engine_path": (xla_engine_attention(), xla_sets),
             "reference_f32": (jax.jit(paged_attention_reference), sets)}
    row = {**c["desc"], "bytes_per_call": c["bytes_per_call"], "layers_cycled": c["layers"],
           "xla_pairs": in_use, "xla_pair_capacity": int(meta.pairs.shape[1]),
           "xla_flat_tokens": int(meta.positions.shape[1])}
    for name, (fn, args) in impls.items():
        t = time_calls(fn, args, p.iters, p.reps)
        row[name] = {**rates(ctx, t["median_s"], c["bytes_per_call"]),
                     "first_call_s": t["first_call_s"]}
    for name in ("xla_engine_path", "reference_f32"):
        row[f"kernel_over_{name}"] = row["kernel"]["median_s"] / row[name]["median_s"]
    return row


def time_ragged(ctx: Ctx, model: str, block: int, max_ctx: int, decode: int) -> dict:
    """The kernel against the engine's XLA path on the same rows and pages (laid out as the
    engine lays out a step for it) and the jitted f32 reference; bytes = each visible page
    read once."""
    import jax
    import jax.numpy as jnp
    from pallas_kernels.ragged_paged_attention import (ragged_paged_attention,
                                                       ragged_paged_attention_reference)
    c = ragged_step_case(ctx, model, block, max_ctx, decode)
    q, k, v, table, qs, lens = c["args"]
    sets = [(q, k, v, jnp.int32(i), table, qs, lens) for i in range(c["layers"])]
    meta, flat, in_use = xla_step_inputs(table, lens, block, qs, q.shape[0])
    xla_sets = [(q, k, v, jnp.int32(i), meta, flat) for i in range(c["layers"])]

    def kernel(*a):
        return ragged_paged_attention(*a, interpret=ctx.prof.interpret)

    row = {**c["desc"], "bytes_per_call": c["bytes_per_call"], "layers_cycled": c["layers"],
           "xla_pairs": in_use, "xla_flat_tokens": int(meta.positions.shape[1])}
    impls = {"kernel": (kernel, sets), "xla_engine_path": (xla_engine_attention(), xla_sets),
             "reference_f32": (jax.jit(ragged_paged_attention_reference), sets)}
    for name, (fn, args) in impls.items():
        t = time_calls(fn, args, ctx.prof.iters, ctx.prof.reps)
        row[name] = {**rates(ctx, t["median_s"], c["bytes_per_call"]),
                     "first_call_s": t["first_call_s"]}
    for name in ("xla_engine_path", "reference_f32"):
        row[f"kernel_over_{name}"] = row["kernel"]["median_s"] / row[name]["median_s"]
    return row


def time_int4(ctx: Ctx, model: str, k: int, n: int, m: int) -> dict:
    import jax
    import jax.numpy as jnp
    from pallas_kernels.int4_matmul import int4_matmul, int4_matmul_reference, pick_blocks
    c = int4_case(ctx, model, k, n, m)
    p, g, x = ctx.prof, c["group_size"], c["x"]
    sets = [(x, *w) for w in c["weights"]]
    flops = 2 * m * k * n

    def kernel(*a):
        return int4_matmul(*a, group_size=g, interpret=p.interpret)

    row = {**c["desc"], "bytes_per_call": c["bytes_per_call"],
           "blocks_mnk_split": list(pick_blocks(m, k, n, g))}
    xla = jax.jit(lambda *a: int4_matmul_reference(*a, group_size=g))
    for name, fn, args in (("kernel", kernel, sets), ("xla_engine_path", xla, sets)):
        t = time_calls(fn, args, p.iters, p.reps)
        row[name] = {**rates(ctx, t["median_s"], c["bytes_per_call"], flops),
                     "first_call_s": t["first_call_s"]}
    dense = jax.jit(lambda a, w: jnp.dot(a, w, preferred_element_type=jnp.float32)
                    .astype(a.dtype))
    t = time_calls(dense, [(x, w) for w in c["dense"]], p.iters, p.reps)
    row["dense_bf16_xla"] = rates(ctx, t["median_s"], 2 * k * n, flops)
    row["kernel_over_xla_engine_path"] = row["kernel"]["median_s"] / \
        row["xla_engine_path"]["median_s"]
    row["kernel_over_dense_bf16"] = row["kernel"]["median_s"] / row["dense_bf16_xla"]["median_s"]
    return row


def section_kernel_timings(ctx: Ctx) -> dict:
    try:
        attn, s1 = run_cases(ctx, ctx.prof.attn_cases, time_attention, "attention timing")
        int4, s2 = run_cases(ctx, ctx.prof.int4_cases, time_int4, "int4 timing")
        ragged, s3 = run_cases(ctx, ctx.prof.ragged_cases, time_ragged, "ragged timing")
    finally:
        ctx.cases.clear()
        gc.collect()
    s2 += s3
    res = {"paged_attention": attn, "int4_matmul": int4, "ragged_attention": ragged,
           "method": f"median of {ctx.prof.reps} samples of {ctx.prof.iters} back-to-back "
                     "calls (inputs cycled to exceed L2), one block_until_ready per sample; "
                     "bytes = K+V pages read (attention), packed + scales + offsets (int4)"}
    if any("error" in r for r in attn + int4 + ragged):
        res["_status"] = "failed"
    elif s1 or s2:
        res.update(_status="partial", _reason="time budget exceeded", skipped_cases=s1 + s2)
    return res


# ---- end-to-end decode on the engine -----------------------------------------------------------

def decode_run(engine, batch: int, prompt_len: int, new_tokens: int, seed: int) -> dict:
    """Fixed-length prompts, EOS ignored, greedy. Decode time runs from the step in which the
    last request got its first token to the end, so prefill is excluded."""
    import numpy as np
    from jaxserve import SamplingParams
    vocab = engine.model.config.vocab_size
    prompts = np.random.default_rng(seed).integers(TOKEN_LOW, min(vocab, 40000),
                                                   size=(batch, prompt_len))
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    compiled = engine.runner.num_compiled
    t0 = time.perf_counter()
    for p in prompts:
        engine.add_request(engine.next_request_id(), p.tolist(), params)
    counts, t_dec, base, steps, now = {}, None, 0, 0, t0
    stats = []  # the engine's StepStats of each decode step
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            counts[o.request_id] = len(o.outputs[0].token_ids)
        if t_dec is None:
            if len(counts) == batch:
                t_dec, base = now, sum(counts.values())
        else:
            steps += 1
            if engine.last_step is not None:
                stats.append(engine.last_step)
    total = sum(counts.values())
    dec_s = now - t_dec if t_dec is not None else float("nan")
    return {"batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens,
            "generated": total, "all_lengths_ok": all(v == new_tokens for v in counts.values()),
            "wall_s": now - t0, "overall_tok_s": total / (now - t0),
            "decode_steps": steps, "decode_s": dec_s,
            "decode_tok_s": (total - base) / dec_s if steps else float("nan"),
            "decode_steps_per_s": steps / dec_s if steps else float("nan"),
            "compiles_during_run": engine.runner.num_compiled - compiled,
            "step_breakdown": step_breakdown(stats)}


def step_breakdown(stats) -> dict:
    """Median seconds per decode step from the engine's own step statistics
    (jaxserve/telemetry/step_stats.py): host work (schedule, launch, postprocess) against the
    time blocked on the device (wait), and the host's share of the step."""
    if not stats:
        return {"steps": 0}
    med = {name: statistics.median(getattr(st, name) for st in stats)
           for name in ("schedule_s", "device_s", "wait_s", "postprocess_s")}
    total = statistics.median(st.total_s for st in stats)
    host = statistics.median(st.total_s - st.wait_s for st in stats)
    return {"steps": len(stats), **{f"median_{k}": v for k, v in med.items()},
            "median_launch_s": statistics.median(st.device_s - st.wait_s for st in stats),
            "median_host_s": host, "median_total_s": total,
            "host_fraction": host / total if total > 0 else float("nan"),
            "median_h2d_bytes": statistics.median(st.h2d_bytes for st in stats)}


def weight_bytes_per_step(model) -> int:
    """Bytes of weights one decode step reads: all params, less the embedding table when the LM
    head is separate (only a few embedding rows are gathered)."""
    import jax
    total = sum(leaf.nbytes for leaf in jax.tree.leaves(model.params))
    if not model.config.tie_word_embeddings:
        total -= model.params["embedding"].nbytes
    return int(total)


def ensure_params_on_device(engine) -> str | None:
    """The engine's int4 quantization may leave numpy (host) arrays in the params, which jit
    would re-send every step; move them to the device so the kernel path is what is timed."""
    import jax
    import numpy as np
    if not any(isinstance(x, np.ndarray) for x in jax.tree.leaves(engine.model.params)):
        return None
    model = dataclasses.replace(engine.model, params=jax.device_put(engine.model.params))
    engine.model = engine.runner.model = model
    return ("engine left quantized params as host numpy arrays (jit would copy them to the "
            "device every step); moved to the device by gpu_check")


def build_llm(ctx: Ctx, model, quantization):
    """An engine sized for the benchmark: a token budget that admits every prompt in the first
    step (so decode runs at one batch bucket and only a few programs compile), a KV cache for
    max_num_seqs full-length sequences, and no warm-up (the first run compiles what it uses)."""
    from jaxserve import LLM
    p = ctx.prof
    seqs = max(p.e2e_batches)
    pages = seqs * -(-p.max_model_len // p.block_size) + 2
    kv = pages * p.block_size * model.config.kv_bytes_per_token(2 if model.dtype == "bfloat16"
                                                                  else 4)
    t0 = time.perf_counter()
    llm = LLM(model, attention_backend=p.backend, linear_backend=p.backend,
              quantization=quantization, max_num_seqs=seqs, max_model_len=p.max_model_len,
              max_num_batched_tokens=next_pow2(max(512, seqs * (p.prompt_len + 1))),
              kv_cache_memory=int(kv), block_size=p.block_size, warmup=False)
    note = ensure_params_on_device(llm.engine)
    return llm, time.perf_counter() - t0, note


def bench_variant(ctx: Ctx, model, quantization) -> dict:
    """One engine (bf16 or int4) at every batch size: a warm-up run compiles, a second is timed."""
    p = ctx.prof
    llm, build_s, note = build_llm(ctx, model, quantization)
    wbytes = weight_bytes_per_step(llm.engine.model)
    res = {"quantization": quantization or "none (bf16)", "construct_s": build_s,
           "weight_bytes_per_step": wbytes, "runs": []}
    if note:
        res["note"] = note
    kv_tok = model.config.kv_bytes_per_token(2)
    for batch in p.e2e_batches:
        if ctx.over_budget():
            res["runs"].append({"batch": batch, "skipped": "time budget exceeded"})
            continue
        warm = decode_run(llm.engine, batch, p.prompt_len, p.new_tokens, seed=batch)
        run = decode_run(llm.engine, batch, p.prompt_len, p.new_tokens, seed=batch + 1)
        if run["compiles_during_run"]:  # e.g. a config registered lazily during the warm-up
            again = decode_run(llm.engine, batch, p.prompt_len, p.new_tokens, seed=batch + 2)
            again["compiles_in_discarded_run"] = run["compiles_during_run"]
            run = again
        run["warmup_wall_s"] = warm["wall_s"]
        sps = run["decode_steps_per_s"]
        kv_step = batch * (p.prompt_len + p.new_tokens / 2) * kv_tok
        for kind, bw in (("nominal", NOMINAL_BW), ("measured_copy", ctx.bandwidth.get("copy")),
                         ("measured_read", ctx.bandwidth.get("read"))):
            if bw:
                run[f"mbu_weights_vs_{kind}"] = wbytes * sps / bw
                run[f"mbu_weights_kv_vs_{kind}"] = (wbytes + kv_step) * sps / bw
        res["runs"].append(run)
        ctx.log(f"  {quantization or 'bf16'} batch {batch}: {run['decode_tok_s']:.1f} decode "
                f"tok/s, {sps:.1f} steps/s")
    del llm
    gc.collect()
    return res


def bench_model(ctx: Ctx, name: str, model, source: str) -> dict:
    res = {"model": name, "source": source, "config": model.config.to_dict(),
           "num_params": model.config.num_params(), "backend": ctx.prof.backend,
           "block_size": ctx.prof.block_size, "max_model_len": ctx.prof.max_model_len,
           "variants": []}
    for quant in ctx.prof.e2e_variants:
        if ctx.remaining() < ctx.prof.variant_min_s:
            res["variants"].append({"quantization": quant, "skipped": "time budget exceeded"})
            continue
        try:
            res["variants"].append(bench_variant(ctx, model, quant))
        except Exception as e:  # noqa: BLE001 - the other variant still runs
            res["variants"].append({"quantization": quant, "error": f"{type(e).__name__}: {e}",
                                    "traceback": traceback.format_exc()[-2000:]})
            res["_status"] = "error"
        gc.collect()
    ctx.engine_results[name] = res
    return res


def section_e2e_llama3_8b(ctx: Ctx) -> dict:
    from models.random_init import random_model
    t0 = time.perf_counter()
    model = random_model(model_configs(ctx.args.dry_run)["llama3_8b"], "bfloat16")
    init_s = time.perf_counter() - t0
    res = bench_model(ctx, "llama3_8b", model, "random weights (models.random_init)")
    res["init_s"] = init_s
    return res


def load_smollm2(ctx: Ctx):
    """(model, source): the GGUF when given and loadable, else random SmolLM2-shaped weights."""
    from models.random_init import random_model
    path = ctx.args.gguf
    why = None
    if not path:
        why = "no --gguf given"
    elif not pathlib.Path(path).is_file():
        why = f"--gguf {path} does not exist here"
    else:
        why = importable("gguf")
        if why is None:
            from models import load_model
            try:
                return load_model(path, "bfloat16", compilation_cache=False), f"gguf {path}"
            except Exception as e:  # noqa: BLE001 - fall back to random weights
                why = f"loading {path} failed: {type(e).__name__}: {e}"
        else:
            why = f"gguf package not importable ({why})"
    cfg = model_configs(ctx.args.dry_run)["smollm2"]
    return random_model(cfg, "bfloat16"), f"random weights, SmolLM2 config ({why})"


def section_e2e_smollm2(ctx: Ctx) -> dict:
    model, source = load_smollm2(ctx)
    return bench_model(ctx, "smollm2", model, source)


# ---- plain LLM() -------------------------------------------------------------------------------

def default_dtype() -> str:
    """The engine's default weight dtype when it names one; else what the GPU defaults should be
    (bf16 on a GPU, f32 on CPU) for the random model, which needs a concrete dtype."""
    import jax
    from jaxserve.config import EngineConfig
    default = EngineConfig.__dataclass_fields__["dtype"].default
    if default in ("float32", "bfloat16", "float16"):
        return default
    return "bfloat16" if jax.default_backend() == "gpu" else "float32"


def section_llm_defaults(ctx: Ctx) -> dict:
    """A short greedy run of `LLM(model)` with every engine setting at its default (backends,
    KV cache size, buckets, warm-up): what a user gets on this machine. The GGUF by path when
    given (all defaults, dtype included), else random SmolLM2 weights in the default dtype.
    The dry run turns the warm-up off: on CPU compiling every bucket would dominate it."""
    from jaxserve import LLM, SamplingParams
    from models.random_init import random_model
    import numpy as np
    p = ctx.prof
    path = ctx.args.gguf
    overrides = {"warmup": False} if ctx.args.dry_run else {}
    t0 = time.perf_counter()
    if path and pathlib.Path(path).is_file() and importable("gguf") is None:
        llm, source = LLM(path, **overrides), f"gguf {path}"
    else:
        dtype = default_dtype()
        cfg = model_configs(ctx.args.dry_run)["smollm2"]
        llm = LLM(random_model(cfg, dtype), **overrides)
        source = f"random weights, SmolLM2 config, {dtype}"
    construct_s = time.perf_counter() - t0
    t0 = time.perf_counter()  # the structured-output variants compile after warm-up
    warm = llm.engine.wait_until_warm(timeout=max(1.0, ctx.deadline - time.monotonic()))
    masked_s = time.perf_counter() - t0
    vocab = llm.engine.model.config.vocab_size
    prompts = np.random.default_rng(7).integers(TOKEN_LOW, min(vocab, 40000),
                                                size=(p.defaults_prompts, p.prompt_len))
    params = SamplingParams(temperature=0.0, max_tokens=p.new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([row.tolist() for row in prompts], params, use_tqdm=False)
    generate_s = time.perf_counter() - t0
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    stats = llm.stats()
    totals = {k: v for k, v in stats["step_totals"].items() if k != "histograms"}
    cfg = llm.engine.config
    res = {"source": source, "overrides": overrides, "construct_s": construct_s,
           "masked_variants_s": masked_s, "masked_variants_ready": warm,
           "generate_s": generate_s,
           "prompts": p.defaults_prompts, "generated": generated,
           "all_lengths_ok": generated == p.defaults_prompts * p.new_tokens,
           "tok_s": generated / generate_s,
           "config": {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)},
           "model_dtype": str(llm.engine.model.dtype), "step_totals": totals,
           "kv_memory": stats.get("kv_memory"),
           "num_compiles_after_warmup": stats.get("num_compiles_after_warmup")}
    del llm
    gc.collect()
    return res


# ---- HF transformers peer ----------------------------------------------------------------------

def hf_model(ctx: Ctx, torch, device):
    """SmolLM2 in HF: from the GGUF (needs the gguf package) or random weights, same config."""
    import transformers
    path = ctx.args.gguf
    if path and pathlib.Path(path).is_file() and importable("gguf") is None:
        p = pathlib.Path(path)
        m = transformers.AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name)
        return m.to(device=device, dtype=torch.bfloat16).eval(), f"gguf {path}"
    c = model_configs(ctx.args.dry_run)["smollm2"]
    hc = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings)
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(hc).to(device=device, dtype=torch.bfloat16).eval()
    why = "no --gguf given" if not path else "GGUF or the gguf package unavailable"
    return m, f"random weights, SmolLM2 config ({why})"


def hf_decode(torch, model, device, batch: int, prompt_len: int, new_tokens: int) -> dict:
    """Greedy generate of exactly new_tokens per row; decode time starts at the first logits."""
    import numpy as np
    from transformers import LogitsProcessor, LogitsProcessorList
    first = []

    class Timer(LogitsProcessor):
        def __call__(self, input_ids, scores):
            if not first:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                first.append(time.perf_counter())
            return scores

    ids = np.random.default_rng(batch).integers(TOKEN_LOW, min(model.config.vocab_size, 40000),
                                                size=(batch, prompt_len))
    ids = torch.tensor(ids, device=device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             do_sample=False, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, pad_token_id=0,
                             logits_processor=LogitsProcessorList([Timer()]))
    if device.type == "cuda":
        torch.cuda.synchronize()
    end = time.perf_counter()
    got = out.shape[1] - prompt_len
    return {"batch": batch, "prompt_len": prompt_len, "new_tokens": got, "wall_s": end - t0,
            "overall_tok_s": batch * got / (end - t0),
            "decode_tok_s": batch * (got - 1) / (end - first[0]) if got > 1 else float("nan")}


def section_hf_peer(ctx: Ctx) -> dict:
    for mod in ("torch", "transformers"):
        why = importable(mod)
        if why:
            return {"_status": "skipped", "_reason": f"{mod} not importable here ({why})"}
    import torch
    if not ctx.args.dry_run and not torch.cuda.is_available():
        return {"_status": "skipped", "_reason": "torch sees no CUDA device"}
    device = torch.device("cuda" if torch.cuda.is_available() and not ctx.args.dry_run
                          else "cpu")
    model, source = hf_model(ctx, torch, device)
    p = ctx.prof
    res = {"source": source, "device": str(device), "torch": torch.__version__,
           "transformers": importlib.metadata.version("transformers"), "dtype": "bfloat16",
           "runs": []}
    for batch in p.e2e_batches:
        if ctx.over_budget():
            res["runs"].append({"batch": batch, "skipped": "time budget exceeded"})
            continue
        hf_decode(torch, model, device, batch, p.prompt_len, 4)  # warm-up
        res["runs"].append(hf_decode(torch, model, device, batch, p.prompt_len, p.new_tokens))
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res


# ---- the compiled step, as XLA dumped it --------------------------------------------------------

STEP_MODULE_RE = ".*_step_impl.*"  # the runner's jitted step (jaxserve/runtime/runner.py)
MAX_DUMP_FILE_BYTES = 8 << 20       # larger dump files (e.g. a big module's PTX) are dropped
DUMP_KEEP_SUFFIXES = (".txt", ".ptx")  # HLO, buffer assignment, thunk sequence, PTX; no objects
# The compiled-program reader of scripts/gpu_step_report.py plugs in here: ("module", "function")
# pairs tried in order, the function taking the dump directory and returning a JSON-able dict.
STEP_DUMP_READERS: tuple = (("jaxserve.tools.compiled_report", "summarise_dump"),)


def step_dump_dir(args) -> pathlib.Path:
    return pathlib.Path(args.out_dir) / "xla_dump_step"


def enable_step_dump(args) -> None:
    """Before jax starts: XLA dumps each compile of the engine's step (HLO before and after
    optimisation, and on a GPU the thunk sequence with every launch) under the out dir; no
    other module is dumped."""
    if args.no_step_dump:
        return
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = (f"{flags} --xla_dump_to={step_dump_dir(args)} "
                               f"--xla_dump_hlo_module_re={STEP_MODULE_RE}").strip()


def read_step_dump(path: pathlib.Path):
    """The first importable STEP_DUMP_READERS entry's summary of the dump, or None."""
    for module, function in STEP_DUMP_READERS:
        try:
            reader = getattr(importlib.import_module(module), function)
        except (ImportError, AttributeError):
            continue
        return {"reader": f"{module}.{function}", "summary": reader(path)}
    return None


def section_step_dump(ctx: Ctx) -> dict:
    """What XLA dumped of the steps the engine sections compiled: the files (oversized ones
    dropped so the out dir stays small) and, when available, the reader's summary."""
    d = step_dump_dir(ctx.args)
    if ctx.args.no_step_dump or not d.is_dir():
        return {"_status": "skipped", "_reason": "no dump (--no-step-dump, or no step compiled)"}
    removed = []
    for f in sorted(d.rglob("*")):
        if f.is_file() and (f.stat().st_size > MAX_DUMP_FILE_BYTES
                            or not f.name.endswith(DUMP_KEEP_SUFFIXES)):
            removed.append(f.name)
            f.unlink()
    for sub in sorted((x for x in d.rglob("*") if x.is_dir()), reverse=True):
        if not any(sub.iterdir()):  # emptied above (e.g. a module's object files)
            sub.rmdir()
    files = [f for f in d.rglob("*") if f.is_file()]
    modules = sorted({".".join(f.name.split(".")[:2]) for f in files
                      if f.name.startswith("module_")})
    res = {"dir": str(d), "files": len(files), "bytes": sum(f.stat().st_size for f in files),
           "modules": modules, "removed": len(removed), "removed_examples": removed[:10],
           "kept_suffixes": DUMP_KEEP_SUFFIXES, "max_file_bytes": MAX_DUMP_FILE_BYTES,
           "thunk_files": sorted(f.name for f in files if "thunk" in f.name)}
    try:
        res["reader"] = read_step_dump(d)
    except Exception as e:  # noqa: BLE001 - the files are there anyway
        res["reader"] = {"error": f"{type(e).__name__}: {e}"}
    return res


# ---- the kernel test suite, compiled -----------------------------------------------------------

# test_kv_int8.py: both attention kernels reading an int8 KV cache (codes + scales);
# test_grouped_matmul.py: the MoE experts' grouped matmul kernel.
KERNEL_TESTS = ("tests/test_paged_attention.py", "tests/test_ragged_paged_attention.py",
                "tests/test_int4_matmul.py", "tests/test_kv_int8.py",
                "tests/test_grouped_matmul.py")


def section_kernel_tests(ctx: Ctx) -> dict:
    """`pytest -m gpu` on the kernel tests: their `compiled` variants, on this GPU."""
    if ctx.args.dry_run:
        return {"_status": "skipped", "_reason": "dry run: the suite runs interpreted in the "
                                                 "CPU test tiers"}
    why = importable("pytest")
    if why:
        return {"_status": "skipped", "_reason": f"pytest not importable here ({why})"}
    budget = max(30.0, min(300.0, ctx.deadline - time.monotonic()))
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
           *KERNEL_TESTS]
    env = dict(os.environ, JAX_PLATFORMS="cuda")
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=budget)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return {"_status": "failed", "command": " ".join(cmd), "timeout_s": budget,
                "output_tail": out[-3000:]}
    lines = proc.stdout.strip().splitlines()
    res = {"command": " ".join(cmd), "returncode": proc.returncode,
           "summary": lines[-1] if lines else "", "seconds": time.monotonic() - t0,
           "output_tail": (proc.stdout + proc.stderr)[-3000:]}
    if proc.returncode != 0:
        res["_status"] = "failed"
    return res


# ---- report ------------------------------------------------------------------------------------

def fmt(v, spec=".3g") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else format(v, spec)
    return str(v)


def md_environment(r: dict) -> list[str]:
    mem = r.get("device_memory", {})
    return [f"- python {r['python']}, jax {r['jax']}, jaxlib {r['jaxlib']}, backend "
            f"{r['default_backend']}", f"- devices: {', '.join(r['devices'])}",
            f"- device memory limit: {fmt(mem.get('bytes_limit', 0) / 2**30)} GiB",
            f"- packages: {', '.join(f'{k} {v}' for k, v in r['packages'].items())}",
            f"- importable: {r['importable']}", f"- nvidia-smi: `{r['nvidia_smi']}`"]


def md_bandwidth(r: dict) -> list[str]:
    return [f"- copy bandwidth (read+write): {r['copy_bw_Bps'] / 1e12:.3f} TB/s "
            f"({r['copy_vs_nominal']:.2f} x nominal 4.3 TB/s)",
            f"- read bandwidth (max-reduction): {r['read_bw_Bps'] / 1e12:.3f} TB/s",
            f"- dispatch floor: {r['dispatch_floor_s'] * 1e6:.1f} us per jitted call",
            f"- bf16 matmul {r['matmul_n']}^3: {r['matmul_bf16_flops'] / 1e12:.1f} TFLOP/s "
            f"({r['matmul_vs_nominal']:.2f} x nominal 790)"]


def md_correctness(r: dict) -> list[str]:
    out = ["| kernel | case | max abs err | max rel err | ok |", "|---|---|---|---|---|"]
    for kind in ("paged_attention", "int4_matmul", "ragged_attention", "ragged_extra"):
        for row in r.get(kind, []):
            if "error" in row:
                out.append(f"| {kind} | {row['case']} | ERROR: {row['error'][:120]} | | no |")
                continue
            case = (f"{row['model']} bs{row['block_size']} B{row['batch']} "
                    f"maxlen {row['max_len']}" if kind == "paged_attention" else
                    f"{row['model']} bs{row['block_size']} R{row['rows']} T{row['tokens']} "
                    f"maxlen {row['max_len']}" if kind == "ragged_attention" else
                    f"{row['model']} bs{row['block_size']} R{row['rows']} {row['dtype']} "
                    f"cache {row['cache_bytes'] / 2**30:.2f} GiB" if kind == "ragged_extra" else
                    f"{row['model']} {row['K']}->{row['N']} M{row['M']} g{row['group_size']}")
            out.append(f"| {kind} | {case} | {fmt(row['max_abs_err'])} | "
                       f"{fmt(row['max_rel_err'])} | {'yes' if row['within_tol'] else 'NO'} |")
    return out


def md_timings(r: dict) -> list[str]:
    out = [f"{r.get('method', '')}", "",
           "| kernel | case | MB/call | kernel us | TB/s | x4.3 | x meas. copy | x meas. read | "
           "XLA us | kernel/XLA | extra |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for kind in ("paged_attention", "int4_matmul"):
        for row in r.get(kind, []):
            if "error" in row:
                out.append(f"| {kind} | {row['case']} | ERROR: {row['error'][:120]} ||||||||")
                continue
            k, x = row["kernel"], row["xla_engine_path"]
            if kind == "paged_attention":
                case = f"{row['model']} bs{row['block_size']} B{row['batch']}"
                extra = f"f32 ref {row['reference_f32']['median_s'] * 1e6:.1f} us"
            else:
                case = f"{row['model']} {row['K']}->{row['N']} M{row['M']}"
                extra = (f"dense bf16 {row['dense_bf16_xla']['median_s'] * 1e6:.1f} us; "
                         f"{k['flops_per_s'] / 1e12:.2f} TFLOP/s")
            out.append(f"| {kind} | {case} | {row['bytes_per_call'] / 1e6:.2f} | "
                       f"{k['median_s'] * 1e6:.1f} | {k['bytes_per_s'] / 1e12:.3f} | "
                       f"{k['vs_nominal_bw']:.2f} | {fmt(k.get('vs_measured_copy_bw'), '.2f')} | "
                       f"{fmt(k.get('vs_measured_read_bw'), '.2f')} | "
                       f"{x['median_s'] * 1e6:.1f} | {row['kernel_over_xla_engine_path']:.2f} | "
                       f"{extra} |")
    for row in r.get("ragged_attention", []):
        if "error" in row:
            out.append(f"| ragged_attention | {row['case']} | ERROR: {row['error'][:120]} ||||||||")
            continue
        k, x, ref = row["kernel"], row["xla_engine_path"], row["reference_f32"]
        out.append(f"| ragged_attention | {row['model']} bs{row['block_size']} R{row['rows']} "
                   f"T{row['tokens']} | {row['bytes_per_call'] / 1e6:.2f} | "
                   f"{k['median_s'] * 1e6:.1f} | {k['bytes_per_s'] / 1e12:.3f} | "
                   f"{k['vs_nominal_bw']:.2f} | {fmt(k.get('vs_measured_copy_bw'), '.2f')} | "
                   f"{fmt(k.get('vs_measured_read_bw'), '.2f')} | {x['median_s'] * 1e6:.1f} | "
                   f"{row['kernel_over_xla_engine_path']:.2f} | f32 ref "
                   f"{ref['median_s'] * 1e6:.1f} us ({row['kernel_over_reference_f32']:.2f}x) |")
    return out


def md_e2e(r: dict) -> list[str]:
    out = [f"- model: {r['model']} ({r['num_params'] / 1e6:.0f}M params), source: "
           f"{r['source']}, backend {r['backend']}, block {r['block_size']}", "",
           "| weights | batch | decode tok/s | steps/s | overall tok/s | MBU (weights) vs 4.3 | "
           "vs measured copy | step ms: host / wait / total | compiles in run | lengths ok |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for v in r["variants"]:
        label = v.get("quantization") or "bf16"
        if "error" in v or "skipped" in v:
            out.append(f"| {label} | {v.get('error') or v.get('skipped')} ||||||||")
            continue
        for run in v["runs"]:
            if "skipped" in run:
                out.append(f"| {label} | {run['batch']} | {run['skipped']} |||||||")
                continue
            out.append(f"| {label} | {run['batch']} | {fmt(run['decode_tok_s'], '.1f')} | "
                       f"{fmt(run['decode_steps_per_s'], '.1f')} | "
                       f"{fmt(run['overall_tok_s'], '.1f')} | "
                       f"{fmt(run.get('mbu_weights_vs_nominal'), '.3f')} | "
                       f"{fmt(run.get('mbu_weights_vs_measured_copy'), '.3f')} | "
                       f"{md_step_ms(run.get('step_breakdown', {}))} | "
                       f"{run['compiles_during_run']} | {run['all_lengths_ok']} |")
        if v.get("note"):
            out.append(f"\nnote ({label}): {v['note']}\n")
    return out


def md_step_ms(b: dict) -> str:
    if not b.get("steps"):
        return "-"
    return " / ".join(f"{b[k] * 1e3:.2f}" for k in ("median_host_s", "median_wait_s",
                                                     "median_total_s"))


def md_llm_defaults(r: dict) -> list[str]:
    c = r["config"]
    return [f"- {r['source']}: built in {r['construct_s']:.1f}s, {r['generated']} tokens in "
            f"{r['generate_s']:.2f}s ({r['tok_s']:.1f} tok/s), lengths ok {r['all_lengths_ok']}",
            f"- defaults: dtype {c.get('dtype')} (model {r['model_dtype']}), attention "
            f"{c.get('attention_backend')}, linear {c.get('linear_backend')}, kv_cache_dtype "
            f"{c.get('kv_cache_dtype')}, block {c.get('block_size')}, warmup {c.get('warmup')}",
            f"- steps {r['step_totals'].get('num_steps')}: schedule "
            f"{r['step_totals'].get('schedule_s', 0):.3f}s, device "
            f"{r['step_totals'].get('device_s', 0):.3f}s (wait "
            f"{r['step_totals'].get('wait_s', 0):.3f}s), postprocess "
            f"{r['step_totals'].get('postprocess_s', 0):.3f}s; compiles after warm-up "
            f"{r['num_compiles_after_warmup']}"]


def md_step_dump(r: dict) -> list[str]:
    out = [f"- `{r['dir']}`: {r['files']} files, {r['bytes'] / 2**20:.1f} MiB, modules: "
           f"{', '.join(r['modules']) or 'none'}"]
    if r.get("removed"):
        out.append(f"- removed {r['removed']} files (not {'/'.join(r['kept_suffixes'])}, or "
                   f"over {r['max_file_bytes'] / 2**20:.0f} MiB), e.g. "
                   f"{', '.join(r['removed_examples'][:3])}")
    if r.get("reader"):
        out.append(f"- reader: {json.dumps(r['reader'], default=str)[:1500]}")
    return out


def md_hf(r: dict) -> list[str]:
    out = [f"- {r['source']} on {r['device']}, torch {r['torch']}, transformers "
           f"{r['transformers']}, bf16", "", "| batch | decode tok/s | overall tok/s |",
           "|---|---|---|"]
    for run in r["runs"]:
        if "skipped" in run:
            out.append(f"| {run['batch']} | {run['skipped']} | |")
        else:
            out.append(f"| {run['batch']} | {fmt(run['decode_tok_s'], '.1f')} | "
                       f"{fmt(run['overall_tok_s'], '.1f')} |")
    return out


def md_kernel_tests(r: dict) -> list[str]:
    return [f"- `{r['command']}`: {r.get('summary') or 'timed out'}", "", "```",
            r["output_tail"][-1500:], "```"]


MD = {"environment": md_environment, "bandwidth": md_bandwidth,
      "kernel_correctness": md_correctness, "kernel_timings": md_timings,
      "e2e_llama3_8b": md_e2e, "e2e_smollm2": md_e2e, "llm_defaults": md_llm_defaults,
      "step_dump": md_step_dump, "hf_peer": md_hf, "kernel_tests": md_kernel_tests}


def markdown(report: dict) -> str:
    lines = [f"# gpu_check {'(dry run, CPU)' if report['dry_run'] else ''}", "",
             f"command: `{report['command']}`", ""]
    for name, sec in report["sections"].items():
        lines += [f"## {name}: {sec['status']} ({sec['seconds']:.1f}s)", ""]
        if sec.get("reason"):
            lines += [f"reason: {sec['reason']}", ""]
        if sec.get("error"):
            lines += ["```", sec["error"], "```", ""]
        if sec.get("result") and sec["status"] != "skipped":
            try:
                lines += MD[name](sec["result"]) + [""]
            except Exception as e:  # noqa: BLE001 - the JSON has everything anyway
                lines += [f"(markdown rendering failed: {type(e).__name__}: {e})", ""]
    return "\n".join(lines)


# ---- driver ------------------------------------------------------------------------------------

# Cheapest and most needed first: SmolLM2 (the served model) before the 8B model, whose random
# init and compiles cost the most; the dump of the steps compiled so far after both.
SECTIONS = [("environment", section_environment), ("bandwidth", section_bandwidth),
            ("kernel_correctness", section_kernel_correctness),
            ("kernel_timings", section_kernel_timings),
            ("e2e_smollm2", section_e2e_smollm2), ("llm_defaults", section_llm_defaults),
            ("e2e_llama3_8b", section_e2e_llama3_8b), ("step_dump", section_step_dump),
            ("hf_peer", section_hf_peer), ("kernel_tests", section_kernel_tests)]


def run_section(ctx: Ctx, name: str, fn) -> dict:
    if ctx.over_budget() and name not in ("environment", "step_dump"):
        return {"status": "skipped", "seconds": 0.0,
                "reason": f"time budget ({ctx.args.time_budget:.0f}s) exceeded before this section"}
    need = dict(ctx.prof.section_min_s).get(name, 0.0)
    if need and ctx.remaining() < need:
        return {"status": "skipped", "seconds": 0.0,
                "reason": f"time budget: this section needs about {need:.0f}s, "
                          f"{ctx.remaining():.0f}s left"}
    ctx.log(f"section {name} ...")
    t0 = time.monotonic()
    try:
        result = fn(ctx)
        status = result.pop("_status", "ok")
        sec = {"status": status, "result": result}
        if "_reason" in result:
            sec["reason"] = result.pop("_reason")
    except Exception as e:  # noqa: BLE001 - one section failing must not stop the others
        sec = {"status": "error", "error": f"{type(e).__name__}: {e}",
               "traceback": traceback.format_exc()[-4000:]}
    sec["seconds"] = time.monotonic() - t0
    gc.collect()
    ctx.log(f"section {name}: {sec['status']} in {sec['seconds']:.1f}s"
            + (f" ({sec.get('error') or sec.get('reason')})" if sec["status"] != "ok" else ""))
    return sec


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default="gpu_check_out")
    ap.add_argument("--gguf", default=None, help="SmolLM2 .gguf file (else random weights)")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds; checked between sections, cases, variants and batches: what "
                         f"would start after it is skipped. Default {GPU_BUDGET_S:.0f} on a GPU "
                         f"(with start-up, one call fits 8 min), {DRY_BUDGET_S:.0f} in a dry run")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU, interpret-mode kernels, tiny shapes and models")
    ap.add_argument("--no-step-dump", action="store_true",
                    help="do not dump the compiled engine step (XLA_FLAGS) under --out-dir")
    ap.add_argument("--sections", default=",".join(n for n, _ in SECTIONS),
                    help="comma-separated subset of sections to run")
    args = ap.parse_args(argv)
    if args.time_budget is None:
        args.time_budget = DRY_BUDGET_S if args.dry_run else GPU_BUDGET_S
    unknown = set(args.sections.split(",")) - {n for n, _ in SECTIONS}
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}; known: {[n for n, _ in SECTIONS]}")
    return args


def write_report(out_dir: pathlib.Path, report: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "gpu_check.json.tmp"
    tmp.write_text(json.dumps(report, indent=1, default=str))
    tmp.replace(out_dir / "gpu_check.json")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        os.environ["JAX_PLATFORMS"] = "cpu"
    enable_step_dump(args)  # XLA reads its flags once, when jax starts the backend
    import jax
    if not args.dry_run and jax.default_backend() != "gpu":
        print(f"gpu_check: no GPU (jax backend {jax.default_backend()!r}); use --dry-run",
              file=sys.stderr)
        return 2
    ctx = Ctx(args, DRY_PROFILE if args.dry_run else GPU_PROFILE)
    wanted = set(args.sections.split(","))
    out_dir = pathlib.Path(args.out_dir)
    report = {"command": " ".join([sys.executable] + sys.argv), "dry_run": args.dry_run,
              "time_budget_s": args.time_budget, "profile": dataclasses.asdict(ctx.prof),
              "started": time.strftime("%Y-%m-%d %H:%M:%S"), "sections": {}}
    for name, fn in SECTIONS:
        if name in wanted:
            report["sections"][name] = run_section(ctx, name, fn)
            report["elapsed_s"] = time.monotonic() - ctx.start
            write_report(out_dir, report)
    md = markdown(report)
    (out_dir / "gpu_check.md").write_text(md)
    print(md, flush=True)
    bad = [n for n, s in report["sections"].items() if s["status"] in ("error", "failed")]
    if bad:
        print(f"gpu_check: problems in {bad}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
