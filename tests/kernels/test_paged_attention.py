"""Paged-attention decode kernel vs the jnp reference (interpreted, and compiled on a GPU: the
`interpret` fixture), strict out-of-bounds interpretation, and CUDA lowering / deviceless sm_90a
compilation for the engine's shapes."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.paged_attention import paged_attention, paged_attention_reference
from tests.cuda_lowering import compile_for_h200, cuda_compiler_available, lower_for_h200
from pallas_kernels.cases import ATTENTION_MODELS, attention_tolerance, paged_case

pytestmark = pytest.mark.filterwarnings(
    "ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

NUM_KV_HEADS = 2
LAYER = 1  # of 2; the other layer is all NaN, so reading the wrong layer shows


def make_case(seed, *, dtype, block_size, group, head_dim, lens, num_pages, num_layers=2,
              fill_all_layers=False):
    """pallas_kernels/cases.py's NaN-filled case with NUM_KV_HEADS heads, context in LAYER."""
    return paged_case(seed, dtype=dtype, block_size=block_size, num_kv_heads=NUM_KV_HEADS,
                      group=group, head_dim=head_dim, lens=lens, num_pages=num_pages,
                      num_layers=num_layers, live_layers=None if fill_all_layers else [LAYER])


def check(out, q, k, v, layer, page_table, lens, dtype):
    ref = paged_attention_reference(q, k, v, layer, page_table, lens)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert np.isfinite(np.asarray(out, np.float32)).all()
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               **attention_tolerance(dtype))


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_kernel_matches_reference(dtype, block_size, group, head_dim, interpret):
    num_pages = 5  # 3 splits of 2 pages; the last split is half padding
    # Rows: 1 token, not a multiple of the block, exactly two blocks, full table, empty row.
    lens = [1, block_size + 3, 2 * block_size, num_pages * block_size, 0]
    q, k, v, pt, cl = make_case(0, dtype=dtype, block_size=block_size, group=group,
                                head_dim=head_dim, lens=lens, num_pages=num_pages)
    out = paged_attention(q, k, v, jnp.int32(LAYER), pt, cl, pages_per_split=2,
                          interpret=interpret)
    check(out, q, k, v, LAYER, pt, cl, dtype)
    np.testing.assert_array_equal(np.asarray(out[-1], np.float32), 0.0)  # empty row -> zeros


@pytest.mark.parametrize("pages_per_split", [None, 1, 3, 7])
def test_split_counts_agree(pages_per_split, interpret):
    # None -> one page per split here (tiny batch); 7 >= P -> a single split, no combine needed.
    lens = [37, 6, 64, 17]
    q, k, v, pt, cl = make_case(1, dtype=jnp.float32, block_size=8, group=4, head_dim=64,
                                lens=lens, num_pages=8)
    out = paged_attention(q, k, v, LAYER, pt, cl, pages_per_split=pages_per_split,
                          interpret=interpret)
    check(out, q, k, v, LAYER, pt, cl, jnp.float32)


# (dtype, block_size, pages_per_step, pages_per_split): steps of 1..8 pages, splits that end
# mid-step (the next split's pages in the step must be masked), steps wider than the table.
STEP_CASES = [("f32", 8, 2, 3), ("f32", 8, 4, None), ("f32", 8, 8, 5), ("f32", 8, 16, 64),
              ("bf16", 16, None, None), ("bf16", 16, 4, 1)]


@pytest.mark.parametrize("case", STEP_CASES, ids=lambda c: "-".join(map(str, c)))
def test_pages_per_step_variants(case, interpret):
    dtype, block_size, step, split = case
    dtype = {"f32": jnp.float32, "bf16": jnp.bfloat16}[dtype]
    lens = [37, 6, 64, 17, 1]
    q, k, v, pt, cl = make_case(4, dtype=dtype, block_size=block_size, group=3, head_dim=64,
                                lens=lens, num_pages=9)
    out = paged_attention(q, k, v, LAYER, pt, cl, pages_per_split=split, pages_per_step=step,
                          interpret=interpret)
    check(out, q, k, v, LAYER, pt, cl, dtype)


def _pallas_calls(jaxpr):
    """pallas_call equations in `jaxpr` and the jaxprs its equations hold (e.g. a jit's)."""
    calls = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            calls.append(eqn)
            continue
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", None)
            if inner is not None and hasattr(inner, "eqns"):
                calls += _pallas_calls(inner)
    return calls


@pytest.mark.parametrize("model", sorted(ATTENTION_MODELS))
def test_batch_one_splits_at_most_16_ways(model):
    """At batch 1 with 256 pages one row's pages go to <= 16 programs per KV head; a batch of 64
    (>= 132 programs) takes no split and writes q's dtype, no f32 partials."""
    kv_heads, group, head_dim, _ = ATTENTION_MODELS[model]
    s = jax.ShapeDtypeStruct
    cache = s((2, 300, 16, kv_heads, head_dim), jnp.bfloat16)

    def outputs(batch):
        args = (s((batch, kv_heads * group, head_dim), jnp.bfloat16), cache, cache,
                s((), jnp.int32), s((batch, 256), jnp.int32), s((batch,), jnp.int32))
        jaxpr = jax.make_jaxpr(lambda *a: paged_attention(*a, interpret=True))(*args)
        calls = _pallas_calls(jaxpr.jaxpr)
        assert len(calls) == 1
        return [(o.aval.shape, o.aval.dtype) for o in calls[0].outvars]

    outs = outputs(1)
    assert 1 < outs[0][0][0] <= 16, outs
    if kv_heads * 64 >= 132:
        outs = outputs(64)
        assert len(outs) == 1 and outs[0][0][0] == 1 and outs[0][1] == jnp.bfloat16, outs


