"""The one-launch KV-cache write (pallas_kernels/kv_write.py) against XLA's scatters: exact
equality over KV head counts, head dims, dtypes (int8 with scales), token counts that do not
fill the last program, and a traced layer; plus its CUDA lowering and sm_90a compile."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runtime import kv_quant
from pallas_kernels.kv_write import write_kv_cache, write_kv_cache_reference
from tests.cuda_lowering import compile_for_h200, cuda_compiler_available, lower_for_h200

pytestmark = pytest.mark.filterwarnings(
    "ignore:The Pallas Triton backend is deprecated:DeprecationWarning")


def make_case(seed, *, num_tokens, num_kv_heads, head_dim, dtype, block_size=8, num_blocks=12,
              num_layers=3, pad_tokens=0):
    """NaN-filled caches (so a write to the wrong place, or a missing one, shows) and the new
    values of `num_tokens` tokens at distinct random slots; `pad_tokens` more write the null
    block's slot 0 (as the engine's padding does) with equal values, so the order of those
    writes cannot matter."""
    rng = np.random.default_rng(seed)
    shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
    slots = rng.choice(np.arange(block_size, num_blocks * block_size), num_tokens, replace=False)
    slots = np.concatenate([slots, np.zeros(pad_tokens, np.int64)]).astype(np.int32)  # [T]
    t = slots.size
    k = rng.standard_normal((t, num_kv_heads, head_dim)).astype(np.float32)  # [T, K, Dh]
    v = rng.standard_normal((t, num_kv_heads, head_dim)).astype(np.float32)
    if pad_tokens:
        k[num_tokens:], v[num_tokens:] = k[-1], v[-1]
    if kv_quant.is_quantized(dtype):
        (kc, ks), (vc, vs) = kv_quant.quantize(jnp.asarray(k)), kv_quant.quantize(jnp.asarray(v))
        caches = (jnp.zeros(shape, jnp.int8), jnp.ones(shape, jnp.int8),
                  jnp.full(shape[:-1], jnp.nan, jnp.float32),
                  jnp.full(shape[:-1], jnp.nan, jnp.float32))
        return caches, jnp.asarray(slots), (kc, vc, ks, vs)
    caches = (jnp.full(shape, jnp.nan, dtype), jnp.full(shape, jnp.nan, dtype))
    return caches, jnp.asarray(slots), (jnp.asarray(k, dtype), jnp.asarray(v, dtype))


# (num_tokens, num_kv_heads, head_dim, dtype, pad_tokens): K = 1, 3 (padded to 4 rows), 8;
# token counts below, at and past one program's 64 rows.
CASES = [(1, 1, 64, "f32", 0), (5, 3, 64, "bf16", 3), (40, 3, 64, "f32", 0),
         (17, 8, 128, "bf16", 2), (9, 2, 128, "int8", 0), (30, 3, 64, "int8", 4)]
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "int8": jnp.int8}


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_write_matches_scatters(case, interpret):
    num_tokens, kv_heads, head_dim, dtype, pad = case
    caches, slots, new = make_case(0, num_tokens=num_tokens, num_kv_heads=kv_heads,
                                   head_dim=head_dim, dtype=DTYPES[dtype], pad_tokens=pad)
    for layer in (0, 2):
        got = write_kv_cache(caches, jnp.int32(layer), slots, new, interpret=interpret)
        want = write_kv_cache_reference(caches, layer, slots, new)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.dtype == w.dtype
            np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
        # The write really happened (the reference and the kernel could both do nothing).
        assert not np.array_equal(np.asarray(got[0], np.float32),
                                  np.asarray(caches[0], np.float32), equal_nan=True)


def test_layer_is_traced_inside_scan(interpret):
    caches, slots, new = make_case(1, num_tokens=6, num_kv_heads=3, head_dim=64,
                                   dtype=jnp.float32)

    @jax.jit
    def all_layers(caches):
        def step(caches, layer):
            return write_kv_cache(caches, layer, slots, new, interpret=interpret), None
        return jax.lax.scan(step, caches, jnp.arange(3, dtype=jnp.int32))[0]

    got = all_layers(caches)
    want = caches
    for layer in range(3):
        want = write_kv_cache_reference(want, layer, slots, new)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_write_from_packed_heads(dtype, interpret):
    """K and V read from one [q | k | v] array per token (heads_at), the engine's layout."""
    caches, slots, (k, v) = make_case(3, num_tokens=11, num_kv_heads=3, head_dim=64,
                                      dtype=DTYPES[dtype], pad_tokens=2)
    q = jnp.full((k.shape[0], 9, 64), jnp.nan, k.dtype)  # never written anywhere
    qkv = jnp.concatenate([q, k, v], axis=1)  # [T, 9 + 2 * 3, Dh]
    got = write_kv_cache(caches, 1, slots, (qkv, qkv), heads_at=(9, 12), interpret=interpret)
    want = write_kv_cache_reference(caches, 1, slots, (k, v))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def test_rejects_mismatched_values():
    caches, slots, (k, v) = make_case(2, num_tokens=4, num_kv_heads=2, head_dim=64,
                                      dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="do not fit cache"):
        write_kv_cache(caches, 0, slots, (k.astype(jnp.float32), v), interpret=True)
    with pytest.raises(ValueError, match="from head 1 do not fit"):  # heads [1, 3) of 2
        write_kv_cache(caches, 0, slots, (k, v), heads_at=(1, 0), interpret=True)
    with pytest.raises(ValueError, match="do not match"):
        write_kv_cache(caches, 0, slots, (k,), interpret=True)


