"""Inputs and tolerances of the Pallas kernel tests, shared with scripts/gpu_check.py.

Needs only numpy, jax and pallas_kernels (no pytest, no jaxserve), so the GPU check can run
the tests' cases at its own sizes on a machine that has nothing but the repository. jax is
imported inside the functions: gpu_check reads the constants before it picks the platform.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

# ---- paged attention ---------------------------------------------------------------------------

# f32: same inputs, f32 math on both sides (IEEE dots); only summation order differs.
# bf16: identical bf16 inputs, f32 accumulation on both sides, but the kernel feeds p to the
# p @ v dot as bf16 (rel. 2^-9) and the output is rounded to bf16 (rel. 2^-9): ~1e-2 covers both.
ATTENTION_TOLERANCE = {"float32": dict(rtol=1e-5, atol=1e-5),
                       "bfloat16": dict(rtol=1e-2, atol=1e-2)}

# The engine's configurations: (num_kv_heads, group, head_dim, num_layers).
ATTENTION_MODELS = {"smollm2": (3, 3, 64, 30), "llama3_8b": (8, 4, 128, 32)}


# Engine-sized ragged attention steps for lowering and compile tests: (tokens, rows) of a
# decode-shaped step, a mixed prefill step (short rows, then the others) and one decode row.
RAGGED_ENGINE_STEPS = {"decode": (64, 64), "mixed": (512, 16), "batch1": (1, 1)}


def ragged_engine_shapes(model: str, block_size: int, dtype, step: str, num_blocks: int = 1024,
                         num_pages: int = 64) -> tuple:
    """ShapeDtypeStructs of ragged_paged_attention's positional arguments (q, k/v caches,
    layer, page table, query_start, context_lens) for `model`'s heads at an engine step."""
    import jax
    import jax.numpy as jnp
    kv_heads, group, head_dim, layers = ATTENTION_MODELS[model]
    tokens, rows = RAGGED_ENGINE_STEPS[step]
    s = jax.ShapeDtypeStruct
    cache = s((layers, num_blocks, block_size, kv_heads, head_dim), dtype)
    return (s((tokens, kv_heads * group, head_dim), dtype), cache, cache, s((), jnp.int32),
            s((rows, num_pages), jnp.int32), s((rows + 1,), jnp.int32), s((rows,), jnp.int32))


def attention_tolerance(dtype) -> dict:
    """assert_allclose keywords for kernel vs reference at activation `dtype`."""
    import jax.numpy as jnp
    return ATTENTION_TOLERANCE[jnp.dtype(dtype).name]


