"""The multi-LoRA delta (pallas_kernels/lora.py, jaxserve/runtime/lora.py): the SGMV kernel
(interpreted, and compiled on a GPU: the `interpret` fixture) and the tiled XLA path against the
per-row reference, the reference against a float64 numpy loop; the runtime wrapper on unsorted
token slots; the CUDA lowering and sm_90a compile.

Tolerances: pallas_kernels/cases.py (LORA_TOLERANCE, shared with scripts/gpu_check.py).
Grid: a hand-picked subset of M {1, 5, 16, 37, 128} x S {1, 3, 4} x R {8, 16, 32} x (K, N)
{(64, 96), (96, 32), (576, 192)} x {f32, bf16} covering every value of each axis, with empty
slots, all rows in one slot (first, middle, last), rows of no adapter after the slots, and no
adapter at all; the full product (270 interpreted kernels) is left out for time. Rows of no
adapter and the weights of empty slots are NaN, so a stray read shows.
"""

from __future__ import annotations

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runtime.lora import kernel_lora_delta, sort_by_slot, xla_lora_delta_reference
from pallas_kernels.cases import lora_case, lora_error_bound, lora_row_slots
from pallas_kernels.lora import (lora_sgmv, lora_sgmv_reference, lora_sgmv_xla, padded_rank,
                                 pick_splits)
from pallas_kernels.grouped_matmul import num_items
from tests import cuda_lowering

F32, BF16 = jnp.float32, jnp.bfloat16

# (group sizes, rows of no adapter after them, R, K, N, dtype)
CASES = [
    ([1], 0, 8, 64, 96, F32),                      # M=1
    ([0], 1, 16, 96, 32, BF16),                    # M=1, no adapter: zeros
    ([0, 5, 0], 0, 16, 96, 32, BF16),              # M=5, all rows in the middle slot
    ([2, 0, 1], 2, 32, 64, 96, F32),               # M=5, an empty slot, trailing rows
    ([4, 4, 4, 4], 0, 16, 576, 192, F32),          # M=16, one tile shared by four slots
    ([0, 0, 0, 16], 0, 8, 96, 32, BF16),           # M=16, all rows in the last slot
    ([10, 0, 7, 15], 5, 32, 64, 96, BF16),         # M=37, slot boundaries inside tiles
    ([37], 0, 16, 576, 192, BF16),                 # M=37, one slot
    ([0, 0, 0], 37, 16, 64, 96, F32),              # M=37, no adapter at all
    ([50, 0, 60], 18, 8, 576, 192, BF16),          # M=128, trailing rows
    ([30, 33, 0, 34], 31, 32, 96, 32, F32),        # M=128, an empty slot, trailing rows
    ([128, 0, 0, 0], 0, 32, 576, 192, F32),        # M=128, all rows in the first slot
]


def _ids(case) -> str:
    sizes, extra, r, k, n, dtype = case
    return f"{sizes}+{extra}-R{r}-{k}x{n}-{jnp.dtype(dtype).name}"


def _numpy_lora(x, a, b, slots, dtype) -> np.ndarray:
    """float64 per-slot loop; h rounded to bf16 for bf16 inputs (the contract); rows of slot -1
    are zeros."""
    x64, a64, b64 = (np.asarray(np.asarray(v, np.float32), np.float64) for v in (x, a, b))
    out = np.zeros((x64.shape[0], b64.shape[2]))
    for g in np.unique(slots[slots >= 0]):
        rows = slots == g
        h = x64[rows] @ a64[g]  # [rows, R]
        if dtype == BF16:
            h = np.asarray(h.astype(np.float32).astype(jnp.bfloat16), np.float64)
        out[rows] = h @ b64[g]
    return out


def _assert_within(got, x, a, b, slots, want, dtype):
    got = np.asarray(got)
    assert got.dtype == np.float32 and got.shape == want.shape
    assert np.isfinite(got).all()
    err = np.abs(got.astype(np.float64) - want)
    bound = lora_error_bound(x, a, b, slots, want, dtype)
    worst = (err / bound).max()
    assert (err <= bound).all(), f"max err {err.max():.3g}, worst err / bound {worst:.3g}"
    assert not got[slots < 0].any()  # rows of no adapter: exact zeros


