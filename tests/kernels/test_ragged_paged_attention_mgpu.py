"""Mosaic GPU ragged paged attention (pallas_kernels/ragged_paged_attention_mgpu.py): in the GPU
interpreter with race detection against the float64 oracle and the jnp reference of the Triton
kernel's tests (NaN in every cache slot no row may read), the detector shown catching a race,
int8 caches against the oracle on the dequantized cache, clear refusals, and sm_90a lowering /
deviceless compiles for the engine's shapes."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import jax.experimental.pallas.mosaic_gpu as plgpu
import numpy as np
import pytest

from pallas_kernels.cases import (ATTENTION_MODELS, RAGGED_ENGINE_STEPS, attention_tolerance,
                                  quantize_kv_np, ragged_engine_shapes)
from pallas_kernels.mosaic_interpret import POOL_ENV, POOL_THREADS, interpret_stall
from pallas_kernels.ragged_paged_attention_mgpu import (cost, ragged_paged_attention_mgpu,
                                                        unsupported)
from pallas_kernels.ragged_paged_attention_reference import ragged_paged_attention_reference
from tests.cuda_lowering import compile_for_h200, cuda_compiler_available, lower_for_h200
import test_ragged_paged_attention as rpa

INTERPRET = plgpu.InterpretGPUParams(detect_races=True)
RACE = "RACE DETECTED"
LAYER = rpa.LAYER
BF16 = jnp.bfloat16

# Rows longer than a 64-query tile, starting off the 8-token grid the q box is aligned to;
# and with a padding row (0, 0) before the last row.
LONG = dict(rows=[(1, 5), (70, 90), (3, 12)], head=5, tail=2)
LONG_PADDED = dict(rows=[(1, 5), (70, 90), (0, 0), (3, 12)], head=5, tail=2)

# (head_dim, block_size, group, mix): a cover of the axes (each interpreted case costs seconds).
CASES = [
    (64, 16, 1, "mixed"),
    (128, 32, 3, "mixed"),
    (64, 64, 4, "decode"),
    (128, 16, 4, "prefill"),
    (64, 128, 3, "mixed"),
    (64, 32, 3, LONG),
    (64, 32, 1, LONG_PADDED),
    (64, 32, 3, LONG_PADDED),
]


# G >= 3 runs 4+ warpgroup threads per program, which the GPU interpreter runs only where
# XLA:CPU's pool has as many threads (pallas_kernels/mosaic_interpret.py). Where this
# process's pool is smaller (NPROC is not set for the whole suite: the engine sizes its own
# pool, runtime/host_cores.py), they are skipped here and run together in a subprocess with
# NPROC set (test_many_warpgroup_cases_in_a_wide_pool). The sm_90a compiles run everywhere.
NARROW_POOL = interpret_stall(True, 4)
MANY_WARPGROUPS = (pytest.mark.many_warpgroups,
                   pytest.mark.skipif(NARROW_POOL is not None,
                                      reason=f"{NARROW_POOL} (run in a subprocess)"))


def many_warpgroups(test):
    for mark in MANY_WARPGROUPS:
        test = mark(test)
    return test


def interpreted(case, group):
    return pytest.param(case, marks=MANY_WARPGROUPS) if group >= 3 else case


def case_id(case):
    names = {id(LONG): "long", id(LONG_PADDED): "long_padded"}
    return "-".join(names.get(id(x), str(x)) for x in case)


def run(q, k, v, pt, qs, cl, capfd, **kw):
    out = ragged_paged_attention_mgpu(q, k, v, jnp.int32(LAYER), pt, qs, cl,
                                      interpret=INTERPRET, **kw)
    out = jax.block_until_ready(out)
    assert RACE not in capfd.readouterr().out
    return out


@pytest.mark.parametrize("case", [interpreted(c, c[2]) for c in CASES], ids=case_id)
def test_matches_oracle_without_races(case, capfd):
    head_dim, block_size, group, mix = case
    q, k, v, pt, qs, cl = rpa.make_case(0, dtype=BF16, block_size=block_size, group=group,
                                        head_dim=head_dim, mix=mix)
    out = run(q, k, v, pt, qs, cl, capfd)
    rpa.check(out, (q, k, v, LAYER, pt, qs, cl), BF16)  # tokens of no row: zeros


@pytest.mark.parametrize("block_size,group", [pytest.param(16, 3, marks=MANY_WARPGROUPS),
                                              (64, 1)])
def test_window_and_softcap_match_reference(block_size, group, capfd):
    q, k, v, pt, qs, cl = rpa.make_case(1, dtype=BF16, block_size=block_size, group=group,
                                        head_dim=64, mix=LONG)
    kw = dict(window=jnp.int32(19), softcap=20.0)
    out = run(q, k, v, pt, qs, cl, capfd, **kw)
    ref = ragged_paged_attention_reference(q, k, v, LAYER, pt, qs, cl, **kw)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               **attention_tolerance(BF16))
    plain = ragged_paged_attention_reference(q, k, v, LAYER, pt, qs, cl)
    assert not np.allclose(np.asarray(out, np.float32), np.asarray(plain, np.float32),
                           **attention_tolerance(BF16))  # the window really cuts


@many_warpgroups
def test_queries_packed_with_other_heads(capfd):
    # q as the first H of Hq heads per token ([q | k | v]); the others are NaN.
    q, k, v, pt, qs, cl = rpa.make_case(7, dtype=BF16, block_size=16, group=3, head_dim=64,
                                        mix="mixed")
    extra = jnp.full((q.shape[0], 2 * rpa.NUM_KV_HEADS, q.shape[2]), jnp.nan, q.dtype)
    packed = jnp.concatenate([q, extra], axis=1)  # [T, H + 2K, Dh]
    out = run(packed, k, v, pt, qs, cl, capfd, num_heads=q.shape[1])
    rpa.check(out, (q, k, v, LAYER, pt, qs, cl), BF16)


@pytest.mark.parametrize("group", [1, pytest.param(3, marks=MANY_WARPGROUPS)])
def test_padding_and_garbage_table_entries(group, capfd):
    # A step of padding rows only gives zeros; table entries past each context point far
    # outside the cache (pages are read only below each tile's causal bound).
    spec = dict(rows=[(0, 0), (0, 5), (0, 0)], head=2, tail=3)
    q, k, v, pt, qs, cl = rpa.make_case(2, dtype=BF16, block_size=16, group=group,
                                        head_dim=64, mix=spec)
    np.testing.assert_array_equal(np.asarray(run(q, k, v, pt, qs, cl, capfd),
                                             np.float32), 0.0)
    spec = dict(rows=[(1, 1), (3, 20), (0, 0), (5, 40)], head=1, tail=0)
    q, k, v, pt, qs, cl = rpa.make_case(4, dtype=BF16, block_size=16, group=group,
                                        head_dim=64, mix=spec)
    garbage = np.asarray(pt).copy()
    garbage[0, 1:] = 10**6
    garbage[1, 2:] = -7
    garbage[2, :] = 10**6
    garbage[3, 3:] = k.shape[1]
    out = run(q, k, v, jnp.asarray(garbage), qs, cl, capfd)
    rpa.check(out, (q, k, v, LAYER, pt, qs, cl), BF16)


# ---- int8 caches ------------------------------------------------------------------------------

# (head_dim, block_size, group, mix, KV heads): 3 KV heads is SmolLM2's count, whose page slab
# of scales (BS x 3) is not a multiple of the 128 bytes a copy moves (read rounded up: the
# cache's last slab's read runs past the array's end); at block 128 it takes two copies.
INT8_CASES = [
    (64, 16, 1, "mixed", 2),
    (64, 16, 1, "mixed", 3),
    (128, 32, 3, "mixed", 2),
    (64, 64, 4, "decode", 2),
    (128, 16, 4, "prefill", 2),
    (64, 128, 1, "decode", 3),
    (64, 32, 3, LONG_PADDED, 3),
]


def int8_case(seed, head_dim, block_size, group, mix, kv_heads):
    """The NaN-filled float case (context in LAYER, the cache's last block among the pages
    read) as an int8 cache: q bf16, (codes, scales) with NaN scales and code -128 in every
    slot no row may read, and the dequantized float64 caches for the oracle."""
    q, k, v, pt, qs, cl = rpa.make_case(seed, dtype=jnp.float32, block_size=block_size,
                                        group=group, head_dim=head_dim, mix=mix,
                                        num_kv_heads=kv_heads)
    k, v, pt = (np.asarray(x).copy() for x in (k, v, pt))
    # Swap the first row's first page with the cache's last block (layer 1 of 2: the flat
    # scales' last slab), whose rounded-up read runs past the scales' end.
    first = pt[np.asarray(cl) > 0][0, 0]
    last = k.shape[1] - 1
    for x in (k, v):
        x[:, [first, last]] = x[:, [last, first]]
    pt = np.where(pt == first, last, np.where(pt == last, first, pt))
    (kc, ks, kd), (vc, vs, vd) = quantize_kv_np(k), quantize_kv_np(v)
    codes = tuple(jnp.asarray(x) for x in (kc, vc, ks, vs))
    return q.astype(BF16), codes, (kd, vd), (jnp.asarray(pt), qs, cl)


def int8_case_id(case):
    return case_id(case[:4]) + f"-kv{case[4]}"


@pytest.mark.parametrize("case", [interpreted(c, c[2]) for c in INT8_CASES], ids=int8_case_id)
def test_int8_cache_matches_oracle_on_dequantized_cache(case, capfd):
    q, (kc, vc, ks, vs), (kd, vd), (pt, qs, cl) = int8_case(0, *case)
    out = run(q, kc, vc, pt, qs, cl, capfd, k_scale=ks, v_scale=vs)
    rpa.check(out, (q, kd, vd, LAYER, pt, qs, cl), BF16)


def test_int8_window_and_softcap_match_int8_reference(capfd):
    q, (kc, vc, ks, vs), _, (pt, qs, cl) = int8_case(1, 64, 16, 1, LONG, 3)
    kw = dict(window=jnp.int32(19), softcap=20.0, k_scale=ks, v_scale=vs)
    out = np.asarray(run(q, kc, vc, pt, qs, cl, capfd, **kw), np.float32)
    ref = np.asarray(ragged_paged_attention_reference(q, kc, vc, LAYER, pt, qs, cl, **kw),
                     np.float32)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, **attention_tolerance(BF16))


def test_race_detector_catches_a_read_before_the_tma_lands(capfd):
    """The check above can fail: a kernel that reads the SMEM a TMA is writing without
    waiting on the barrier is reported."""
    def racy(x_ref, o_ref, smem, bar):
        plgpu.copy_gmem_to_smem(x_ref, smem, bar)
        smem[...] = smem[...] + 1.0  # no barrier_wait
        plgpu.barrier_wait(bar)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(smem, o_ref)
        plgpu.wait_smem_to_gmem(0)
    f = plgpu.kernel(racy, out_type=jax.ShapeDtypeStruct((128,), jnp.float32),
                     scratch_types=[plgpu.SMEM((128,), jnp.float32), plgpu.Barrier()],
                     interpret=INTERPRET)
    jax.block_until_ready(f(jnp.ones((128,), jnp.float32)))
    assert RACE in capfd.readouterr().out


def test_refusals():
    q, k, v, pt, qs, cl = rpa.make_case(5, dtype=BF16, block_size=16, group=1, head_dim=64,
                                        mix="decode")
    call = functools.partial(ragged_paged_attention_mgpu, layer=LAYER, page_table=pt,
                             query_start=qs, context_lens=cl, interpret=INTERPRET)
    codes = jnp.zeros(k.shape, jnp.int8)
    scale = jnp.ones(k.shape[:-1], jnp.float32)
    with pytest.raises(ValueError, match="q must be bfloat16"):
        call(q.astype(jnp.float32), codes, codes, k_scale=scale, v_scale=scale)
    with pytest.raises(ValueError, match="needs its k_scale and v_scale"):
        call(q, codes, codes)
    with pytest.raises(ValueError, match="q must be bfloat16"):
        call(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32))
    with pytest.raises(ValueError, match="bfloat16 or int8, got float16"):
        call(q, k.astype(jnp.float16), v.astype(jnp.float16))
    with pytest.raises(ValueError, match="incompatible shapes"):
        call(q, k, v[..., :32])
    with pytest.raises(ValueError, match="block size 8"):
        call(q, k.reshape(2, -1, 8, *k.shape[3:]), v.reshape(2, -1, 8, *v.shape[3:]))
    assert "at most 4" in unsupported(64, 8, 128, 16, BF16)
    assert "head_dim 96" in unsupported(8, 2, 96, 16, BF16)
    assert "shared memory" in unsupported(32, 8, 128, 128, BF16)  # 8B at pages of 128


@pytest.mark.parametrize("model", sorted(ATTENTION_MODELS))
def test_engine_shapes_are_supported(model):
    kv_heads, group, head_dim, _ = ATTENTION_MODELS[model]
    for block_size in (16, 32, 64):
        for kv_dtype in (BF16, jnp.int8):
            assert unsupported(kv_heads * group, kv_heads, head_dim, block_size, BF16,
                               kv_dtype) is None


def test_cost_counts_pages_and_queries():
    c = cost(num_tokens=64, num_rows=64, num_heads=32, num_kv_heads=8, head_dim=128,
             block_size=16, context_tokens=64 * 1024, query_key_pairs=64 * 1024)
    kv_bytes = 2 * 64 * 1024 * 8 * 128 * 2
    assert c["launches"] == 1 and kv_bytes < c["bytes"] < 1.01 * kv_bytes
    assert c["flops"] == 4 * 64 * 1024 * 32 * 128
    int8 = cost(num_tokens=64, num_rows=64, num_heads=32, num_kv_heads=8, head_dim=128,
                block_size=16, context_tokens=64 * 1024, int8=True)
    assert int8["bytes"] - (c["bytes"] - kv_bytes) == 2 * 64 * 1024 * 8 * (128 + 4)


# (tokens, rows): decode-shaped, a mixed prefill step, one decode row.
STEPS = RAGGED_ENGINE_STEPS


def engine_shapes(model, block_size, step, **kw):
    return ragged_engine_shapes(model, block_size, BF16, step, **kw)


@pytest.mark.parametrize("step", sorted(STEPS))
@pytest.mark.parametrize("model", sorted(ATTENTION_MODELS))
def test_lowers_for_sm90a(model, step):
    text = lower_for_h200(ragged_paged_attention_mgpu, *engine_shapes(model, 16, step))
    assert "mosaic_gpu" in text
    assert "stablehlo.while" not in text


@pytest.mark.parametrize("model,block_size,step,num_blocks,kw", [
    ("smollm2", 16, "mixed", 1024, {}),
    ("smollm2", 128, "decode", 1024, dict(softcap=30.0)),
    ("llama3_8b", 16, "decode", 1024, {}),
    ("llama3_8b", 64, "mixed", 1024, dict(window=jnp.int32(4096))),
    # A bf16 cache of 6.4 GB per K and V, as on an H200 serving the 8B model.
    ("llama3_8b", 16, "batch1", 6144, {}),
])
def test_compiles_for_sm90a(model, block_size, step, num_blocks, kw):
    why_not = cuda_compiler_available()
    if why_not:
        pytest.skip(why_not)
    fn = functools.partial(ragged_paged_attention_mgpu, **kw)
    compiled = compile_for_h200(fn, *engine_shapes(model, block_size, step,
                                                   num_blocks=num_blocks))
    assert compiled.as_text()


@pytest.mark.parametrize("model,block_size,step,num_blocks", [
    ("smollm2", 16, "mixed", 1024),
    ("smollm2", 128, "decode", 1024),     # a page's scales take two copies
    ("llama3_8b", 64, "mixed", 1024),     # one staging buffer fits in shared memory
    ("llama3_8b", 16, "batch1", 6144),
])
def test_int8_compiles_for_sm90a(model, block_size, step, num_blocks):
    why_not = cuda_compiler_available()
    if why_not:
        pytest.skip(why_not)
    q, k, v, *rest = engine_shapes(model, block_size, step, num_blocks=num_blocks)
    codes = jax.ShapeDtypeStruct(k.shape, jnp.int8)
    scales = jax.ShapeDtypeStruct(k.shape[:-1], jnp.float32)

    def fn(q, k, v, *rest):
        *rest, k_scale, v_scale = rest
        return ragged_paged_attention_mgpu(q, k, v, *rest, k_scale=k_scale, v_scale=v_scale)
    compiled = compile_for_h200(fn, q, codes, codes, *rest, scales, scales)
    assert "mosaic_gpu" in compiled.as_text()


def test_interpreter_skip_reads_xla_cpu_pool_size(monkeypatch):
    # The hang it guards: 4 warpgroups on a 2-thread pool (docs/gpu.md).
    monkeypatch.delenv("PORTABLE_NPROC", raising=False)
    monkeypatch.setenv("NPROC", "2")
    assert "NPROC=8" in interpret_stall(True, 4)
    assert interpret_stall(True, 2) is None
    assert interpret_stall(False, 5) is None  # compiled kernels always run
    monkeypatch.setenv("NPROC", "8")
    assert interpret_stall(True, 5) is None
    monkeypatch.setenv("PORTABLE_NPROC", "3")  # read first, as XLA:CPU reads it
    assert interpret_stall(True, 4) is not None


@pytest.mark.subprocess
@pytest.mark.timeout(1500)
@pytest.mark.skipif(NARROW_POOL is None, reason="this process's pool runs them in place")
def test_many_warpgroup_cases_in_a_wide_pool():
    env = {**os.environ, POOL_ENV: str(POOL_THREADS)}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "no:xdist", "-m", "many_warpgroups", __file__,
                           os.path.join(os.path.dirname(__file__), "test_kv_int8.py")],
                          env=env, capture_output=True, text=True, timeout=1400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, summary
