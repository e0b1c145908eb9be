"""Ragged paged-attention kernel and its jnp reference vs a float64 numpy oracle (interpreted, and
compiled on a GPU: the `interpret` fixture), strict out-of-bounds interpretation, and CUDA
lowering / deviceless sm_90a compilation for the engine's shapes."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_attention_kernel import split_pages
from pallas_kernels.ragged_paged_attention import (ragged_paged_attention,
                                                   ragged_paged_attention_reference)
from tests.cuda_lowering import compile_for_h200, cuda_compiler_available, lower_for_h200
from pallas_kernels.cases import (ATTENTION_MODELS, RAGGED_ENGINE_STEPS, attention_tolerance,
                                  ragged_case, ragged_engine_shapes)

pytestmark = pytest.mark.filterwarnings(
    "ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

NUM_KV_HEADS = 2
LAYER = 1  # of 2; the other layer is all NaN, so reading the wrong layer shows

# Row mixes: rows of (q_len, context_len) back to back after `head` tokens that belong to no
# row, and a padded tail. (query_start has R + 1 entries: rows are contiguous, so padding rows
# of q_len 0 are the only gaps between them.)
MIXES = {
    # Decode only: contexts of 1 token, around page edges, several pages.
    "decode": dict(rows=[(1, 1), (1, 9), (1, 16), (1, 17), (1, 33), (1, 64)], tail=2),
    # One prefill chunk from position 0.
    "prefill": dict(rows=[(40, 40)], tail=3),
    # Padding rows (first, middle, last), decode and speculative rows with earlier context,
    # chunks from position 0 and later chunks, unowned tokens before the first row and after.
    "mixed": dict(rows=[(0, 0), (1, 20), (2, 2), (3, 35), (0, 0), (5, 5), (17, 17), (40, 61),
                        (2, 9), (0, 0)],
                  head=3, tail=4),
}

# (dtype, head_dim, block_size, group, mix, queries_per_tile): a pairwise cover of the axes, not
# their product (each interpreted case costs a compile). queries_per_tile None is the default;
# the others split long rows into several tiles (Bq * Gp >= 16, so they also run on a GPU).
CASES = [
    ("f32", 64, 8, 1, "mixed", 16),
    ("f32", 128, 16, 3, "decode", None),
    ("f32", 64, 32, 4, "prefill", 4),
    ("f32", 128, 16, 4, "mixed", None),
    ("f32", 128, 16, 3, "prefill", 8),
    ("bf16", 128, 8, 4, "decode", None),
    ("bf16", 64, 16, 1, "prefill", None),
    ("bf16", 128, 32, 3, "mixed", 4),
    ("bf16", 64, 8, 3, "mixed", None),
    ("bf16", 64, 32, 1, "decode", None),
]
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}


def case_id(case):
    return "-".join(str(x) for x in case)


def make_case(seed, *, dtype, block_size, group, head_dim, mix, extra_pages=1, num_layers=2,
              fill_all_layers=False, num_kv_heads=NUM_KV_HEADS):
    """pallas_kernels/cases.py's NaN-filled ragged case for a MIXES entry, context in LAYER."""
    spec = MIXES[mix] if isinstance(mix, str) else mix
    pages = max(-(-c // block_size) for _, c in spec["rows"]) + extra_pages
    return ragged_case(seed, dtype=dtype, block_size=block_size, num_kv_heads=num_kv_heads,
                       group=group, head_dim=head_dim, num_pages=pages, num_layers=num_layers,
                       live_layers=None if fill_all_layers else [LAYER], **spec)


def oracle(q, k, v, layer, page_table, query_start, context_lens):
    """float64, per query: its row's keys up to its own position, softmax. Returns the output
    `[T, H, Dh]` and which tokens belong to a row `[T]` (the others are zeros)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    table, qs, lens = (np.asarray(x) for x in (page_table, query_start, context_lens))
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k.shape[2], k.shape[3]
    group = num_heads // num_kv_heads
    out = np.zeros_like(q)
    owned = np.zeros(num_tokens, bool)
    for r in range(len(lens)):
        q_len, ctx = qs[r + 1] - qs[r], lens[r]
        pos = np.arange(ctx)
        blocks, slots = table[r, pos // block_size], pos % block_size
        keys = np.repeat(k[layer, blocks, slots], group, axis=1)  # [ctx, H, Dh]
        values = np.repeat(v[layer, blocks, slots], group, axis=1)
        for i in range(q_len):
            t, seen = qs[r] + i, ctx - q_len + i + 1
            scores = np.einsum("hd,shd->hs", q[t], keys[:seen]) / np.sqrt(head_dim)
            probs = np.exp(scores - scores.max(axis=1, keepdims=True))
            probs /= probs.sum(axis=1, keepdims=True)
            out[t] = np.einsum("hs,shd->hd", probs, values[:seen])
            owned[t] = True
    return out, owned


def check(out, args, dtype):
    """Real tokens finite and close to the oracle; tokens of no row zeros (our documented
    choice within the contract's "don't care")."""
    expected, owned = oracle(*args)
    q = args[0]
    assert out.dtype == q.dtype and out.shape == q.shape
    out = np.asarray(out, np.float32)
    assert np.isfinite(out[owned]).all()
    np.testing.assert_allclose(out[owned], expected[owned], **attention_tolerance(dtype))
    np.testing.assert_array_equal(out[~owned], 0.0)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_kernel_matches_oracle(case, interpret):
    dtype, head_dim, block_size, group, mix, bq = case
    dtype = DTYPES[dtype]
    q, k, v, pt, qs, cl = make_case(0, dtype=dtype, block_size=block_size, group=group,
                                    head_dim=head_dim, mix=mix)
    out = ragged_paged_attention(q, k, v, jnp.int32(LAYER), pt, qs, cl, queries_per_tile=bq,
                                 interpret=interpret)
    check(out, (q, k, v, LAYER, pt, qs, cl), dtype)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_reference_matches_oracle(case):
    dtype, head_dim, block_size, group, mix, _ = case
    dtype = DTYPES[dtype]
    args = make_case(0, dtype=dtype, block_size=block_size, group=group, head_dim=head_dim,
                     mix=mix)
    q, k, v, pt, qs, cl = args
    out = jax.jit(ragged_paged_attention_reference)(q, k, v, LAYER, pt, qs, cl)
    check(out, (q, k, v, LAYER, pt, qs, cl), dtype)


@pytest.mark.parametrize("num_splits", [1, 3, 16])
def test_split_counts_agree(num_splits, interpret):
    # 1: no combine; 3: uneven shares; 16: more splits than most tiles have pages (rows see
    # nothing in most).
    q, k, v, pt, qs, cl = make_case(1, dtype=jnp.float32, block_size=8, group=4, head_dim=64,
                                    mix="mixed")
    out = ragged_paged_attention(q, k, v, LAYER, pt, qs, cl, queries_per_tile=4,
                                 num_splits=num_splits, interpret=interpret)
    check(out, (q, k, v, LAYER, pt, qs, cl), jnp.float32)


# (dtype, block_size, pages_per_step, num_splits): steps of 1..8 pages, splits that end
# mid-step (the next split's pages in the step must be masked), steps wider than the table.
STEP_CASES = [("f32", 8, 1, None), ("f32", 8, 2, 3), ("f32", 8, 4, None), ("f32", 8, 8, 2),
              ("f32", 8, 16, 1), ("bf16", 16, None, None), ("bf16", 16, 4, 5)]


@pytest.mark.parametrize("case", STEP_CASES, ids=case_id)
def test_pages_per_step_variants(case, interpret):
    dtype, block_size, step, split = case
    dtype = DTYPES[dtype]
    q, k, v, pt, qs, cl = make_case(6, dtype=dtype, block_size=block_size, group=3,
                                    head_dim=64, mix="mixed")
    out = ragged_paged_attention(q, k, v, LAYER, pt, qs, cl, queries_per_tile=8,
                                 num_splits=split, pages_per_step=step,
                                 interpret=interpret)
    check(out, (q, k, v, LAYER, pt, qs, cl), dtype)


@pytest.mark.parametrize("short,num_splits", [(1, 1), (2, 3), (4, None), (0, 2)])
def test_short_rows_on_their_own_tile(short, num_splits, interpret):
    # Rows of at most `short` queries (decodes, 2-token speculative rows) in a call of their
    # own, on tiles of `short` queries; the others on tiles of 8. 0: one call.
    q, k, v, pt, qs, cl = make_case(8, dtype=jnp.float32, block_size=8, group=3, head_dim=64,
                                    mix="mixed")
    out = ragged_paged_attention(q, k, v, LAYER, pt, qs, cl, queries_per_tile=8,
                                 short_queries_per_tile=short, num_splits=num_splits,
                                 interpret=interpret)
    check(out, (q, k, v, LAYER, pt, qs, cl), jnp.float32)


def _pallas_calls(*args, name="ragged_paged_attention", **kw):
    """The traced function's pallas_calls named `name` (the attention kernel; merge_splits:
    the combine of its splits)."""
    jaxpr = jax.make_jaxpr(functools.partial(ragged_paged_attention, **kw))(*args)
    eqns = jaxpr.jaxpr.eqns
    if not any(e.primitive.name == "pallas_call" for e in eqns):  # inside the jit's jaxpr
        eqns = eqns[0].params["jaxpr"].jaxpr.eqns
    return [e for e in eqns if e.primitive.name == "pallas_call" and e.params["name"] == name]


def test_mixed_step_runs_decodes_on_the_short_tile():
    """By default a prefill-shaped step (the tall tile) gives its short rows a call on the
    16-row tile, one tile per row; a decode-shaped step is one call."""
    kv_heads, group, head_dim, _ = ATTENTION_MODELS["llama3_8b"]
    s = jax.ShapeDtypeStruct
    cache = s((2, 300, 16, kv_heads, head_dim), jnp.bfloat16)

    def args(rows, tokens):
        return (s((tokens, kv_heads * group, head_dim), jnp.bfloat16), cache, cache,
                s((), jnp.int32), s((rows, 64), jnp.int32), s((rows + 1,), jnp.int32),
                s((rows,), jnp.int32))

    calls = _pallas_calls(*args(16, 512), interpret=True)
    assert len(calls) == 2, calls
    grids = [c.params["grid_mapping"].grid for c in calls]
    assert grids[0][0] == 16 and grids[1][0] == 512 // 16 + 16, grids  # tiles of 4 and 16
    assert len(_pallas_calls(*args(64, 64), interpret=True)) == 1
    assert len(_pallas_calls(*args(16, 512), queries_per_tile=16, interpret=True)) == 1


def _kernel_outputs(*args, name="ragged_paged_attention", **kw):
    """Shapes of the outputs of the traced function's one pallas_call named `name`."""
    calls = _pallas_calls(*args, name=name, **kw)
    assert len(calls) == 1, calls
    return [(v.aval.shape, v.aval.dtype) for v in calls[0].outvars]


@pytest.mark.parametrize("model", sorted(ATTENTION_MODELS))
def test_batch_one_decode_splits_at_most_16_ways(model):
    """At batch 1 with 256 pages the row's pages go to <= 16 programs per KV head, whose
    partials one merge_splits kernel combines into the cache's dtype; a full decode batch takes
    no split and writes its output in the cache's dtype, no f32 partials, no merge."""
    kv_heads, group, head_dim, _ = ATTENTION_MODELS[model]
    s = jax.ShapeDtypeStruct
    cache = s((2, 300, 16, kv_heads, head_dim), jnp.bfloat16)

    def args(rows, tokens):
        return (s((tokens, kv_heads * group, head_dim), jnp.bfloat16), cache, cache,
                s((), jnp.int32), s((rows, 256), jnp.int32), s((rows + 1,), jnp.int32),
                s((rows,), jnp.int32))

    outs = _kernel_outputs(*args(1, 1), interpret=True)
    splits = outs[0][0][0] // (kv_heads * group)  # partials [S * T * H, Dh], T = 1
    assert len(outs) == 3 and 1 < splits <= 16, outs
    merged = _kernel_outputs(*args(1, 1), name="merge_splits", interpret=True)
    assert merged == [((kv_heads * group, head_dim), jnp.bfloat16)], merged
    outs = _kernel_outputs(*args(64, 64), interpret=True)
    assert len(outs) == 1 and outs[0][1] == jnp.bfloat16, outs
    assert not _pallas_calls(*args(64, 64), name="merge_splits", interpret=True)
    assert outs[0][0] == (64 * kv_heads * group, head_dim), outs  # q's rows, no copy


@pytest.mark.parametrize("context,window", [(1024, None), (1024, 200), (40, None),
                                            (8192, None)])
def test_splits_share_the_real_pages(context, window):
    """A 1k-token context in a table sized for 8k (512 pages of 16) over 16 splits: every
    split gets pages (sizing by the table's width gave 32 pages a split: 2 of 16 busy), the
    shares tile exactly the pages the query sees, none longer than ceil(pages / 16)."""
    block_size, splits = 16, 16
    n_pages = -(-context // block_size)
    first = 0 if window is None else (context - window) // block_size
    got = [tuple(int(x) for x in split_pages(jnp.int32(first), jnp.int32(n_pages),
                                             jnp.int32(s), splits)) for s in range(splits)]
    seen = [p for start, count in got for p in range(start, start + count)]
    assert seen == list(range(first, n_pages))
    busy = sum(count > 0 for _, count in got)
    assert busy == min(splits, n_pages - first), got
    assert max(count for _, count in got) == -(-(n_pages - first) // splits)


@pytest.mark.parametrize("group,bq,num_splits", [(3, None, None), (4, 4, 3), (1, 16, 1)])
def test_queries_packed_with_other_heads(group, bq, num_splits, interpret):
    """q as the first H of Hq heads per token (the engine packs [q | k | v]): the other heads
    are NaN, so reading one shows; the output has H heads."""
    q, k, v, pt, qs, cl = make_case(7, dtype=jnp.float32, block_size=8, group=group,
                                    head_dim=64, mix="mixed")
    extra = jnp.full((q.shape[0], 2 * NUM_KV_HEADS, q.shape[2]), jnp.nan, q.dtype)
    packed = jnp.concatenate([q, extra], axis=1)  # [T, H + 2K, Dh]
    out = ragged_paged_attention(packed, k, v, LAYER, pt, qs, cl, num_heads=q.shape[1],
                                 queries_per_tile=bq, num_splits=num_splits,
                                 interpret=interpret)
    check(out, (q, k, v, LAYER, pt, qs, cl), jnp.float32)


def test_all_padding_step_gives_zeros(interpret):
    spec = dict(rows=[(0, 0), (0, 5), (0, 0)], head=2, tail=3)
    q, k, v, pt, qs, cl = make_case(2, dtype=jnp.float32, block_size=8, group=3, head_dim=64,
                                    mix=spec)
    out = ragged_paged_attention(q, k, v, LAYER, pt, qs, cl, interpret=interpret)
    np.testing.assert_array_equal(np.asarray(out), 0.0)


def test_layer_is_traced_inside_scan(interpret):
    spec = dict(rows=[(3, 21), (1, 9), (6, 6)], head=1, tail=1)
    q, k, v, pt, qs, cl = make_case(3, dtype=jnp.float32, block_size=8, group=3, head_dim=64,
                                    mix=spec, num_layers=3, fill_all_layers=True)

    @jax.jit
    def all_layers(q, k, v):
        def step(carry, layer):
            return carry, ragged_paged_attention(q, k, v, layer, pt, qs, cl,
                                                 interpret=interpret)
        return jax.lax.scan(step, None, jnp.arange(3, dtype=jnp.int32))[1]

    outs = all_layers(q, k, v)
    for layer in range(3):
        check(outs[layer], (q, k, v, layer, pt, qs, cl), jnp.float32)
    assert not np.allclose(outs[0], outs[1])  # the layer index is really used


def test_table_garbage_past_the_contexts_is_harmless(interpret):
    # Table entries past each context hold ids far outside the cache (or negative); a row
    # ends at the last token, so its tile's queries run past T. The strict (TPU) interpreter,
    # which raised on out-of-bounds reads, cannot run this kernel (it has no indexed loads:
    # q and the output are gathered / scattered by row), so this checks results only: pages
    # are read only below each tile's causal bound (see ragged_kernel), never past a context.
    spec = dict(rows=[(1, 1), (3, 11), (0, 0), (5, 24)], head=1, tail=0)
    q, k, v, pt, qs, cl = make_case(4, dtype=jnp.float32, block_size=8, group=3, head_dim=64,
                                    mix=spec)
    garbage = np.asarray(pt).copy()
    garbage[0, 1:] = 10**6
    garbage[1, 2:] = -7
    garbage[2, :] = 10**6
    garbage[3, 3:] = k.shape[1]
    args = (q, k, v, LAYER, jnp.asarray(garbage), qs, cl)
    for kw in (dict(num_splits=2), dict(num_splits=3, pages_per_step=4)):
        out = ragged_paged_attention(*args, queries_per_tile=4, interpret=interpret, **kw)
        check(out, (q, k, v, LAYER, pt, qs, cl), jnp.float32)


def test_rejects_tiles_too_small_for_the_gpu_dot():
    q, k, v, pt, qs, cl = make_case(5, dtype=jnp.float32, block_size=8, group=1, head_dim=64,
                                    mix="decode")
    with pytest.raises(ValueError, match="at least 16"):
        ragged_paged_attention(q, k, v, LAYER, pt, qs, cl, queries_per_tile=4)
    with pytest.raises(ValueError, match="power of 2"):
        ragged_paged_attention(q, k, v, LAYER, pt, qs, cl, queries_per_tile=3, interpret=True)


# (tokens, rows) buckets: decode-shaped (one token per row), a mixed prefill step (two calls:
# short rows, then the others) and one decode row (16 splits and their combine).
STEPS = RAGGED_ENGINE_STEPS
engine_shapes = ragged_engine_shapes


@pytest.mark.parametrize("step", sorted(STEPS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("model", sorted(ATTENTION_MODELS))  # head_dim 128 and 64
def test_lowers_for_cuda(model, block_size, dtype, step):
    args = engine_shapes(model, block_size, dtype, step)
    text = lower_for_h200(ragged_paged_attention, *args)
    assert "__gpu$xla.gpu.triton" in text
    # The caches reach the kernel whole: no op but the kernel call touches them (a slice or
    # gather of a cache would name its type), and no XLA while loop (host round trips).
    cache_type = "tensor<{}x{}>".format("x".join(map(str, args[1].shape)),
                                        jnp.dtype(dtype).name.replace("float", "f"))
    users = [line for line in text.splitlines() if cache_type in line]
    assert users and all(("func.func" in u or "call @" in u) for u in users), users
    assert "stablehlo.while" not in text


@pytest.mark.parametrize("model,block_size,dtype,step", [
    ("smollm2", 16, jnp.bfloat16, "decode"), ("smollm2", 16, jnp.float32, "mixed"),
    ("smollm2", 32, jnp.bfloat16, "mixed"), ("llama3_8b", 16, jnp.bfloat16, "mixed"),
    ("llama3_8b", 16, jnp.float32, "decode"),
    # Pages of 128 keep the short tile in f32 (a tall one overflows shared memory); this cache
    # is over 4 GiB, so Triton takes its 64-bit offset path.
    ("llama3_8b", 128, jnp.float32, "mixed")])
def test_compiles_for_sm90a(model, block_size, dtype, step):
    why_not = cuda_compiler_available()
    if why_not:
        pytest.skip(why_not)
    compiled = compile_for_h200(ragged_paged_attention,
                                *engine_shapes(model, block_size, dtype, step))
    assert "pallas_call" in compiled.as_text()


@pytest.mark.parametrize("model,dtype,step,num_blocks,kw", [
    # A bf16 cache of 6.4 GB per K and V: Pallas switches the kernel's load offsets to 64 bits
    # above 4 GiB (a real 8B cache on an H200 is that size).
    ("llama3_8b", jnp.bfloat16, "decode", 6144, {}),
    ("smollm2", jnp.bfloat16, "decode", 1024, dict(pages_per_step=4, num_warps=8)),
    ("smollm2", jnp.bfloat16, "mixed", 1024, dict(pages_per_step=2, num_stages=3)),
    ("smollm2", jnp.bfloat16, "batch1", 1024, {}),
    ("llama3_8b", jnp.float32, "batch1", 1024, {}),
])
def test_compiles_for_sm90a_variants(model, dtype, step, num_blocks, kw):
    why_not = cuda_compiler_available()
    if why_not:
        pytest.skip(why_not)
    fn = functools.partial(ragged_paged_attention, **kw)
    compiled = compile_for_h200(fn, *engine_shapes(model, 16, dtype, step, num_blocks=num_blocks))
    assert "pallas_call" in compiled.as_text()