def paged_layout(rng: np.random.Generator, *, block_size: int, lens: Sequence[int],
                 num_pages: int, num_spare: int = 5) -> tuple[np.ndarray, np.ndarray]:
    """A page table over shuffled blocks, and how many slots of each block hold context.

    Each row's context gets its own blocks; table entries past a context point at random
    spare blocks (the null block 0 among them) that no context uses. Returns the page table
    `[B, num_pages]` int32 and the live slot count per block `[num_blocks]` int32.
    """
    pages = [-(-n // block_size) for n in lens]
    if max(pages, default=0) > num_pages:
        raise ValueError(f"a context of {max(lens)} tokens needs {max(pages)} pages of "
                         f"{block_size}, the table has {num_pages}")
    used = sum(pages)
    num_blocks = 1 + used + num_spare  # null block + used + spares
    ids = rng.permutation(np.arange(1, num_blocks))
    spare = np.concatenate([[0], ids[used:]])
    table = rng.choice(spare, size=(len(lens), num_pages)).astype(np.int32)  # [B, P]
    valid = np.zeros(num_blocks, np.int32)  # [NB]
    start = 0
    for b, (n, count) in enumerate(zip(lens, pages)):
        table[b, :count] = ids[start:start + count]
        valid[ids[start:start + count]] = np.minimum(block_size, n - block_size * np.arange(count))
        start += count
    return table, valid


def paged_case(seed: int, *, dtype, block_size: int, num_kv_heads: int, group: int,
               head_dim: int, lens: Sequence[int], num_pages: int, num_layers: int = 2,
               live_layers: Sequence[int] | None = None, num_spare: int = 5):
    """Random q and NaN-filled caches with each row's context written at shuffled blocks.

    Every cache slot that is not part of some row's context (spare blocks, the null block 0,
    slots past a context on its last page, layers not in `live_layers`; None = all layers) is
    NaN, and table entries past a context point at NaN blocks, so a stray read shows.
    `num_spare` unused blocks pad the cache (a large count makes a cache over 4 GiB).
    Returns q `[B, K * G, Dh]`, k and v `[L, NB, BS, K, Dh]`, page table `[B, P]` and context
    lengths `[B]`; values are drawn on the device, so GPU-sized cases build in milliseconds.
    """
    import jax
    import jax.numpy as jnp
    table, valid = paged_layout(np.random.default_rng(seed), block_size=block_size,
                                lens=lens, num_pages=num_pages, num_spare=num_spare)
    shape = (num_layers, valid.size, block_size, num_kv_heads, head_dim)
    live = np.zeros(num_layers, bool)  # [L]
    live[list(range(num_layers) if live_layers is None else live_layers)] = True
    slot_live = np.arange(block_size)[None, :] < valid[:, None]  # [NB, BS]
    mask = jnp.asarray(live[:, None, None, None, None] & slot_live[None, :, :, None, None])
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    nan = jnp.asarray(jnp.nan, dtype)
    q = jax.random.normal(kq, (len(lens), num_kv_heads * group, head_dim), jnp.float32)
    k = jnp.where(mask, jax.random.normal(kk, shape, jnp.float32).astype(dtype), nan)
    v = jnp.where(mask, jax.random.normal(kv, shape, jnp.float32).astype(dtype), nan)
    return q.astype(dtype), k, v, jnp.asarray(table), jnp.asarray(lens, jnp.int32)



def quantize_kv_np(x, garbage_code: int = -128):
    """numpy int8 KV quantization, independent of jaxserve/runtime/kv_quant.py: per vector of
    the last axis, scale = max|x| * float32(1 / 127), codes = round-half-even(x * float32(1 /
    scale)) (a zero vector: scale 0, codes 0). NaN vectors (slots no row may read) get NaN
    scales and `garbage_code` codes (-128 is outside the quantized range, so a read of one
    shows). Returns (codes int8, scale float32 `x.shape[:-1]`, the dequantized float64 values
    codes * scale)."""
    x = np.asarray(x, np.float32)
    bad = np.isnan(x).any(-1)
    xs = np.where(bad[..., None], 0, x)
    scale = (np.abs(xs).max(-1) * np.float32(1 / 127)).astype(np.float32)
    inv = (np.float32(1) / np.where(scale > 0, scale, np.float32(1))).astype(np.float32)
    codes = np.clip(np.round(xs * inv[..., None]), -127, 127).astype(np.int8)
    codes[bad] = garbage_code
    scale[bad] = np.nan
    return codes, scale, codes.astype(np.float64) * scale.astype(np.float64)[..., None]


def ragged_layout(rows: Sequence[tuple[int, int]], head: int = 0,
                  tail: int = 0) -> tuple[np.ndarray, int]:
    """query_start `[R + 1]` int32 for rows of (q_len, context_len) laid out back to back on a
    flat token axis after `head` unowned tokens and before `tail` more; and T. (Rows are
    contiguous: a row's queries end where the next row's begin, so between rows the only
    "gaps" are padding rows of q_len 0.)"""
    query_start = head + np.concatenate([[0], np.cumsum([q for q, _ in rows])]).astype(np.int32)
    return query_start, int(query_start[-1]) + tail


def ragged_case(seed: int, *, dtype, block_size: int, num_kv_heads: int, group: int,
                head_dim: int, rows: Sequence[tuple[int, int]], num_pages: int,
                head: int = 0, tail: int = 0, num_layers: int = 2,
                live_layers: Sequence[int] | None = None, num_spare: int = 5):
    """`paged_case`'s NaN-filled caches for rows of (q_len, context_len), and q on a flat axis.

    Row r's queries are its last q_len positions (context_len >= q_len; q_len 0 is a padding
    row). Returns q `[T, K * G, Dh]` (unowned tokens hold random values too), k and v
    `[L, NB, BS, K, Dh]`, page table `[R, P]`, query_start `[R + 1]` and context lengths `[R]`.
    """
    import jax
    import jax.numpy as jnp
    if any(c < q for q, c in rows):
        raise ValueError(f"a row's context is shorter than its queries: {rows}")
    query_start, num_tokens = ragged_layout(rows, head, tail)
    _, k, v, table, lens = paged_case(seed, dtype=dtype, block_size=block_size,
                                      num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
                                      lens=[c for _, c in rows], num_pages=num_pages,
                                      num_layers=num_layers, live_layers=live_layers,
                                      num_spare=num_spare)
    q = jax.random.normal(jax.random.key(seed + 1), (num_tokens, num_kv_heads * group, head_dim),
                          jnp.float32)
    return q.astype(dtype), k, v, table, jnp.asarray(query_start), lens

# ---- int4 (W4A16) matmul -----------------------------------------------------------------------

# Errors normalised by max|reference| ("scale"):
# - f32 activations: |kernel - ref| < 1e-5 * scale. Both do the same quantized math in f32; they
#   differ only in summation order and in applying scales after the dot (kernel) or before (ref).
# - bf16 activations: the kernel's dot is exact-input (bf16 x times integer codes, f32
#   accumulation), so its output is the f32 result rounded once to bf16:
#   |kernel - ref_f32| < 2^-8 * |ref_f32| + 1e-5 * scale elementwise, where ref_f32 is the
#   reference on x upcast to f32.
INT4_TOLERANCE = {"float32": dict(rel=0.0, scale=1e-5), "bfloat16": dict(rel=2.0**-8, scale=1e-5)}

# The engine's (K, N) weight shapes per model.
INT4_MODEL_SHAPES = {"smollm2": [(576, 576), (576, 192), (576, 1536), (1536, 576)],
                     "llama3_8b": [(4096, 4096), (4096, 14336), (14336, 4096)]}


def int4_group_size(k: int) -> int:
    """The group size the engine quantizes a K-row weight with (the largest that divides K)."""
    return next(g for g in (128, 64, 32) if k % g == 0)


def int4_error_bound(ref: np.ndarray, dtype) -> np.ndarray:
    """Elementwise bound on |kernel - reference| at activation `dtype` (see INT4_TOLERANCE)."""
    import jax.numpy as jnp
    tol = INT4_TOLERANCE[jnp.dtype(dtype).name]
    ref = np.asarray(ref, np.float32)
    return tol["rel"] * np.abs(ref) + tol["scale"] * np.max(np.abs(ref))


def int4_weights(k: int, n: int, g: int, symmetric: bool, seed: int = 0,
                 scale_dtype=np.float32, offset_dtype=None):
    """Random codes over the full range [0, 15] with random per-group scales and offsets.

    Returns packed `[K / 2, N]` uint8, scales `[K / g, N]` and offsets `[K / g, N]` (None when
    symmetric). offset_dtype None: scale_dtype. The engine's GPU format is bfloat16 scales with
    float32 offsets (jaxserve/quantization/gpu_format.py).
    """
    import jax.numpy as jnp
    from pallas_kernels.int4_matmul import pack_int4
    rng = np.random.default_rng(seed)
    u = rng.integers(0, 16, size=(k, n), dtype=np.uint8)
    packed = pack_int4(jnp.asarray(u), group_size=g)
    scales = jnp.asarray(rng.uniform(0.005, 0.05, size=(k // g, n)).astype(scale_dtype))
    offsets = None if symmetric else jnp.asarray(
        rng.uniform(-0.4, 0.0, size=(k // g, n)).astype(offset_dtype or scale_dtype))
    return packed, scales, offsets


def int4_activations(m: int, k: int, dtype, seed: int = 1):
    """x `[M, K]` from a standard normal."""
    import jax.numpy as jnp
    return jnp.asarray(np.random.default_rng(seed).standard_normal((m, k)), dtype)

# ---- multi-LoRA delta (SGMV) -------------------------------------------------------------------

# Elementwise: |kernel - ref| <= h_ulp * (|h| @ |b|) + rtol * |ref| + atol.
# - f32: the same f32 math on both sides (IEEE dots), summed in another order.
# - bf16: bf16 inputs, exact products and f32 sums on both sides, but h = x @ a is rounded to
#   bf16 before the expand: where the two f32 sums straddle a rounding point, the kernel's and
#   the reference's h differ by one bf16 ulp (<= 2^-7 |h|), which the expand carries into y as
#   at most 2^-7 * sum_r |h_r| |b_rn|. Elsewhere they agree to the f32 bound.
LORA_TOLERANCE = {"float32": dict(h_ulp=0.0, rtol=1e-5, atol=1e-5),
                  "bfloat16": dict(h_ulp=2.0**-7, rtol=1e-5, atol=1e-5)}

# The engine's (K, N) projections a LoRA adapter targets, per model (q/o, k/v, gate/up, down).
LORA_MODEL_SHAPES = {"smollm2": [(576, 576), (576, 192), (576, 1536), (1536, 576)],
                     "llama3_8b": [(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096)]}


def lora_case(seed: int, *, sizes: Sequence[int], rank: int, k: int, n: int, dtype,
              extra_rows: int = 0, nan_unused: bool = True):
    """x `[M, K]` (M = sum(sizes) + extra_rows, at least 1) with rows sorted by slot, a
    `[S, K, R]`, b `[S, R, N]` and group_sizes `[S]` int32, drawn so y is O(1). With
    nan_unused, the rows past the groups and the weights of empty slots are NaN, so a stray
    read shows. Drawn by numpy: LoRA operands are small even at GPU sizes, and jax.random
    would compile its ops once per shape."""
    import jax.numpy as jnp
    rng = np.random.default_rng(seed)
    s, m = len(sizes), max(sum(sizes) + extra_rows, 1)
    x = rng.standard_normal((m, k), np.float32)  # [M, K]
    a = rng.standard_normal((s, k, rank), np.float32) / np.float32(np.sqrt(k))  # [S, K, R]
    b = rng.standard_normal((s, rank, n), np.float32) / np.float32(np.sqrt(rank))  # [S, R, N]
    if nan_unused:
        x[sum(sizes):] = np.nan
        empty = np.asarray(sizes) == 0  # [S]
        a[empty], b[empty] = np.nan, np.nan
    return (jnp.asarray(x, dtype), jnp.asarray(a, dtype), jnp.asarray(b, dtype),
            jnp.asarray(sizes, jnp.int32))


def lora_batch_sizes(m: int, num_slots: int, seed: int) -> tuple[list[int], int]:
    """A serving batch of m tokens, each with a random slot or none (-1), as the runtime sorts
    it: (tokens per slot, tokens of no adapter, which come after them)."""
    slots = np.random.default_rng(seed).integers(-1, num_slots, size=m)
    return np.bincount(slots[slots >= 0], minlength=num_slots).tolist(), int((slots < 0).sum())


def lora_row_slots(sizes: Sequence[int], m: int) -> np.ndarray:
    """Each row's slot `[M]` (-1: rows past the groups), from the group sizes."""
    slots = np.full(m, -1, np.int64)
    ends = np.cumsum(sizes)
    for g, (start, end) in enumerate(zip(ends - np.asarray(sizes), ends)):
        slots[min(start, m):min(end, m)] = g
    return slots


def lora_error_bound(x, a, b, slots: np.ndarray, ref: np.ndarray, dtype) -> np.ndarray:
    """Elementwise bound on |kernel - reference| (see LORA_TOLERANCE) for rows whose slot is
    `slots [M]` (-1: none); computed in float64 from the (finite) used weights."""
    import jax.numpy as jnp
    tol = LORA_TOLERANCE[jnp.dtype(dtype).name]
    x64, a64, b64 = (np.asarray(np.asarray(v, np.float32), np.float64) for v in (x, a, b))
    bound = tol["rtol"] * np.abs(np.asarray(ref, np.float64)) + tol["atol"]  # [M, N]
    if tol["h_ulp"]:
        for g in np.unique(slots[slots >= 0]):
            rows = slots == g
            h = np.abs(x64[rows] @ a64[g])  # [rows, R]
            bound[rows] += tol["h_ulp"] * (h @ np.abs(b64[g]))
    return bound

# ---- sampling (one row per program) ------------------------------------------------------------

# Tokens and top-logprob ids must match the reference exactly. Log-probabilities: the kernel's
# logsumexp is online and chunk-wise, the reference's XLA's two-pass one; with |logsumexp| < 20
# (logits of scale <= 3 over V <= 128256) they differ by a few float32 ulps.
SAMPLING_LOGPROB_ATOL = 2e-5

# The engine's vocabularies per model.
SAMPLING_MODEL_VOCABS = {"smollm2": 49152, "llama3_8b": 128256}

# Rows as (greedy, top_k (0: off), top_p, min_p): greedy, an unfiltered draw, top-k 1 / small /
# deep / >= V, top-p 0.5 .. 0.99, min-p and combinations.
SAMPLING_ROWS = [(True, 0, 1.0, 0.0), (False, 0, 1.0, 0.0), (False, 1, 1.0, 0.0),
                 (False, 5, 1.0, 0.0), (False, 50, 0.9, 0.0), (False, 0, 0.5, 0.0),
                 (False, 0, 0.95, 0.0), (False, 0, 0.99, 0.0), (False, 0, 1.0, 0.05),
                 (False, 40, 0.8, 0.02), (False, 3000, 1.0, 0.0), (False, 10 ** 9, 1.0, 0.0),
                 (False, 0, 0.9, 0.3), (True, 5, 0.5, 0.1)]


def sampling_case(seed: int, v: int, rows, *, ties: bool = False, masked: float = 0.0,
                  scale: float = 3.0):
    """Arguments of `pallas_kernels.sampling.sample_rows` before `want`: scaled and raw logits
    `[S, V]` (the same array: a greedy row's scaled logits are its raw ones anyway), k `[S]`
    (V when off), top_p, log(min_p) (-inf when off), uniforms and greedy flags `[S]`, for
    `rows` of (greedy, top_k, top_p, min_p). ties: integer logits (ties at every cutoff and in
    the top logprobs); masked: the share of logits at -inf (a grammar's bitmask; one token
    per row stays allowed)."""
    import jax.numpy as jnp
    rng = np.random.default_rng(seed)
    s = len(rows)
    x = rng.normal(0.0, scale, (s, v)).astype(np.float32)  # [S, V]
    if ties:
        x = np.round(x).astype(np.float32)
    if masked:
        x[rng.random((s, v)) < masked] = -np.inf
        x[:, rng.integers(0, v)] = 1.0
    greedy, k, top_p, min_p = (np.asarray(c) for c in zip(*rows))
    k = np.where((k <= 0) | (k > v), v, k).astype(np.int32)
    with np.errstate(divide="ignore"):
        log_min_p = np.log(min_p.astype(np.float32))
    u = rng.random(s).astype(np.float32)
    return (jnp.asarray(x), jnp.asarray(x), jnp.asarray(k), jnp.asarray(top_p, jnp.float32),
            jnp.asarray(log_min_p), jnp.asarray(u), jnp.asarray(greedy))


def check_sampling(interpret: bool, small: bool) -> dict:
    """gpu_check's sampling case (GPU_CHECK_CASES): the kernel against its sort reference on
    every SAMPLING_ROWS mix at each model's vocabulary (a 5000-token vocabulary when small),
    tokens and top-logprob ids exact, logprobs within SAMPLING_LOGPROB_ATOL."""
    from pallas_kernels.sampling import sample_rows, sample_rows_reference
    rows = []
    for name, v in ({"small": 5000} if small else SAMPLING_MODEL_VOCABS).items():
        args = sampling_case(7, v, SAMPLING_ROWS)
        got = sample_rows(*args, True, num_logprobs=20, interpret=interpret)
        want = sample_rows_reference(*args, True, num_logprobs=20)
        got, want = ([np.asarray(a) for a in out] for out in (got, want))
        err = max(float(np.max(np.abs(got[i] - want[i]))) for i in (1, 3))
        rows.append({"vocab": v, "model": name, "tokens_equal": bool((got[0] == want[0]).all()),
                     "top_ids_equal": bool((got[2] == want[2]).all()), "max_abs_err": err})
    ok = all(r["tokens_equal"] and r["top_ids_equal"] and r["max_abs_err"] <= SAMPLING_LOGPROB_ATOL
             for r in rows)
    return {"within_tol": ok, "max_abs_err": max(r["max_abs_err"] for r in rows),
            "tolerance": SAMPLING_LOGPROB_ATOL, "rows": rows}


# ---- grouped matmul (the MoE experts) ------------------------------------------------------

# OLMoE's gate/up projection (64 experts, D 2048 -> F 1024) at 16 tokens' top-8; small: 8
# experts, 128 -> 128, 4 tokens' top-2 (gpu_check's dry run).
GMM_CHECK_SHAPES = {False: (64, 2048, 1024, 16, 8), True: (8, 128, 128, 4, 2)}


def gmm_reference(x, w_dense, sizes):
    """(float64 result, error bound) `[M, N]` of a grouped matmul with f32 results from exact
    products (bf16 inputs, int8 codes), group by group (x `[M, K]` rows sorted by group,
    w_dense `[E, K, N]` float64, sizes `[E]`). The bound: f32 sums of K terms in any order,
    2 K 2^-24 times A, the output's magnitude without cancellation (|x| @ |w| of the row's
    group), plus the scale's one f32 rounding (2^-24 A). A row given another group's weights,
    or a dropped scale, is off by O(A)."""
    k = x.shape[1]
    want = np.zeros((x.shape[0], w_dense.shape[2]))  # [M, N]
    bound = np.zeros_like(want)
    start = 0
    for g, size in enumerate(sizes):
        rows = slice(start, start + size)
        want[rows] = x[rows] @ w_dense[g]
        bound[rows] = (2 * k + 1) * 2.0 ** -24 * (np.abs(x[rows]) @ np.abs(w_dense[g]))
        start += size
    return want, bound


def check_grouped_matmul(interpret: bool, small: bool) -> dict:
    """gpu_check's grouped matmul case (GPU_CHECK_CASES): the Triton and the Mosaic GPU kernel
    (where it takes the shape) on rows routed to top-k experts, bf16 weights and int8 codes
    with f32 scales, against a float64 per-group loop within `gmm_reference`'s bound."""
    import jax
    import jax.numpy as jnp
    from pallas_kernels import grouped_matmul_mgpu as mgpu
    from pallas_kernels.grouped_matmul import grouped_matmul
    from pallas_kernels.mosaic_interpret import mosaic_interpret
    e, k, n, tokens, top_k = GMM_CHECK_SHAPES[small]
    rng = np.random.default_rng(11)
    experts = np.argsort(rng.random((tokens, e)), axis=1)[:, :top_k].reshape(-1)  # [T * k]
    sizes = np.bincount(experts, minlength=e)  # [E]
    x = np.asarray(jnp.asarray(rng.standard_normal((tokens * top_k, k)), jnp.bfloat16)
                   .astype(jnp.float32), np.float64)  # [M, K], rows sorted by group
    weights = {
        "bf16": (np.asarray(jnp.asarray(rng.standard_normal((e, k, n)) / np.sqrt(k),
                                        jnp.bfloat16).astype(jnp.float32), np.float64), None),
        "int8": (rng.integers(-127, 128, (e, n, k)), rng.uniform(0.5, 1.5, (e, n)) / 127)}
    rows, ok, worst = [], True, 0.0
    xb = jnp.asarray(x, jnp.bfloat16)
    gs = jnp.asarray(sizes, jnp.int32)
    for kind, (w, scales) in weights.items():
        if scales is None:
            dense, args = w, (jnp.asarray(w, jnp.bfloat16), None)
        else:
            scales = np.asarray(scales, np.float32).astype(np.float64)
            dense = np.swapaxes(w, 1, 2) * scales[:, None, :]  # [E, K, N]
            args = (jnp.asarray(w, jnp.int8), jnp.asarray(scales, jnp.float32))
        want, bound = gmm_reference(x, dense, sizes)  # [M, N] float64 each
        got = {"triton": grouped_matmul(xb, args[0], gs, args[1], interpret=interpret)}
        if mgpu.unsupported(k, n, xb.dtype, args[0].dtype) is None:
            got["mosaic"] = mgpu.grouped_matmul_mgpu(xb, args[0], gs, args[1],
                                                     interpret=mosaic_interpret(interpret))
        for backend, y in got.items():
            err = np.abs(np.asarray(jax.device_get(y), np.float64) - want)
            within = bool(np.isfinite(err).all() and (err <= bound).all())
            ok, worst = ok and within, max(worst, float(err.max()))
            rows.append({"weights": kind, "kernel": backend, "within_tol": within,
                         "max_abs_err": float(err.max()),
                         "max_err_over_bound": float((err / bound).max())})
    return {"within_tol": ok, "max_abs_err": worst, "shape": dict(
        experts=e, K=k, N=n, tokens=tokens, top_k=top_k), "rows": rows}


# gpu_check's kernel_correctness runs each (jaxserve/tools/gpu_check/kernel_correctness.py).
GPU_CHECK_CASES = {"sampling": check_sampling, "grouped_matmul": check_grouped_matmul}


# ---- fused linear ------------------------------------------------------------------------------

# Bound on |kernel - reference| as a multiple of A, the output's magnitude without cancellation
# (|h| @ |W| per weight, times the other factor under the gated activation, plus |bias| and
# |residual|), computed in float64.
# - f32: the same f32 math on both sides (IEEE dots), summed in another order.
# - bf16: the normed row, each weight's output and the result are rounded to bf16 on both
#   sides, from f32 sums that differ in order: where the two straddle a rounding point they
#   differ by one bf16 ulp (<= 2^-7 relative) at each of those roundings, and the reference
#   may round silu(gate) before the product where the kernel does not (2^-8): 2^-6 covers the
#   stack.
FUSED_LINEAR_TOLERANCE = {"float32": 1e-5, "bfloat16": 2.0**-6}

# The engine's fused calls, per model: (K, widths, kind) for q/k/v with the norm and RoPE, o_proj
# with the residual, gate/up with the norm and SiLU, down with the residual, the final norm
# and the LM head (SmolLM2's tied: the embedding read transposed).
FUSED_LINEAR_SHAPES = {
    "smollm2": [(576, (576, 192, 192), "qkv_rope"), (576, (576,), "residual"),
                (576, (1536, 1536), "gated"), (1536, (576,), "residual"),
                (576, (49152,), "head")],
    "llama3_8b": [(4096, (4096, 1024, 1024), "qkv_rope"), (4096, (4096,), "residual"),
                  (4096, (14336, 14336), "gated"), (14336, (4096,), "residual"),
                  (4096, (128256,), "lm_head")]}
FUSED_LINEAR_HEAD_DIM = {"smollm2": 64, "llama3_8b": 128}


def fused_linear_case(seed: int, *, m: int, k: int, widths: Sequence[int], kind: str, dtype,
                      head_dim: int = 64) -> dict:
    """fused_linear's arguments for `kind` ("qkv": norm and biases; "qkv_rope": those and RoPE
    on the first two weights, heads of `head_dim`, positions up to 4096 and a scale; "gated":
    norm and SiLU; "residual": a residual; "plain": none of them; "lm_head": an LM head, the
    norm, m rows taken from x of m + 3 in a shuffled order, float32 out; "head": a tied one,
    the same with the weight `[N, K]` read transposed), drawn so the output is O(1), as
    keywords."""
    import jax.numpy as jnp
    rng = np.random.default_rng(seed)
    head, tied = kind in ("head", "lm_head"), kind == "head"
    t = m + 3 if head else m
    x = jnp.asarray(rng.normal(size=(t, k)) * 3.0, dtype)  # the norm takes the scale out
    weights = tuple(jnp.asarray(rng.normal(size=(n, k) if tied else (k, n)) / np.sqrt(k),
                                dtype) for n in widths)
    gated = kind == "gated"
    normed = kind in ("qkv", "qkv_rope", "gated", "head", "lm_head")
    n_out = widths[0] if gated else sum(widths)
    args = dict(x=x, weights=weights,
                norm_scale=(jnp.asarray(1.0 + 0.2 * rng.normal(size=(k,)), dtype) if normed
                            else None),
                biases=(tuple(jnp.asarray(rng.normal(size=(n,)), dtype) for n in widths)
                        if kind.startswith("qkv") else None),
                residual=(jnp.asarray(rng.normal(size=(m, n_out)), dtype)
                          if kind == "residual" else None),
                activation="silu" if gated else None)
    if head:
        args.update(x_rows=jnp.asarray(rng.permutation(t)[:m], jnp.int32), transposed=tied,
                    out_dtype=jnp.float32)
    if kind == "qkv_rope":
        half = head_dim // 2
        args.update(positions=jnp.asarray(rng.integers(0, 4096, size=m), jnp.int32),
                    inv_freq=jnp.asarray(1e4 ** (-np.arange(half) / half), jnp.float32),
                    rope_weights=2, rope_scale=1.1)
    return args


def fused_linear_numpy(*, x, weights, norm_scale=None, biases=None, residual=None,
                       positions=None, inv_freq=None, activation=None, rope_weights=0,
                       rope_scale=1.0, x_rows=None, transposed=False, out_dtype=None, eps):
    """(y, A): the fused linear in float64 numpy from the same (rounded) inputs, the normed
    row rounded to the inputs' dtype as the contract says, and A, the magnitude the tolerance
    scales (FUSED_LINEAR_TOLERANCE; with RoPE |a| |cos| + |b| |sin| per rotated element)."""
    import jax.numpy as jnp
    dtype = x.dtype
    f64 = lambda a: np.asarray(np.asarray(a, np.float32), np.float64)  # noqa: E731
    h = f64(x) if x_rows is None else f64(x)[np.asarray(x_rows)]
    if transposed:
        weights = [np.asarray(w).T for w in weights]
    if norm_scale is not None:
        normed = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + eps)
        normed = f64(jnp.asarray(normed, jnp.float32).astype(dtype))
        h = f64(jnp.asarray(f64(norm_scale) * normed, jnp.float32).astype(dtype))
    outs, mags = [], []
    for i, w in enumerate(weights):
        y, a = h @ f64(w), np.abs(h) @ np.abs(f64(w))
        if biases is not None:
            y, a = y + f64(biases[i]), a + np.abs(f64(biases[i]))
        if i < rope_weights:
            y, a = _rope_numpy(y, a, f64(positions), f64(inv_freq), rope_scale)
        outs.append(y)
        mags.append(a)
    if activation == "silu":
        g, u = outs
        y = g / (1.0 + np.exp(-g)) * u
        a = 1.1 * mags[0] * (np.abs(u) + mags[1])  # |silu'| <= 1.1
    else:
        y, a = np.concatenate(outs, -1), np.concatenate(mags, -1)
    if residual is not None:
        y, a = y + f64(residual), a + np.abs(f64(residual))
    return y, a


def _rope_numpy(y, a, positions, inv_freq, scale):
    """Rotate-half RoPE of `[M, heads * Dh]` in float64, and its magnitude."""
    m, half = y.shape[0], inv_freq.shape[0]
    # The angle as the contract makes it, a float32 product (exact f64 angles would differ
    # by up to |position| * 2^-24 rad); cos and sin of it in float64.
    angle = np.asarray(positions.astype(np.float32)[:, None, None]
                       * inv_freq.astype(np.float32)[None, None, :], np.float64)  # [M, 1, Dh/2]
    cos, sin = np.cos(angle) * scale, np.sin(angle) * scale
    y1, y2 = np.split(y.reshape(m, -1, 2 * half), 2, axis=-1)
    a1, a2 = np.split(a.reshape(m, -1, 2 * half), 2, axis=-1)
    rot = np.concatenate([y1 * cos - y2 * sin, y2 * cos + y1 * sin], -1).reshape(m, -1)
    mag = np.concatenate([a1 * abs(cos) + a2 * abs(sin), a2 * abs(cos) + a1 * abs(sin)],
                         -1).reshape(m, -1)
    return rot, mag
