"""The fused linear (pallas_kernels/fused_linear.py): the kernel (interpreted, and compiled on a
GPU: the `interpret` fixture) against its jax.numpy reference and both against a float64 numpy
computation; argument checks; the CUDA lowering and the sm_90a compile of the engine's calls
(registers, no spills).

Tolerances: pallas_kernels/cases.py (FUSED_LINEAR_TOLERANCE).
Grid: M {1, 5, 16, 37, 64} x kind {qkv (norm, three weights, biases), qkv_rope (and RoPE on q
and k, head_dim 64 or 128), gated (norm, gate/up, SiLU), residual, plain, lm_head (norm, rows
gathered, f32 out), head (that, tied: the weight transposed)} x (K, widths) x {f32, bf16}, a
subset covering every value of each axis (the full product is 140 interpreted kernels).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.cases import (FUSED_LINEAR_HEAD_DIM, FUSED_LINEAR_SHAPES,
                                  FUSED_LINEAR_TOLERANCE, fused_linear_case, fused_linear_numpy)
from pallas_kernels.fused_linear import (MAX_ROWS, default_block_n, fused_linear,
                                         fused_linear_reference)
from tests import cuda_lowering

F32, BF16 = jnp.float32, jnp.bfloat16
EPS = 1e-5

# (M, K, widths, kind, dtype); qkv_rope widths are heads of 64 (128 where marked by the width)
CASES = [
    (1, 64, (64, 32, 32), "qkv", F32),
    (1, 576, (256, 128, 128), "qkv_rope", BF16),
    (5, 96, (128, 64, 64), "qkv_rope", F32),
    (37, 64, (512, 128, 128), "qkv_rope", BF16),
    (64, 64, (256, 128, 128), "qkv_rope", F32),
    (1, 576, (1536, 1536), "gated", BF16),
    (1, 96, (64,), "residual", BF16),
    (5, 576, (576, 192, 192), "qkv", BF16),
    (5, 64, (96, 96), "gated", F32),
    (16, 96, (32,), "plain", F32),
    (16, 576, (576,), "residual", F32),
    (37, 64, (64, 32, 32), "qkv", BF16),
    (37, 1536, (576,), "residual", BF16),
    (64, 96, (64, 64), "gated", BF16),
    (64, 64, (32, 32, 32), "plain", BF16),
    (64, 64, (64, 32, 32), "qkv", F32),
    (1, 576, (1536,), "head", BF16),
    (5, 64, (96,), "head", F32),
    (37, 96, (256,), "lm_head", BF16),
    (64, 64, (64,), "head", BF16),
]


def _ids(case) -> str:
    m, k, widths, kind, dtype = case
    return f"M{m}-K{k}-{'+'.join(map(str, widths))}-{kind}-{jnp.dtype(dtype).name}"


def _assert_within(got, want, mag, dtype):
    got = np.asarray(np.asarray(got, np.float32), np.float64)
    assert got.shape == want.shape and np.isfinite(got).all()
    bound = FUSED_LINEAR_TOLERANCE[jnp.dtype(dtype).name] * mag
    err = np.abs(got - want)
    assert (err <= bound).all(), (f"max err {err.max():.3g}, worst err / bound "
                                  f"{(err / bound).max():.3g}")


def _case(case) -> dict:
    m, k, widths, kind, dtype = case
    head_dim = 128 if kind == "qkv_rope" and widths[0] % 128 == 0 and widths[0] >= 512 else 64
    return fused_linear_case(m + k, m=m, k=k, widths=widths, kind=kind, dtype=dtype,
                             head_dim=head_dim)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_kernel_matches_reference_and_numpy(case, interpret):
    args, dtype = _case(case), case[-1]
    got = fused_linear(**args, eps=EPS, interpret=interpret)
    assert got.dtype == (F32 if case[3].endswith("head") else dtype)
    want, mag = fused_linear_numpy(**args, eps=EPS)
    _assert_within(got, want, mag, dtype)
    ref = fused_linear_reference(**args, eps=EPS)
    _assert_within(got, np.asarray(np.asarray(ref, np.float32), np.float64), mag, dtype)


def test_reference_matches_numpy_over_the_grid():
    """The reference on every case at once (no kernel): its contract is numpy's."""
    for case in CASES:
        args = _case(case)
        want, mag = fused_linear_numpy(**args, eps=EPS)
        _assert_within(fused_linear_reference(**args, eps=EPS), want, mag, case[-1])


