"""The branch-free sampler (the GPU step's: selects instead of lax.cond) samples exactly what
the conditional one does, which tests/runtime/test_sampler.py checks against numpy references, for
every mix of rows that takes a branch: penalties, min_tokens bans, greedy and random rows,
top-k / top-p / min-p (within the candidate window and through the bisection), logprobs."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.core.sampling_params import SamplingParams as SP
from jaxserve.runtime.sampler import SamplingTensors, sample

STATIC = ("max_logprobs", "top_candidates", "branch_free")
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


def run(params, branch_free: bool, want_logprobs: bool, seed: int, top_candidates: int):
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 3, (S, V)).astype(np.float32)  # [S, V]
    history = rng.integers(0, V, (S, L)).astype(np.int32)  # [S, L]
    st = SamplingTensors.from_params(params, list(range(S)), [1] * S, (0, 1), size=S)
    ctx = np.full(S, L, np.int32)
    out = _sample(jnp.asarray(logits), jax.device_put(st), jnp.asarray(history),
                  jnp.asarray(ctx), jnp.full(S, 4, jnp.int32), jnp.asarray(ctx),
                  jnp.asarray(want_logprobs), max_logprobs=5, top_candidates=top_candidates,
                  branch_free=branch_free)
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
