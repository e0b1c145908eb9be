"""The ragged kernel with the KV write fused in (`ragged_paged_attention_write`): the step's
keys and values come packed beside the queries and are NaN in the cache, so the kernel must
read them from the packed array and write them, exactly, while attending (interpret mode and
a GPU: the `interpret` fixture), plus its CUDA lowering and sm_90a compile."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import (ragged_paged_attention_reference,
                                                   ragged_paged_attention_write)
from pallas_kernels.cases import attention_tolerance
from tests.cuda_lowering import compile_for_h200, cuda_compiler_available, lower_for_h200
from tests.kernels.test_ragged_paged_attention import (DTYPES, LAYER, NUM_KV_HEADS, check,
                                                       engine_shapes, make_case)

pytestmark = pytest.mark.filterwarnings(
    "ignore:The Pallas Triton backend is deprecated:DeprecationWarning")


def fused_case(seed, **kw):
    """A ragged case whose step tokens' keys and values (positions from each row's first
    query) move from the cache (now NaN there) into qkv `[T, H + 2K, Dh]`. Returns qkv, the
    poisoned caches, slots `[T]` (0 for tokens of no row), and the case with the full caches
    (what the oracle reads and the write must restore)."""
    q, k, v, pt, qs, cl = make_case(seed, **kw)
    block_size = k.shape[2]
    table, starts, lens = (np.asarray(x) for x in (pt, qs, cl))
    slots = np.zeros(q.shape[0], np.int32)  # [T]
    for r in range(lens.size):
        q_len = starts[r + 1] - starts[r]
        pos = lens[r] - q_len + np.arange(q_len)
        slots[starts[r]:starts[r + 1]] = table[r, pos // block_size] * block_size + \
            pos % block_size
    owned = np.zeros(q.shape[0], bool)
    owned[starts[0]:starts[-1]] = True
    blk, off = jnp.asarray(slots // block_size), jnp.asarray(slots % block_size)
    new_k, new_v = k[LAYER, blk, off], v[LAYER, blk, off]  # [T, K, Dh]
    nan = jnp.asarray(jnp.nan, k.dtype)
    kc = k.at[LAYER, blk[owned], off[owned]].set(nan)
    vc = v.at[LAYER, blk[owned], off[owned]].set(nan)
    qkv = jnp.concatenate([q, jnp.where(owned[:, None, None], new_k, nan),
                           jnp.where(owned[:, None, None], new_v, nan)], axis=1)
    return qkv, (kc, vc), jnp.asarray(slots), (q, k, v, LAYER, pt, qs, cl)


# (dtype, head_dim, block_size, group, mix, queries_per_tile, num_splits, short rows)
CASES = [("f32", 64, 8, 3, "mixed", None, None, None),   # two calls: short rows, then long
         ("f32", 128, 16, 4, "decode", None, 3, None),
         ("f32", 64, 8, 1, "prefill", 16, 2, None),       # 40 new keys: three chunks of 16
         ("f32", 64, 32, 4, "mixed", 8, 1, 2),
         ("bf16", 128, 16, 3, "mixed", None, 2, None),
         ("bf16", 64, 8, 4, "decode", None, None, None)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_fused_write_attends_and_writes(case, interpret):
    dtype, head_dim, block_size, group, mix, bq, splits, short = case
    dtype = DTYPES[dtype]
    qkv, (kc, vc), slots, full = fused_case(0, dtype=dtype, block_size=block_size,
                                            group=group, head_dim=head_dim, mix=mix)
    out, k2, v2 = ragged_paged_attention_write(
        qkv, kc, vc, jnp.int32(LAYER), slots, *full[4:], num_heads=full[0].shape[1],
        queries_per_tile=bq, num_splits=splits, short_queries_per_tile=short,
        interpret=interpret)
    check(out, full, dtype)
    np.testing.assert_array_equal(np.asarray(k2, np.float32), np.asarray(full[1], np.float32))
    np.testing.assert_array_equal(np.asarray(v2, np.float32), np.asarray(full[2], np.float32))


@pytest.mark.parametrize("window,softcap", [(5, None), (12, 3.0), (1, None)])
def test_fused_write_with_window_and_softcap(window, softcap, interpret):
    qkv, (kc, vc), slots, full = fused_case(1, dtype=jnp.float32, block_size=8, group=3,
                                            head_dim=64, mix="mixed")
    kw = dict(window=jnp.int32(window), softcap=softcap, sm_scale=0.2)
    out, _, _ = ragged_paged_attention_write(qkv, kc, vc, LAYER, slots, *full[4:],
                                             num_heads=full[0].shape[1], num_splits=2,
                                             interpret=interpret, **kw)
    want = ragged_paged_attention_reference(*full, **kw)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want),
                               **attention_tolerance(jnp.float32))


def test_rejects_an_int8_cache_or_unpacked_heads():
    qkv, (kc, vc), slots, full = fused_case(2, dtype=jnp.float32, block_size=8, group=2,
                                            head_dim=64, mix="decode")
    heads = full[0].shape[1]
    with pytest.raises(ValueError, match="keys and values per token"):
        ragged_paged_attention_write(qkv, kc, vc, LAYER, slots, *full[4:],
                                     num_heads=heads + NUM_KV_HEADS, interpret=True)
    codes = kc.astype(jnp.int8)
    with pytest.raises(ValueError, match="float cache"):
        ragged_paged_attention_write(qkv, codes, codes, LAYER, slots, *full[4:],
                                     num_heads=heads, interpret=True)


def _shapes(model, dtype, step, num_blocks=1024):
    q, k, v, layer, pt, qs, cl = engine_shapes(model, 16, dtype, step, num_blocks=num_blocks)
    tokens, heads, head_dim = q.shape
    qkv = jax.ShapeDtypeStruct((tokens, heads + 2 * k.shape[3], head_dim), dtype)
    return (qkv, k, v, layer, jax.ShapeDtypeStruct((tokens,), jnp.int32), pt, qs, cl), heads


@pytest.mark.parametrize("model,dtype,step,num_blocks", [
    ("smollm2", jnp.bfloat16, "decode", 1024), ("llama3_8b", jnp.bfloat16, "mixed", 1024),
    ("smollm2", jnp.float32, "batch1", 1024),
    # 6.4 GB per cache: Triton's 64-bit offsets, for the loads and the in-place writes.
    ("llama3_8b", jnp.bfloat16, "decode", 6144)])
def test_fused_write_compiles_for_sm90a(model, dtype, step, num_blocks):
    args, heads = _shapes(model, dtype, step, num_blocks)

    def fn(*a):
        return ragged_paged_attention_write(*a, num_heads=heads)
    assert "__gpu$xla.gpu.triton" in lower_for_h200(fn, *args)
    why_not = cuda_compiler_available()
    if why_not:
        pytest.skip(why_not)
    assert "pallas_call" in compile_for_h200(fn, *args).as_text()