def _case(case, seed=0):
    sizes, extra, r, k, n, dtype = case
    x, a, b, gs = lora_case(seed, sizes=sizes, rank=r, k=k, n=n, dtype=dtype,
                            extra_rows=extra)
    return x, a, b, gs, lora_row_slots(sizes, x.shape[0]), dtype


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_kernel_matches_reference(case, interpret):
    x, a, b, gs, slots, dtype = _case(case)
    want = np.asarray(lora_sgmv_reference(x, a, b, gs), np.float64)
    _assert_within(lora_sgmv(x, a, b, gs, interpret=interpret), x, a, b, slots, want, dtype)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_xla_path_and_reference_match_numpy(case):
    """The reference against an independent float64 loop, and the XLA fallback (at the tile
    the runtime gives it) against the reference."""
    x, a, b, gs, slots, dtype = _case(case)
    ref = lora_sgmv_reference(x, a, b, gs)
    _assert_within(ref, x, a, b, slots, _numpy_lora(x, a, b, slots, dtype), dtype)
    want = np.asarray(ref, np.float64)
    _assert_within(lora_sgmv_xla(x, a, b, gs), x, a, b, slots, want, dtype)


@pytest.mark.parametrize("blocks,dtype", [
    (dict(block_k=16, block_n=16, splits=2), F32),   # 4 K steps, 3 N steps per program
    (dict(tm=32, block_n=32, splits=1), BF16),       # taller tiles, 3 N steps
], ids=["k16-n16-split2-f32", "tm32-n32-bf16"])
def test_kernel_blocks_and_splits(blocks, dtype):
    """Loops the default blocks skip: several K blocks in the shrink, several N blocks per
    program, programs splitting an item's columns, taller tiles; R = 5 padded to 16."""
    x, a, b, gs, slots, _ = _case(([9, 0, 20, 3], 4, 5, 64, 96, dtype), seed=3)
    want = np.asarray(lora_sgmv_reference(x, a, b, gs), np.float64)
    _assert_within(lora_sgmv(x, a, b, gs, interpret=True, **blocks), x, a, b, slots, want,
                   dtype)


def test_xla_path_takes_shapes_the_kernel_cannot():
    """K = 40, N = 24 (not multiples of 16), R = 5: the kernel refuses, the XLA path runs (in
    one-row and 4-row tiles; boundaries inside tiles)."""
    x, a, b, gs, slots, dtype = _case(([3, 0, 6], 2, 5, 40, 24, F32), seed=4)
    with pytest.raises(ValueError, match="multiples of 16"):
        lora_sgmv(x, a, b, gs, interpret=True)
    want = _numpy_lora(x, a, b, slots, dtype)
    for tm in (1, 4):
        _assert_within(lora_sgmv_xla(x, a, b, gs, tm=tm), x, a, b, slots, want, dtype)


def test_rank_padding_and_splits_are_powers_of_two():
    assert [padded_rank(r) for r in (1, 8, 16, 24, 32, 64)] == [16, 16, 16, 32, 32, 64]
    assert pick_splits(1, 12) == 4          # one item: as many programs as N blocks allow
    assert pick_splits(19, 12) == 4         # ceil(132 / 19) = 7 -> 4
    assert pick_splits(40, 12) == 4 and pick_splits(70, 12) == 2 and pick_splits(200, 12) == 1
    assert pick_splits(1, 3) == 1           # 3 blocks: only 1 divides


# ---- the runtime wrapper: tokens in any order ---------------------------------------------------

def _tokens(t, s, r, k, n, dtype, seed):
    """x [T, K], a, b and unsorted token_slots [T] in -1..S-1 (some slots unused)."""
    rng = np.random.default_rng(seed)
    slots = rng.integers(-1, s, size=t).astype(np.int32)
    x, a, b, _ = lora_case(seed, sizes=[t], rank=r, k=k, n=n, dtype=dtype, nan_unused=False)
    a = jnp.concatenate([a] * s) * jnp.arange(1, s + 1, dtype=dtype)[:, None, None]
    b = jnp.concatenate([b] * s)
    x = jnp.where(jnp.asarray(slots >= 0)[:, None], x, jnp.nan)  # no-adapter tokens unread
    return x, a, b, jnp.asarray(slots)