def test_layer_is_traced_inside_scan(interpret):
    lens = [21, 9]
    q, k, v, pt, cl = make_case(2, dtype=jnp.float32, block_size=8, group=3, head_dim=64,
                                lens=lens, num_pages=3, num_layers=3, fill_all_layers=True)

    @jax.jit
    def all_layers(q, k, v):
        def step(carry, layer):
            return carry, paged_attention(q, k, v, layer, pt, cl, interpret=interpret)
        return jax.lax.scan(step, None, jnp.arange(3, dtype=jnp.int32))[1]

    outs = all_layers(q, k, v)
    for layer in range(3):
        check(outs[layer], q, k, v, layer, pt, cl, jnp.float32)
    assert not np.allclose(outs[0], outs[1])  # the layer index is really used


def test_strict_interpreter_finds_no_out_of_bounds_read():
    # The TPU interpreter raises IndexError on any out-of-bounds read, where interpret=True
    # clamps. Table entries past each context hold ids far outside the cache.
    lens = [1, 11, 24]
    q, k, v, pt, cl = make_case(3, dtype=jnp.float32, block_size=8, group=3, head_dim=64,
                                lens=lens, num_pages=4)
    garbage = np.asarray(pt).copy()
    garbage[0, 1:] = 10**6
    garbage[1, 2:] = -7
    garbage[2, 3:] = k.shape[1]
    strict = pltpu.InterpretParams()
    out = paged_attention(q, k, v, LAYER, jnp.asarray(garbage), cl, pages_per_split=2,
                          interpret=strict)
    check(out, q, k, v, LAYER, pt, cl, jnp.float32)

    # Steps of 4 pages over splits of 3: each step's 4th page (the next split's) is masked.
    out = paged_attention(q, k, v, LAYER, jnp.asarray(garbage), cl, pages_per_split=3,
                          pages_per_step=4, interpret=strict)
    check(out, q, k, v, LAYER, pt, cl, jnp.float32)

    # Control: the same garbage inside a context must be caught, or this test proves nothing.
    garbage[2, 1] = 10**6
    try:
        with pytest.raises(Exception, match="Out-of-bounds read"):
            jax.block_until_ready(paged_attention(q, k, v, LAYER, jnp.asarray(garbage), cl,
                                                  pages_per_split=2, interpret=strict))
    finally:
        pltpu.reset_tpu_interpret_mode_state()


MODELS = ATTENTION_MODELS


def engine_shapes(model, block_size, dtype, batch, num_blocks=1024, num_pages=64):
    kv_heads, group, head_dim, layers = MODELS[model]
    s = jax.ShapeDtypeStruct
    cache = s((layers, num_blocks, block_size, kv_heads, head_dim), dtype)
    return (s((batch, kv_heads * group, head_dim), dtype), cache, cache, s((), jnp.int32),
            s((batch, num_pages), jnp.int32), s((batch,), jnp.int32))


@pytest.mark.parametrize("batch", [1, 64])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_lowers_for_cuda(model, block_size, dtype, batch):
    text = lower_for_h200(paged_attention, *engine_shapes(model, block_size, dtype, batch))
    assert "__gpu$xla.gpu.triton" in text
    # The caches reach the kernel whole: no per-layer slice or gather is materialised outside.
    assert "dynamic_slice" not in text and "gather" not in text


@pytest.mark.parametrize("model,block_size,dtype", [
    ("smollm2", 16, jnp.bfloat16), ("smollm2", 16, jnp.float32), ("smollm2", 32, jnp.bfloat16),
    ("llama3_8b", 16, jnp.bfloat16)])
def test_compiles_for_sm90a(model, block_size, dtype):
    why_not = cuda_compiler_available()
    if why_not:
        pytest.skip(why_not)
    compiled = compile_for_h200(paged_attention, *engine_shapes(model, block_size, dtype, 64))
    assert "pallas_call" in compiled.as_text()


@pytest.mark.parametrize("model,dtype,batch,num_blocks,kw", [
    # bf16 caches of 6.4 GB each: Pallas switches the kernel's load offsets to 64 bits above
    # 4 GiB (an 8B model's cache on an H200 is that size).
    ("llama3_8b", jnp.bfloat16, 64, 6144, {}),
    ("smollm2", jnp.bfloat16, 1, 1024, {}),  # batch 1: split, 8 pages per step
    ("llama3_8b", jnp.bfloat16, 1, 1024, dict(num_warps=8, pages_per_step=4)),
])
def test_compiles_for_sm90a_variants(model, dtype, batch, num_blocks, kw):
    why_not = cuda_compiler_available()
    if why_not:
        pytest.skip(why_not)
    fn = lambda *a: paged_attention(*a, **kw)  # noqa: E731
    compiled = compile_for_h200(fn, *engine_shapes(model, 16, dtype, batch,
                                                   num_blocks=num_blocks))
    assert "pallas_call" in compiled.as_text()