@pytest.mark.parametrize("wrong", ["half the residual", "no norm", "no rope", "rope swapped"])
def test_the_bound_sees_the_errors_it_guards_against(wrong):
    """A wrong residual, norm or rotation fails the bound."""
    kind = "residual" if wrong == "half the residual" else "qkv_rope"
    args = fused_linear_case(3, m=5, k=64, widths=(128, 64, 64) if kind != "residual"
                             else (64,), kind=kind, dtype=BF16)
    want, mag = fused_linear_numpy(**args, eps=EPS)
    bad = dict(args)
    if wrong == "half the residual":
        bad["residual"] = args["residual"] * 0.5
    elif wrong == "no norm":
        bad["norm_scale"] = None
    elif wrong == "no rope":
        bad["rope_weights"] = 0
    else:  # the partner's sign flipped: rotation the other way
        bad["positions"] = -args["positions"]
    with pytest.raises(AssertionError):
        _assert_within(fused_linear_reference(**bad, eps=EPS), want, mag, BF16)


@pytest.mark.parametrize("bad,message", [
    (dict(rope_weights=1, widths=(48, 32)), "whole heads"),
    (dict(m=MAX_ROWS + 1), "decode steps"),
    (dict(widths=(40,)), "multiple of block_n"),
    (dict(k=72), "K divisible by 16"),
    (dict(activation="silu", widths=(32,)), "two weights of one shape"),
    (dict(activation="gelu"), "activation must be one of"),
    (dict(activation="silu", out_dtype=jnp.bfloat16), "for plain calls"),
    (dict(x_rows=jnp.zeros((2, 1), jnp.int32)), "x_rows must be"),
    (dict(x_rows=jnp.zeros((MAX_ROWS + 1,), jnp.int32)), "decode steps"),
    (dict(transposed=True), "weights must be \\[N, K=64\\]"),
])
def test_bad_arguments_are_refused_with_the_reason(bad, message):
    m, k, widths = bad.get("m", 4), bad.get("k", 64), bad.get("widths", (32, 32))
    x = jnp.ones((m, k), F32)
    w = tuple(jnp.ones((k, n), F32) for n in widths)
    rope = dict(positions=jnp.zeros((m,), jnp.int32), inv_freq=jnp.ones((16,), F32),
                rope_weights=bad["rope_weights"]) if "rope_weights" in bad else {}
    extra = {key: bad[key] for key in ("x_rows", "out_dtype", "transposed") if key in bad}
    with pytest.raises(ValueError, match=message):
        fused_linear(x, w, activation=bad.get("activation"), interpret=True, **rope, **extra)


def test_block_n_fills_an_h200():
    """32 columns a program where that still gives two programs per SM, else 16."""
    assert default_block_n((14336, 14336), gated=True) == 32  # 448 programs
    assert default_block_n((4096, 1024, 1024)) == 16  # 384 programs (192 at 32)
    assert default_block_n((8192, 8192), gated=True) == 16  # 512 programs (256 at 32)
    assert default_block_n((576, 192, 192)) == 16


# ---- GPU: CUDA lowering and sm_90a compile ----------------------------------------------------

