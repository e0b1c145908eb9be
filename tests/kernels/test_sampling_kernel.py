"""The sampling kernel (pallas_kernels/sampling.py), interpreted (and compiled on a GPU: the
`interpret` fixture), against its sort-based reference; its CUDA lowering and sm_90a compile
(registers, no spills).

Grid: V in {49152 (SmolLM2), 128256 (Llama 3), 5000 (not a multiple of the 4096 chunk), 300,
7 (one chunk narrower than the default)}; rows greedy, unfiltered draws, top-k (1, small,
deep, V - 1, >= V), top-p (0.5 .. 0.99, 1), min-p and their combinations; logits with many
ties (integers: ties at the cutoffs and in the top logprobs), -inf entries (a grammar's
bitmask), rows with fewer finite logits than top-k or the top logprobs; top logprobs wanted or
not. Tokens and top-logprob ids must match exactly; log-probabilities to float32 rounding
(the kernel's logsumexp is online and chunk-wise, the reference's XLA's two-pass one).
Cases and tolerance: pallas_kernels/cases.py (shared with scripts/gpu_check.py).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.cases import SAMPLING_LOGPROB_ATOL, SAMPLING_ROWS, sampling_case
from pallas_kernels.sampling import DEFAULT_CHUNK, sample_rows, sample_rows_reference
from tests import cuda_lowering

INF = float("inf")
ROWS = SAMPLING_ROWS
GREEDY = SAMPLING_ROWS[0]
_case = sampling_case


def _check(args, want_logprobs, num_logprobs, interpret, chunk=DEFAULT_CHUNK):
    got = sample_rows(*args, want_logprobs, num_logprobs=num_logprobs, chunk=chunk,
                      interpret=interpret)
    want = sample_rows_reference(*args, want_logprobs, num_logprobs=num_logprobs)
    tokens, logprob, ids, lps = (np.asarray(a) for a in got)
    np.testing.assert_array_equal(tokens, np.asarray(want[0]), err_msg="tokens")
    np.testing.assert_array_equal(ids, np.asarray(want[2]), err_msg="top ids")
    np.testing.assert_allclose(logprob, np.asarray(want[1]), rtol=0, atol=SAMPLING_LOGPROB_ATOL)
    np.testing.assert_allclose(lps, np.asarray(want[3]), rtol=0, atol=SAMPLING_LOGPROB_ATOL)
    assert ids.shape == (len(tokens), num_logprobs)
    return tokens


@pytest.mark.parametrize("v,rows", [
    (49152, ROWS[:8]), (49152, ROWS[8:]), (128256, ROWS[1:10:2]), (128256, ROWS[0:10:2]),
], ids=["smollm2-a", "smollm2-b", "llama3-a", "llama3-b"])
def test_model_vocabularies(v, rows, interpret):
    _check(_case(v, v, rows), True, 20, interpret)


@pytest.mark.parametrize("v", [5000, 300])
@pytest.mark.parametrize("ties,masked", [(False, 0.0), (True, 0.0), (True, 0.5), (False, 0.98)],
                         ids=["plain", "ties", "ties-bitmask", "few-allowed"])
def test_ragged_vocabularies_ties_and_bitmasks(v, ties, masked, interpret):
    rows = ROWS + [(False, v - 1, 1.0, 0.0), (False, v, 0.7, 0.0)]
    _check(_case(7 + v, v, rows, ties=ties, masked=masked), True, 20, interpret)


def test_ties_at_the_cutoff_are_all_kept(interpret):
    """Row of ten 5s, then lower logits: top_k = 3 keeps all ten 5s (not 3), so across 64
    uniforms every draw is a 5 and more than 3 distinct 5s are drawn."""
    v, s = 300, 64
    x = np.full((s, v), -2.0, np.float32)
    fives = np.arange(10) * 17
    x[:, fives] = 5.0
    rows = [(False, 3, 1.0, 0.0)] * s
    args = list(_case(0, v, rows))
    args[0] = args[1] = jnp.asarray(x)
    args[5] = jnp.asarray((np.arange(s) + 0.5) / s, jnp.float32)  # uniforms over [0, 1)
    tokens = _check(args, True, 20, interpret)
    assert set(tokens.tolist()) <= set(fives.tolist()) and len(set(tokens.tolist())) > 3


def test_small_vocabulary_narrower_than_a_chunk(interpret):
    rows = [(False, 2, 1.0, 0.0), (False, 0, 0.5, 0.0), GREEDY, (False, 7, 1.0, 0.0),
            (False, 0, 1.0, 0.5)]
    _check(_case(3, 7, rows, ties=True), True, 7, interpret)  # all 7 logprobs: K = V


@pytest.mark.parametrize("chunk", [16, 64])
def test_chunk_sizes_agree(chunk, interpret):
    _check(_case(11, 1000, ROWS, ties=True), True, 5, interpret, chunk=chunk)


def test_logprobs_not_wanted_are_zeros_and_zero_wide(interpret):
    args = _case(5, 300, ROWS)
    _check(args, False, 20, interpret)
    _check(args, True, 0, interpret)


def test_a_chunk_of_minus_inf_before_the_first_finite_logit(interpret):
    """Raw logits -inf over the whole first chunk (a row's online logsumexp starts at -inf)."""
    args = list(_case(4, 5000, ROWS[:4]))
    x = np.asarray(args[0]).copy()
    x[:, :DEFAULT_CHUNK + 5] = -INF
    args[0] = args[1] = jnp.asarray(x)
    _check(args, True, 20, interpret)


def test_non_finite_rows_give_a_non_finite_logprob_and_a_valid_token(interpret):
    """The engine fails a request whose logits hold NaN or inf by its non-finite logprob
    (engine.py); such a row must still end every loop and give a token id inside V."""
    v = 5000
    args = list(_case(9, v, ROWS[:6]))
    x = np.asarray(args[0]).copy()
    x[1, 17] = np.nan       # one NaN, an unfiltered draw
    x[3, :] = np.inf        # a whole row of inf, top-k
    x[4, 123] = np.inf      # one inf, top-k and top-p
    args[0] = args[1] = jnp.asarray(x)
    tokens, logprob, _, _ = (np.asarray(a) for a in sample_rows(*args, True, num_logprobs=5,
                                                                interpret=interpret))
    assert ((tokens >= 0) & (tokens < v)).all()
    assert not np.isfinite(logprob[[1, 3, 4]]).any() and np.isfinite(logprob[[0, 2, 5]]).all()


def test_rows_are_independent(interpret):
    """A row's results do not change when the other rows change (batch independence)."""
    v = 5000
    a, b = _case(1, v, ROWS[:6]), _case(2, v, ROWS[6:12])
    mixed = [jnp.concatenate([x[:3], y[3:]]) for x, y in zip(a, b)]
    full = sample_rows(*a, True, num_logprobs=5, interpret=interpret)
    part = sample_rows(*mixed, True, num_logprobs=5, interpret=interpret)
    for f, p in zip(full, part):
        np.testing.assert_array_equal(np.asarray(f)[:3], np.asarray(p)[:3])


# ---- GPU: CUDA lowering and sm_90a compile ----------------------------------------------------

def _h200_args(s, v):
    sd = jax.ShapeDtypeStruct
    f32 = jnp.float32
    return [sd((s, v), f32), sd((s, v), f32), sd((s,), jnp.int32), sd((s,), f32), sd((s,), f32),
            sd((s,), f32), sd((s,), jnp.bool_), sd((), jnp.bool_)]


def test_kernel_lowers_for_cuda():
    """The batch-64 SmolLM2 case lowers to one Triton call, one program per row (no GPU, no
    plugin needed), and nothing of the sampler is left to XLA but the arguments' casts."""
    fn = functools.partial(sample_rows, num_logprobs=20)
    text = cuda_lowering.lower_for_h200(fn, *_h200_args(64, 49152))
    calls = re.findall(r"custom_call @__gpu\$xla\.gpu\.triton.*", text)
    assert len(calls) == 1 and 'name = "sample_rows"' in calls[0]
    assert "grid_x = 64 : i32, grid_y = 1 : i32" in calls[0]
    assert not re.search(r"stablehlo\.(sort|while|case|if|reduce)\b", text)


@pytest.mark.parametrize("v", [49152, 128256])
def test_kernel_compiles_for_h200_without_spills(v, tmp_path):
    """sm_90a compile at batch 64 (ptxas -v through the deviceless compiler's wrapper)."""
    from jaxserve.tools import compiled_report, deviceless
    why = deviceless.unavailable_reason()
    if why:
        pytest.skip(why)
    out = deviceless.compile_for_h200(functools.partial(sample_rows, num_logprobs=20),
                                      _h200_args(64, v), dump_dir=tmp_path)
    if out.ptxas_note:
        pytest.skip(f"no ptxas report: {out.ptxas_note}")
    kernel = compiled_report.ptxas_kernels(out.ptxas_log)["sample_rows"]
    assert kernel["registers"] and kernel["spill_bytes"] == 0, kernel
