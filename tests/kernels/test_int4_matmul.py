"""Int4 (W4A16) matmul: kernel vs jnp reference (interpreted, and compiled on a GPU: the
`interpret` fixture), reference vs numpy, quantizer.

Tolerances: pallas_kernels/cases.py (INT4_TOLERANCE, shared with scripts/gpu_check.py).
Grid: every (K, N) x group size x {symmetric, asymmetric} at M=7 in f32 and at M=16 in bf16 (K=576
with g=128 is not a valid shape: 128 does not divide 576); every M x dtype x symmetry at
(576, 1536, g=64); the engine grid M in {1, 16, 33, 64, 512} on SmolLM2's 576 x 1536 (g=64)
and Llama-3-8B's 4096 x 14336 (g=128) in bf16 with bf16 scales (the GPU format). The full
cross product (about 130 interpret runs) is left out for time. Deviceless sm_90a compiles: each
default tile choice without spills, and the unpacking's PTX instructions per packed byte.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.int4_matmul import (dequantize_int4, int4_matmul, int4_matmul_reference,
                                        num_programs, pack_int4, pick_blocks, quantize_int4,
                                        unpack_int4)
from tests import cuda_lowering
from tests.cuda_lowering import lower_for_h200
from pallas_kernels.cases import (INT4_MODEL_SHAPES, int4_activations, int4_error_bound,
                                int4_group_size, int4_weights)

SHAPES = [(576, 1536), (1536, 576), (256, 512)]
GROUPS = [32, 64, 128]


_quantized = int4_weights
_x = int4_activations


def _assert_close(y, x, packed, scales, offsets, g):
    ref = np.asarray(int4_matmul_reference(x.astype(jnp.float32), packed, scales, offsets,
                                           group_size=g))
    y = np.asarray(y.astype(jnp.float32))
    assert y.shape == ref.shape
    np.testing.assert_array_less(np.abs(y - ref), int4_error_bound(ref, x.dtype))


def _run(m, k, n, g, symmetric, dtype, interpret, **blocks):
    packed, scales, offsets = _quantized(k, n, g, symmetric)
    x = _x(m, k, dtype)
    y = int4_matmul(x, packed, scales, offsets, group_size=g, interpret=interpret, **blocks)
    assert y.dtype == dtype and y.shape == (m, n)
    _assert_close(y, x, packed, scales, offsets, g)


SHAPE_GRID = [(k, n, g) for k, n in SHAPES for g in GROUPS if k % g == 0]


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("k,n,g", SHAPE_GRID)
def test_kernel_matches_reference_shapes_f32(k, n, g, symmetric, interpret):
    _run(7, k, n, g, symmetric, jnp.float32, interpret)


@pytest.mark.parametrize("k,n,g", SHAPE_GRID)
def test_kernel_matches_reference_shapes_bf16(k, n, g, interpret):
    _run(16, k, n, g, symmetric=g == 64, dtype=jnp.bfloat16, interpret=interpret)


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("m", [1, 7, 16, 64])
def test_kernel_matches_reference_m_dtype(m, dtype, symmetric, interpret):
    _run(m, 576, 1536, 64, symmetric, dtype, interpret)


@pytest.mark.parametrize("m,k,n,g,blocks", [
    (7, 256, 128, 128, dict(block_k=32)),                 # 4 steps per group
    (7, 512, 128, 32, dict(block_k=128)),                 # 4 groups per step, unrolled
    (7, 1536, 64, 64, dict(split_k=3)),                   # partial sums over 3 K splits
    (7, 512, 128, 32, dict(split_k=4, block_k=64)),
    (40, 256, 128, 64, dict(block_m=16, block_n=32)),     # 3 M blocks, padding 40 -> 48
    (130, 256, 128, 64, {}),                              # prefill-sized: block_m 64, M -> 192
    (7, 576, 64, 64, dict(split_k=18)),                   # each group cut in 2 (32 rows)
    (1, 1536, 64, 128, dict(split_k=48)),                 # each group cut in 4, one-row partials
    (1, 1536, 64, 128, dict(split_k=24, block_k=32)),     # 2 steps per sub-group
    (1, 256, 128, 64, dict(split_k=1)),                   # M = 1 without split: one-row store
    (3, 512, 128, 64, dict(num_warps=8, num_stages=2)),   # launch params (ignored interpreted)
])
def test_kernel_block_variants(m, k, n, g, blocks, interpret):
    _run(m, k, n, g, False, jnp.float32, interpret, **blocks)
    _run(m, k, n, g, True, jnp.bfloat16, interpret, **blocks)


def test_kernel_strict_interpreter_and_bf16_scales():
    """The strict interpreter raises on out-of-range block reads that interpret=True clamps."""
    k, n, g = 512, 128, 32
    packed, scales, offsets = _quantized(k, n, g, False, scale_dtype=jnp.bfloat16)
    x = _x(5, k, jnp.bfloat16)
    y = int4_matmul(x, packed, scales, offsets, group_size=g, split_k=2, block_k=64,
                    interpret=pltpu.InterpretParams())
    _assert_close(y, x, packed, scales, offsets, g)


def test_invalid_shapes_raise():
    packed, scales, offsets = _quantized(512, 128, 64, False)
    with pytest.raises(ValueError, match="group_size"):
        int4_matmul(_x(1, 576, jnp.float32), jnp.zeros((288, 128), jnp.uint8),
                    jnp.ones((4, 128)), None, group_size=128)
    with pytest.raises(ValueError, match="block_n"):
        int4_matmul(_x(1, 512, jnp.float32), packed, scales, offsets, group_size=64, block_n=48)
    with pytest.raises(ValueError, match="split_k"):
        int4_matmul(_x(1, 512, jnp.float32), packed, scales, offsets, group_size=64, split_k=3)


ENGINE_SHAPES = [kn for model in ("smollm2", "llama3_8b") for kn in INT4_MODEL_SHAPES[model]]


@pytest.mark.parametrize("k,n", ENGINE_SHAPES)
@pytest.mark.parametrize("m", [1, 16, 64, 512])
def test_default_blocks_are_valid(m, k, n):
    g = 64 if k == 576 else 128
    bm, bn, bk, sk = pick_blocks(m, k, n, g)
    assert n % bn == 0 and bn >= 16 and bn & (bn - 1) == 0
    assert bm in (16, 32, 64) and bm >= min(64, m)
    # split_k divides the group count, or cuts every group into parts of >= 32 rows.
    assert (k // g) % sk == 0 or (sk % (k // g) == 0 and (g // (sk // (k // g))) >= 32)
    assert (k // sk) % bk == 0 and bk >= 32 and bk & (bk - 1) == 0
    if n in (576, 192):  # SmolLM2: 64 divides 576 and 192, 128 does not
        assert bn == 64


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_word_unpacking_is_exact_for_every_byte(dtype):
    """Each byte value at each of a word's 4 positions gives its two codes exactly (plus the
    dtype's bias), in word order (vs numpy's shifts on the bytes)."""
    from pallas_kernels.int4_matmul import _bias, _unpack_words, word_order, words_of
    q = np.stack([np.roll(np.arange(256, dtype=np.uint8), 64 * j) for j in range(4)],
                 axis=-1).reshape(16, 64)  # [16, 64]: every byte at every position
    lo, hi = jax.jit(lambda w: _unpack_words(w, dtype))(words_of(jnp.asarray(q)))
    assert lo.dtype == hi.dtype == dtype and lo.shape == q.shape
    b = _bias(dtype)
    np.testing.assert_array_equal(np.asarray(word_order(lo), np.float32) - b, q & 0xF)
    np.testing.assert_array_equal(np.asarray(word_order(hi), np.float32) - b, q >> 4)


def test_word_order_is_its_own_inverse_and_swaps_1_and_2():
    from pallas_kernels.int4_matmul import word_order
    v = jnp.arange(16, dtype=jnp.float32).reshape(2, 8)
    np.testing.assert_array_equal(word_order(v)[0], [0, 2, 1, 3, 4, 6, 5, 7])
    np.testing.assert_array_equal(word_order(word_order(v)), v)


# The engine's GEMMs at decode batches 1..64 and a prefill chunk (bf16 activations and the GPU
# format: bf16 scales, f32 offsets, quantization/gpu_format.py): SmolLM2's up projection (g = 64) and
# Llama-3-8B's (g = 128).
ENGINE_GRID = [(m, k, n) for k, n in ((576, 1536), (4096, 14336)) for m in (1, 16, 33, 64, 512)]


@pytest.mark.parametrize("m,k,n", ENGINE_GRID)
def test_kernel_matches_reference_engine_grid_bf16_scales(m, k, n, interpret):
    g = int4_group_size(k)
    packed, scales, offsets = _quantized(k, n, g, False, scale_dtype=jnp.bfloat16,
                                         offset_dtype=jnp.float32)
    x = _x(m, k, jnp.bfloat16)
    y = int4_matmul(x, packed, scales, offsets, group_size=g, interpret=interpret)
    assert y.dtype == jnp.bfloat16 and y.shape == (m, n)
    _assert_close(y, x, packed, scales, offsets, g)


@pytest.mark.parametrize("model", sorted(INT4_MODEL_SHAPES))
def test_default_blocks_fill_an_h200_at_decode(model):
    """At M = 1 every engine GEMM with N >= 576 runs >= 132 programs (one per SM) and every
    other (SmolLM2's 576 x 192) at least 54; M = 64 at least 81 (docs/perf_kernels.md)."""
    for k, n in INT4_MODEL_SHAPES[model]:
        g = int4_group_size(k)
        assert num_programs(1, k, n, g) >= (132 if n >= 576 else 54), (k, n)
        assert num_programs(64, k, n, g) >= min(81, num_programs(1, k, n, g)), (k, n)


def _numpy_dequantize(packed, scales, offsets, g):
    """Independent unpack of the documented layout: in group G, byte row G*g/2 + i holds row
    G*g + i (low nibble) and row G*g + g/2 + i (high nibble)."""
    packed = np.asarray(packed)
    k, n = 2 * packed.shape[0], packed.shape[1]
    u = np.empty((k, n), np.float64)
    for grp in range(k // g):
        rows = packed[grp * g // 2:(grp + 1) * g // 2]
        u[grp * g:grp * g + g // 2] = np.bitwise_and(rows, 0x0F)
        u[grp * g + g // 2:(grp + 1) * g] = np.right_shift(rows, 4)
    s = np.repeat(np.asarray(scales, np.float64), g, axis=0)
    b = -8.0 * s if offsets is None else np.repeat(np.asarray(offsets, np.float64), g, axis=0)
    return s * u + b


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("g", GROUPS)
def test_reference_matches_numpy(g, symmetric):
    k, n = 1536, 192
    packed, scales, offsets = _quantized(k, n, g, symmetric, seed=g)
    w = _numpy_dequantize(packed, scales, offsets, g)
    np.testing.assert_allclose(dequantize_int4(packed, scales, offsets, group_size=g), w,
                               rtol=1e-6, atol=1e-7)
    x = _x(9, k, jnp.float32)
    want = np.asarray(x, np.float64) @ w
    got = np.asarray(int4_matmul_reference(x, packed, scales, offsets, group_size=g))
    np.testing.assert_array_less(np.max(np.abs(got - want)), 1e-5 * np.max(np.abs(want)))


def test_gguf_q4_block_layout_and_pack_round_trip():
    u = np.random.default_rng(3).integers(0, 16, size=(64, 3), dtype=np.uint8)
    packed = np.asarray(pack_int4(jnp.asarray(u), group_size=32))
    # GGUF Q4_0 block of 32: qs[i] = q[i] | q[i + 16] << 4.
    np.testing.assert_array_equal(packed[16 + 5, 2], u[32 + 5, 2] | (u[32 + 21, 2] << 4))
    np.testing.assert_array_equal(unpack_int4(jnp.asarray(packed), group_size=32), u)


def _gaussian(k, n, seed=4):
    return np.random.default_rng(seed).standard_normal((k, n)).astype(np.float32)


@pytest.mark.parametrize("g", GROUPS)
def test_quantize_asymmetric_round_trip(g):
    w = _gaussian(512, 96) * np.linspace(0.1, 3.0, 96, dtype=np.float32)
    packed, scales, offsets = quantize_int4(jnp.asarray(w), group_size=g)
    assert packed.dtype == jnp.uint8 and packed.shape == (256, 96)
    assert scales.shape == offsets.shape == (512 // g, 96)
    u = np.asarray(unpack_int4(packed, group_size=g)).reshape(512 // g, g, 96)
    assert u.min() >= 0 and u.max() <= 15
    # Both ends of each group's range are codes: min -> 0, max -> 15.
    np.testing.assert_array_equal(u.min(axis=1), 0)
    np.testing.assert_array_equal(u.max(axis=1), 15)
    err = np.abs(np.asarray(dequantize_int4(packed, scales, offsets, group_size=g)) - w)
    bound = np.repeat(np.asarray(scales), g, axis=0) / 2
    np.testing.assert_array_less(err, bound * (1 + 1e-4) + 1e-6)


@pytest.mark.parametrize("g", GROUPS)
def test_quantize_symmetric_zero_is_code_8(g):
    w = _gaussian(256, 64)
    w[::5] = 0.0
    w[:, 7] = 0.0  # an all-zero column: every group constant
    packed, scales, offsets = quantize_int4(jnp.asarray(w), group_size=g, symmetric=True)
    assert offsets is None
    u = np.asarray(unpack_int4(packed, group_size=g))
    assert u.min() >= 1 and u.max() <= 15
    np.testing.assert_array_equal(u[w == 0.0], 8)
    deq = np.asarray(dequantize_int4(packed, scales, None, group_size=g))
    np.testing.assert_array_equal(deq[w == 0.0], 0.0)
    bound = np.repeat(np.asarray(scales), g, axis=0) / 2
    np.testing.assert_array_less(np.abs(deq - w), bound * (1 + 1e-4) + 1e-6)


def test_quantize_constant_group_is_exact():
    w = np.full((64, 4), 0.75, np.float32)
    packed, scales, offsets = quantize_int4(jnp.asarray(w), group_size=32)
    np.testing.assert_array_equal(dequantize_int4(packed, scales, offsets, group_size=32), w)


@pytest.mark.parametrize("symmetric", [False, True])
def test_rtn_g128_error_on_gaussian(symmetric, record_property, capsys):
    """Reports RTN int4 g128 error on N(0, 1) weights (about 0.09-0.11 relative rms, from the
    s/sqrt(12) rounding noise); asserts only a sane bound."""
    w = _gaussian(4096, 256)
    packed, scales, offsets = quantize_int4(jnp.asarray(w), group_size=128, symmetric=symmetric)
    deq = np.asarray(dequantize_int4(packed, scales, offsets, group_size=128))
    w_err = np.sqrt(np.mean((deq - w) ** 2) / np.mean(w ** 2))
    x = np.random.default_rng(5).standard_normal((8, 4096)).astype(np.float32)
    y_err = np.linalg.norm(x @ deq - x @ w) / np.linalg.norm(x @ w)
    record_property("rtn_g128_weight_rel_rms", float(w_err))
    record_property("rtn_g128_matmul_rel_err", float(y_err))
    with capsys.disabled():
        print(f"\nRTN int4 g128 {'sym' if symmetric else 'asym'}: weight rel rms {w_err:.4f}, "
              f"matmul rel err {y_err:.4f}")
    assert 0.02 < w_err < 0.15 and y_err < 0.15


def _engine_fn(g, symmetric):
    if symmetric:
        return lambda x, p, s: int4_matmul(x, p, s, None, group_size=g)
    return lambda x, p, s, o: int4_matmul(x, p, s, o, group_size=g)


def _engine_args(m, k, n, g, symmetric):
    s = jax.ShapeDtypeStruct
    args = [s((m, k), jnp.bfloat16), s((k // 2, n), jnp.uint8), s((k // g, n), jnp.float32)]
    return args if symmetric else args + [s((k // g, n), jnp.float32)]


CUDA_CASES = ([(m, k, n) for k, n in ENGINE_SHAPES[:4] for m in (1, 16, 64)]
              + [(m, k, n) for k, n in ENGINE_SHAPES[4:] for m in (1, 64)])


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("m,k,n", CUDA_CASES)
def test_lowers_for_h200(m, k, n, symmetric):
    g = 64 if k == 576 else 128
    text = lower_for_h200(_engine_fn(g, symmetric), *_engine_args(m, k, n, g, symmetric))
    assert pltriton.CUSTOM_CALL_TARGET_NAME in text


def test_launch_params_lower_for_h200():
    fn = lambda x, p, s: int4_matmul(x, p, s, None, group_size=64, num_warps=8,  # noqa: E731
                                     num_stages=2)
    text = lower_for_h200(fn, *_engine_args(1, 576, 1536, 64, True))
    assert pltriton.CUSTOM_CALL_TARGET_NAME in text


@pytest.mark.parametrize("m,k,n", CUDA_CASES + [(512, 4096, 14336)])
def test_compiles_for_h200(m, k, n):
    """Full sm_90a compile (catches shared-memory overflow); needs jax-cuda13-plugin."""
    if not hasattr(cuda_lowering, "compile_for_h200"):
        pytest.skip("tests/cuda_lowering.py has no compile_for_h200 yet")
    reason = cuda_lowering.cuda_compiler_available()
    if reason:
        pytest.skip(reason)
    g = 64 if k == 576 else 128
    cuda_lowering.compile_for_h200(_engine_fn(g, False), *_engine_args(m, k, n, g, False))


def _ptxas_report(log: str) -> tuple[int, int]:
    """(registers, spill store bytes) of the int4_matmul entry in a ptxas -v log."""
    import re
    part = log.split("Compiling entry function 'int4_matmul'")[1]
    return (int(re.search(r"Used (\d+) registers", part).group(1)),
            int(re.search(r"(\d+) bytes spill stores", part).group(1)))


@pytest.mark.parametrize("m,k,n", ENGINE_GRID + [(32, 4096, 4096)])
def test_tile_choices_compile_without_spills(m, k, n, tmp_path):
    """sm_90a compile of each default tile choice (bf16 activations, the GPU format):
    ptxas reports 0 spilled bytes and at most 255 registers (docs/perf_kernels.md lists them)."""
    from jaxserve.tools import deviceless
    reason = deviceless.unavailable_reason() or (
        None if deviceless.cuda_root() else "no CUDA toolkit with ptxas")
    if reason:
        pytest.skip(reason)
    g = int4_group_size(k)
    s = jax.ShapeDtypeStruct
    args = [s((m, k), jnp.bfloat16), s((k // 2, n), jnp.uint8),
            s((k // g, n), jnp.bfloat16), s((k // g, n), jnp.float32)]  # the GPU format
    out = deviceless.compile_for_h200(
        lambda x, p, sc, o: int4_matmul(x, p, sc, o, group_size=g), args, dump_dir=tmp_path)
    registers, spilled = _ptxas_report(out.ptxas_log)
    assert spilled == 0 and registers <= 255, (pick_blocks(m, k, n, g), registers, spilled)


def test_unpacking_ptx_per_packed_byte(tmp_path):
    """The main loop at 16 x 4096 x 4096 (bf16, default blocks) spends < 3.5 bit operations
    (and/or/shr/shl/prmt/bfe, bf16 adds/conversions, byte loads) per packed byte and converts
    no integer to a float: 2.81 now; the byte-at-a-time unpacking before it took 7.06
    (scripts/int4_ptx_report.py, docs/perf_kernels.md)."""
    import re
    from jaxserve.tools import deviceless, ptx_loop
    reason = deviceless.unavailable_reason() or (
        None if deviceless.cuda_root() else "no CUDA toolkit with ptxas")
    if reason:
        pytest.skip(reason)
    m, k, n, g = 16, 4096, 4096, 128
    s = jax.ShapeDtypeStruct
    args = [s((m, k), jnp.bfloat16), s((k // 2, n), jnp.uint8),
            s((k // g, n), jnp.bfloat16), s((k // g, n), jnp.float32)]
    deviceless.compile_for_h200(lambda x, p, sc, o: int4_matmul(x, p, sc, o, group_size=g),
                                args, dump_dir=tmp_path, keep_ptx=True)
    body = ptx_loop.kernel_body(ptx_loop.entry_ptx(tmp_path, "int4_matmul"), "int4_matmul")
    loop, looped = ptx_loop.main_loop(body)
    assert looped
    ops = ptx_loop.opcodes(loop)
    _, bn, bk, _ = pick_blocks(m, k, n, g)
    per_thread = (bk // 2) * bn / ptx_loop.threads_per_block(body)  # packed bytes per iteration
    bit_ops = sum(c for op, c in ops.items()
                  if re.match(r"^(and|or|shr|shl|prmt|bfe)\.|^add\.rn\.bf16|^ld\.shared\.b8", op))
    assert bit_ops / per_thread < 3.5, (bit_ops, per_thread, ops)
    assert not [op for op in ops if op.startswith("cvt.rn.bf16") or op.startswith("cvt.rn.f32.u")]