def _h200_args(m, k, widths, kind, head_dim):
    """(the kernel's array arguments as ShapeDtypeStructs, its static keywords)."""
    sd, b = jax.ShapeDtypeStruct, BF16
    gated, rope = kind == "gated", kind == "qkv_rope"
    head, tied = kind.endswith("head"), kind == "head"
    n_out = widths[0] if gated else sum(widths)
    arrays = (sd((m, k), b), tuple(sd((n, k) if tied else (k, n), b) for n in widths),
              sd((k,), b) if kind != "residual" else None,
              tuple(sd((n,), b) for n in widths) if rope else None,
              sd((m, n_out), b) if kind == "residual" else None,
              sd((m,), jnp.int32) if rope else None,
              sd((head_dim // 2,), jnp.float32) if rope else None,
              sd((m,), jnp.int32) if head else None)
    static = dict(activation="silu" if gated else None, rope_weights=2 if rope else 0)
    if head:
        static.update(transposed=tied, out_dtype=jnp.float32)
    return arrays, static


def _fn(static):
    return lambda *a: fused_linear(*a, eps=EPS, **static)


def test_kernel_lowers_for_cuda():
    """The 8B's q/k/v at batch 1 lowers to one Triton call of 4096 + 2 x 1024 columns (q and
    k rotated: a program per 16-column pair of half-heads, v a program per 16 columns), and
    nothing but the call (no pad, no norm, no RoPE, no dot left to XLA)."""
    arrays, static = _h200_args(1, 4096, (4096, 1024, 1024), "qkv_rope", 128)
    text = cuda_lowering.lower_for_h200(_fn(static), *arrays)
    calls = re.findall(r"custom_call @__gpu\$xla\.gpu\.triton.*", text)
    assert len(calls) == 1 and 'name = "fused_linear"' in calls[0]
    assert "grid_x = 224 : i32, grid_y = 1 : i32" in calls[0]  # (4096 + 1024) / 32 + 1024 / 16
    assert not re.search(r"stablehlo\.(pad|dot_general|reduce|rsqrt|cosine|sine)\b", text)


def test_head_lowers_for_cuda_as_one_call():
    """SmolLM2's tied head at batch 64: the rows' gather, the final norm and the dot against
    the embedding as stored `[V, D]` are one Triton call of V / 32 programs returning f32
    logits; no gather, transpose, norm or dot left to XLA."""
    arrays, static = _h200_args(64, 576, (49152,), "head", 64)
    text = cuda_lowering.lower_for_h200(_fn(static), *arrays)
    calls = re.findall(r"custom_call @__gpu\$xla\.gpu\.triton.*", text)
    assert len(calls) == 1 and "grid_x = 1536 : i32" in calls[0]
    assert "-> tensor<64x49152xf32>" in calls[0]
    assert not re.search(r"stablehlo\.(gather|transpose|dot_general|reduce|rsqrt)\b", text)


@pytest.mark.parametrize("model", sorted(FUSED_LINEAR_SHAPES))
@pytest.mark.parametrize("m", [1, MAX_ROWS])
def test_engine_calls_compile_for_h200_without_spills(model, m, tmp_path):
    """sm_90a compile of each fused call an engine makes for `model` (ptxas -v through the
    deviceless compiler's wrapper): at most 255 registers, 0 bytes spilled."""
    from jaxserve.tools import compiled_report, deviceless
    why = deviceless.unavailable_reason()
    if why:
        pytest.skip(why)
    for k, widths, kind in FUSED_LINEAR_SHAPES[model]:
        arrays, static = _h200_args(m, k, widths, kind, FUSED_LINEAR_HEAD_DIM[model])
        out = deviceless.compile_for_h200(_fn(static), list(arrays), dump_dir=tmp_path / kind)
        if out.ptxas_note:
            pytest.skip(f"no ptxas report: {out.ptxas_note}")
        kernel = compiled_report.ptxas_kernels(out.ptxas_log)["fused_linear"]
        assert kernel["registers"] <= 255 and kernel["spill_bytes"] == 0, (kind, kernel)