def engine_shapes(kv_heads, head_dim, dtype, tokens, num_blocks=1024):
    s = jax.ShapeDtypeStruct
    shape = (30, num_blocks, 16, kv_heads, head_dim)
    if dtype == jnp.int8:
        caches = (s(shape, jnp.int8),) * 2 + (s(shape[:-1], jnp.float32),) * 2
        new = (s((tokens, kv_heads, head_dim), jnp.int8),) * 2 + \
            (s((tokens, kv_heads), jnp.float32),) * 2
    else:
        caches = (s(shape, dtype),) * 2
        new = (s((tokens, kv_heads, head_dim), dtype),) * 2
    return caches, s((), jnp.int32), s((tokens,), jnp.int32), new


SHAPES = [(3, 64, jnp.bfloat16, 64), (8, 128, jnp.bfloat16, 512), (3, 64, jnp.int8, 64),
          (8, 128, jnp.float32, 64)]


def flat_call(shape):
    """write_kv_cache over flat arguments (the CUDA helpers take arrays, not tuples)."""
    caches, layer, slots, new = engine_shapes(*shape)
    n = len(caches)

    def fn(*args):
        return write_kv_cache(args[:n], args[n], args[n + 1], args[n + 2:])
    return fn, (*caches, layer, slots, *new)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda c: "-".join(map(str, c)))
def test_lowers_for_cuda(shape):
    fn, args = flat_call(shape)
    assert "__gpu$xla.gpu.triton" in lower_for_h200(fn, *args)


@pytest.mark.parametrize("shape", SHAPES[:3], ids=lambda c: "-".join(map(str, c)))
def test_compiles_for_sm90a(shape):
    why_not = cuda_compiler_available()
    if why_not:
        pytest.skip(why_not)
    fn, args = flat_call(shape)
    assert "pallas_call" in compile_for_h200(fn, *args).as_text()


def test_round_half_even_is_jnp_round():
    """Triton lowers no round: the kernel's floor-based half-to-even equals jnp.round on every
    quarter in [-128, 128] (the ties included) and on random values."""
    from pallas_kernels.kv_write import round_half_even
    y = np.concatenate([np.arange(-128, 128.25, 0.25),
                        np.random.default_rng(0).uniform(-127.5, 127.5, 4096)]).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(round_half_even(jnp.asarray(y))),
                                  np.asarray(jnp.round(jnp.asarray(y))))


# (num_tokens, num_kv_heads, head_dim, float dtype, pad_tokens, packed)
QUANTIZED = [(9, 2, 128, "f32", 0, False), (30, 3, 64, "bf16", 4, False),
             (17, 8, 128, "bf16", 2, True), (1, 1, 64, "f32", 0, True)]