@pytest.mark.parametrize("t,s,r,k,n,dtype", [(37, 4, 16, 64, 96, F32), (16, 3, 8, 96, 32, BF16)])
def test_wrapper_matches_per_token_reference(t, s, r, k, n, dtype):
    x, a, b, slots = _tokens(t, s, r, k, n, dtype, seed=t)
    ns = np.asarray(slots)
    assert (ns == -1).any() and not np.all(np.diff(ns) >= 0)  # unsorted, with no-adapter tokens
    want = _numpy_lora(x, a, b, ns, dtype)
    ref = xla_lora_delta_reference(x, a, b, slots)
    _assert_within(ref, x, a, b, ns, want, dtype)
    got = jax.jit(kernel_lora_delta(interpret=True))(x, a, b, slots)
    _assert_within(got, x, a, b, ns, np.asarray(ref, np.float64), dtype)


def test_wrapper_falls_back_to_xla_with_a_log_line(caplog):
    x, a, b, slots = _tokens(11, 3, 8, 40, 24, F32, seed=5)
    ns = np.asarray(slots)
    with caplog.at_level(logging.INFO, logger="jaxserve"):
        got = kernel_lora_delta(interpret=True)(x, a, b, slots)
    assert "LoRA kernel cannot run [40] x [24]" in caplog.text
    _assert_within(got, x, a, b, ns, _numpy_lora(x, a, b, ns, F32), F32)


def test_sort_by_slot_is_stable_and_puts_no_adapter_last():
    order, sizes = sort_by_slot(jnp.asarray([2, -1, 0, 2, 7, 0, -1, 1], jnp.int32), 3)
    assert np.asarray(order).tolist() == [2, 5, 7, 0, 3, 1, 4, 6]  # slot 7 >= S: no adapter
    assert np.asarray(sizes).tolist() == [2, 1, 2]


# ---- GPU: CUDA lowering and sm_90a compile ----------------------------------------------------

def _h200_args(m, s, r, k, n, dtype):
    sd = jax.ShapeDtypeStruct
    return [sd((m, k), dtype), sd((s, k, r), dtype), sd((s, r, n), dtype), sd((s,), jnp.int32)]


def test_kernel_lowers_for_cuda():
    """The engine-sized case (SmolLM2's up projection, a 256-token batch over 4 adapters,
    rank 16, bf16) lowers to one Triton call (no GPU, no plugin needed)."""
    text = cuda_lowering.lower_for_h200(lambda *a: lora_sgmv(*a),
                                        *_h200_args(256, 4, 16, 576, 1536, BF16))
    calls = re.findall(r"custom_call @__gpu\$xla\.gpu\.triton.*", text)
    assert len(calls) == 1 and 'name = "lora_sgmv"' in calls[0]
    # num_items: 16 tiles of 16 rows + S - 1 = 19 items, x 4 splits of the 12 column blocks
    assert "grid_x = 19 : i32, grid_y = 4 : i32" in calls[0]


@pytest.mark.parametrize("m,s,r,k,n,dtype", [(256, 4, 16, 576, 1536, BF16),
                                             (512, 4, 64, 1536, 576, F32)])
def test_kernel_compiles_for_h200(m, s, r, k, n, dtype):
    """sm_90a compile (the engine-sized bf16 case; the largest tiles, a prefill-sized batch in
    64-row tiles at rank 64 in f32, against the shared-memory and register limits): one Triton
    call over [num_items, tm, N], and no dot left to XLA."""
    reason = cuda_lowering.cuda_compiler_available()
    if reason:
        pytest.skip(reason)
    compiled = cuda_lowering.compile_for_h200(lambda *a: lora_sgmv(*a),
                                              *_h200_args(m, s, r, k, n, dtype))
    text = compiled.as_text()
    tm = 16 if m <= 256 else 64
    assert re.search(rf"f32\[{num_items(m, s, tm)},{tm},{n}\][^\n]*custom-call", text)
    assert not re.search(r"\bdot\(", text)
