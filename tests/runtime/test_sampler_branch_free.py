"""The branch-free sampler (the GPU step's: selects instead of lax.cond) samples exactly what
the conditional one does, which tests/runtime/test_sampler.py checks against numpy references, for
every mix of rows that takes a branch: penalties, min_tokens bans, greedy and random rows,
top-k / top-p / min-p (within the candidate window and through the bisection), logprobs.
The GPU step's kernel form (backend "pallas", here interpreted) samples the same tokens and
top-logprob ids, and the same log-probabilities up to float32 rounding (its logsumexp sums in
another order), with and without a grammar's bitmask."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.core.sampling_params import SamplingParams as SP
from jaxserve.runtime.sampler import SamplingTensors, sample

STATIC = ("max_logprobs", "top_candidates", "branch_free", "backend")
_sample = jax.jit(sample, static_argnames=STATIC)
S, V, L = 8, 300, 16

MIXES = {
    "greedy": [SP(temperature=0.0)] * S,
    "random": [SP(temperature=0.8)] * S,
    "filters": [SP(temperature=1.0, top_k=5), SP(temperature=0.7, top_p=0.9),
                SP(temperature=1.2, min_p=0.05), SP(temperature=0.0)] * 2,
    "deep": [SP(temperature=1.0, top_k=200), SP(temperature=1.0, top_p=0.99)] * 4,
    "penalties": [SP(temperature=0.0, repetition_penalty=1.3), SP(temperature=0.9,
                  presence_penalty=0.5, frequency_penalty=0.3),
                  SP(temperature=0.0, min_tokens=4), SP(temperature=0.0)] * 2,
}


def run(params, branch_free: bool, want_logprobs: bool, seed: int, top_candidates: int,
        backend: str = "xla", masked: bool = False):
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 3, (S, V)).astype(np.float32)  # [S, V]
    history = rng.integers(0, V, (S, L)).astype(np.int32)  # [S, L]
    st = SamplingTensors.from_params(params, list(range(S)), [1] * S, (0, 1), size=S)
    ctx = np.full(S, L, np.int32)
    mask = None
    if masked:  # a grammar allowing about a third of the vocabulary
        words = -(-V // 32)
        mask = jnp.asarray(rng.integers(-2 ** 31, 2 ** 31, (S, words)) & rng.integers(
            -2 ** 31, 2 ** 31, (S, words)), jnp.int32)  # [S, W]
    out = _sample(jnp.asarray(logits), jax.device_put(st), jnp.asarray(history),
                  jnp.asarray(ctx), jnp.full(S, 4, jnp.int32), jnp.asarray(ctx),
                  jnp.asarray(want_logprobs), max_logprobs=5, top_candidates=top_candidates,
                  branch_free=branch_free, backend=backend, mask=mask)
    return jax.tree.map(np.asarray, out)


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("want_logprobs", [False, True])
@pytest.mark.parametrize("top_candidates", [128, 3], ids=["top128", "deep"])
def test_branch_free_samples_what_the_conditional_sampler_does(mix, want_logprobs,
                                                               top_candidates):
    for seed in range(3):
        want = run(MIXES[mix], False, want_logprobs, seed, top_candidates)
        got = run(MIXES[mix], True, want_logprobs, seed, top_candidates)
        for field in ("tokens", "logprob", "top_ids", "top_logprobs"):
            np.testing.assert_array_equal(getattr(got, field), getattr(want, field),
                                          err_msg=f"{mix} seed {seed}: {field}")


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("masked", [False, True], ids=["all", "bitmask"])
def test_kernel_samples_what_the_conditional_sampler_does(mix, masked):
    for seed in range(3):
        want_logprobs = seed != 1
        want = run(MIXES[mix], False, want_logprobs, seed, 128, masked=masked)
        got = run(MIXES[mix], True, want_logprobs, seed, 128, "pallas-interpret", masked)
        for field in ("tokens", "top_ids"):
            np.testing.assert_array_equal(getattr(got, field), getattr(want, field),
                                          err_msg=f"{mix} seed {seed}: {field}")
        for field in ("logprob", "top_logprobs"):
            np.testing.assert_allclose(getattr(got, field), getattr(want, field), rtol=0,
                                       atol=1e-5, err_msg=f"{mix} seed {seed}: {field}")


def test_kernel_backend_needs_the_branch_free_sampler():
    with pytest.raises(ValueError, match="with branch_free=True"):
        run(MIXES["greedy"], False, True, 0, 128, "pallas-interpret")


def test_kernel_sampler_lowers_for_cuda_without_conditional_loop_or_sort():
    """The GPU program's sampler (backend "pallas") is one Triton call and XLA fusions: no
    conditional, loop or sort left to XLA at batch 64 and SmolLM2's vocabulary."""
    from tests import cuda_lowering
    s, v = 64, 49152
    args = _abstract_args(s, v, mask=True)
    f = functools.partial(sample, want_logprobs=True, branch_free=True, backend="pallas")
    text = cuda_lowering.lower_for_h200(lambda *a: f(*a[:6], mask=a[6]), *args)
    assert len(re.findall(r"custom_call @__gpu\$xla\.gpu\.triton", text)) == 1
    assert not re.search(r"stablehlo\.(sort|while|case|if)\b", text)


def _abstract_args(s, v, mask=False):
    st = SamplingTensors.from_params([SP()] * s, [0] * s, [0] * s, (), size=s)
    args = [jax.ShapeDtypeStruct((s, v), jnp.float32),
            jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), st),
            jax.ShapeDtypeStruct((s, L), jnp.int32)] + [jax.ShapeDtypeStruct((s,), jnp.int32)] * 3
    return args + ([jax.ShapeDtypeStruct((s, -(-v // 32)), jnp.int32)] if mask else [])


def test_branch_free_sampler_has_no_conditional():
    args = [jax.ShapeDtypeStruct((S, V), jnp.float32),
            jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                         SamplingTensors.from_params([SP()] * S, [0] * S, [0] * S, (), size=S)),
            jax.ShapeDtypeStruct((S, L), jnp.int32)] + [jax.ShapeDtypeStruct((S,), jnp.int32)] * 3
    f = functools.partial(sample, want_logprobs=True)
    text = {bf: jax.jit(functools.partial(f, branch_free=bf)).lower(*args).as_text()
            for bf in (False, True)}
    assert "stablehlo.case" in text[False] or "stablehlo.if" in text[False]
    assert "stablehlo.case" not in text[True] and "stablehlo.if" not in text[True]