@pytest.mark.parametrize("case", QUANTIZED, ids=lambda c: "-".join(map(str, c)))
def test_quantized_write_equals_quantize_then_scatters(case, interpret):
    """write_kv_cache_quantized from float K and V (or a packed [q | k | v] array) equals
    kv_quant.quantize followed by XLA's scatters, codes and scales bit for bit; one vector is
    all zeros (scale 0, codes 0)."""
    from pallas_kernels.kv_write import write_kv_cache_quantized
    num_tokens, kv_heads, head_dim, dtype, pad, packed = case
    caches, slots, _ = make_case(4, num_tokens=num_tokens, num_kv_heads=kv_heads,
                                 head_dim=head_dim, dtype=jnp.int8, pad_tokens=pad)
    rng = np.random.default_rng(5)
    k, v = (jnp.asarray(3 * rng.standard_normal((slots.shape[0], kv_heads, head_dim)),
                        DTYPES[dtype]) for _ in range(2))  # [T, K, Dh]
    if pad:  # the padding tokens write one slot: equal values, so their order cannot matter
        k, v = (x.at[num_tokens:].set(x[-1]) for x in (k, v))
    k = k.at[0, 0].set(0)
    (kc, ks), (vc, vs) = kv_quant.quantize(k), kv_quant.quantize(v)
    want = write_kv_cache_reference(caches, 1, slots, (kc, vc, ks, vs))
    if packed:
        q = jnp.full((k.shape[0], 2 * kv_heads, head_dim), jnp.nan, k.dtype)
        qkv = jnp.concatenate([q, k, v], axis=1)  # [T, 4K, Dh]
        got = write_kv_cache_quantized(caches, 1, slots, (qkv, qkv),
                                       heads_at=(2 * kv_heads, 3 * kv_heads),
                                       interpret=interpret)
    else:
        got = write_kv_cache_quantized(caches, 1, slots, (k, v), interpret=interpret)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    blk, off = int(slots[0]) // caches[0].shape[2], int(slots[0]) % caches[0].shape[2]
    assert float(got[2][1, blk, off, 0]) == 0.0 and not np.asarray(got[0][1, blk, off, 0]).any()
    assert (np.asarray(got[2][1, blk, off, 1:]) > 0).all()  # the others were quantized


def test_quantized_write_compiles_for_h200():
    """The 8B's step: 64 tokens of a packed bf16 [q | k | v] (32 + 2 x 8 heads of 128) into
    an int8 cache, one Triton call with the four caches aliased."""
    from pallas_kernels.kv_write import write_kv_cache_quantized
    why = cuda_compiler_available()
    if why:
        pytest.skip(why)
    s = jax.ShapeDtypeStruct
    shape = (32, 1024, 16, 8, 128)
    caches = (s(shape, jnp.int8),) * 2 + (s(shape[:-1], jnp.float32),) * 2
    qkv = s((64, 48, 128), jnp.bfloat16)

    def fn(kc, vc, ks, vs, layer, slots, packed):
        return write_kv_cache_quantized((kc, vc, ks, vs), layer, slots, (packed, packed),
                                        heads_at=(32, 40))
    text = compile_for_h200(fn, *caches, s((), jnp.int32), s((64,), jnp.int32), qkv).as_text()
    assert "kv_cache_write" in text and "scatter" not in text


def test_quantized_write_rejects_what_it_cannot_write():
    from pallas_kernels.kv_write import write_kv_cache_quantized
    caches, slots, (kc, vc, ks, vs) = make_case(6, num_tokens=4, num_kv_heads=2, head_dim=64,
                                                dtype=jnp.int8)
    with pytest.raises(ValueError, match="a quantized write takes"):
        write_kv_cache_quantized(caches[:2], 0, slots, (kc, vc), interpret=True)
    with pytest.raises(ValueError, match="do not fit cache"):
        write_kv_cache_quantized(caches, 0, slots, (kc, vc), interpret=True)  # int8 values
    f = kc.astype(jnp.float32)
    with pytest.raises(ValueError, match="from head 1 do not fit"):
        write_kv_cache_quantized(caches, 0, slots, (f, f), heads_at=(1, 0), interpret=True)
