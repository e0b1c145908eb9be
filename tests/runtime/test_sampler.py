"""On-device sampler: each test checks a defined effect against numpy or a known answer."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runtime.sampler import (MAX_STOP_IDS, SamplingTensors, apply_penalties, sample,
                              seed_to_u32)
from jaxserve.core.sampling_params import SamplingParams as SP

_sample = jax.jit(sample, static_argnames=("max_logprobs", "top_candidates"))
L = 16  # history length used by most tests


@pytest.fixture(params=[None, 3], ids=["top128", "deep"])
def sampler_fn(request):
    """The jitted sampler; "deep" shrinks the candidate window so small vocabularies exercise
    the bisection path that large vocabularies take for top_k > 128 or flat top_p rows."""
    if request.param is None:
        return _sample
    return functools.partial(_sample, top_candidates=request.param)


def run(logits, params, *, fn=_sample, seeds=None, positions=None, history=None, context_lens=None,
        prompt_lens=None, num_generated=None, eos_ids=(), want_logprobs=False, k=20):
    logits = np.asarray(logits, np.float32)
    s = logits.shape[0]
    params = list(params) if isinstance(params, (list, tuple)) else [params] * s
    seeds = list(range(s)) if seeds is None else list(seeds)
    st = SamplingTensors.from_params(params, seeds, num_generated or [0] * s, eos_ids, size=s)
    hist = np.zeros((s, L), np.int32) if history is None else history
    ctx = np.zeros(s, np.int32) if context_lens is None else context_lens
    pl = np.zeros(s, np.int32) if prompt_lens is None else prompt_lens
    pos = np.zeros(s, np.int32) if positions is None else positions
    out = fn(jnp.asarray(logits), jax.device_put(st), jnp.asarray(hist), jnp.asarray(ctx),
                  jnp.asarray(pl), jnp.asarray(pos, jnp.int32), jnp.asarray(want_logprobs),
                  max_logprobs=k)
    return jax.tree.map(np.asarray, out)


def draws(row, params, n, fn=_sample, seed=7):
    """n samples of one logits row: n slots, same seed, positions 0..n-1."""
    logits = np.broadcast_to(np.asarray(row, np.float32), (n, len(row)))
    return run(logits, params, fn=fn, seeds=[seed] * n, positions=np.arange(n)).tokens


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


@pytest.fixture
def logits():
    return np.random.default_rng(0).normal(size=(8, 1000)).astype(np.float32) * 3


@pytest.mark.parametrize("params", [
    SP(temperature=0.0), SP(temperature=1.5, top_k=1), SP(temperature=1.0, top_p=1e-6),
    SP(temperature=2.0, min_p=1.0)])
def test_argmax_equivalents(logits, params, sampler_fn):
    for pos in range(3):
        out = run(logits, params, fn=sampler_fn, positions=np.full(8, pos))
        np.testing.assert_array_equal(out.tokens, logits.argmax(-1))


def test_same_seed_and_position_reproduce_and_seeds_differ():
    flat = np.zeros((64, 64), np.float32)
    a = run(flat, SP(temperature=1.0), seeds=range(64), positions=np.full(64, 5)).tokens
    b = run(flat, SP(temperature=1.0), seeds=range(64), positions=np.full(64, 5)).tokens
    np.testing.assert_array_equal(a, b)
    # 64 uniform draws over 64 tokens: ~40 distinct expected, a shared stream would give 1.
    assert len(set(a.tolist())) > 25
    by_position = run(flat, SP(temperature=1.0), seeds=[3] * 64, positions=np.arange(64)).tokens
    assert len(set(by_position.tolist())) > 25


def test_seed_folding_keeps_high_bits():
    assert seed_to_u32(1) != seed_to_u32(1 + (1 << 32))
    assert 0 <= seed_to_u32(-1) < 2 ** 32


def test_slot_token_independent_of_other_slots(sampler_fn):
    rng = np.random.default_rng(1)
    mine = rng.normal(size=64).astype(np.float32)
    others = [SP(temperature=0.0), SP(temperature=0.7, top_k=3),
              SP(temperature=1.3, top_p=0.5, repetition_penalty=1.5, frequency_penalty=1.0),
              SP(temperature=1.0, min_p=0.2, min_tokens=2)]
    for params in [SP(temperature=0.9), SP(temperature=0.9, top_p=0.8)]:
        for pos in range(20):
            tokens = set()
            for j, other in enumerate(others):  # mine moves to slot j, neighbours change
                logits = rng.normal(size=(4, 64)).astype(np.float32) * 4
                logits[j] = mine
                hist = rng.integers(0, 64, size=(4, L)).astype(np.int32)
                slot_params, seeds, positions = [other] * 4, [1, 2, 3, 4], [9] * 4
                slot_params[j], seeds[j], positions[j] = params, 11, pos
                ctx, plen = [8] * 4, [4] * 4
                ctx[j] = plen[j] = 0
                out = run(logits, slot_params, fn=sampler_fn, seeds=seeds, positions=positions,
                          history=hist, context_lens=ctx, prompt_lens=plen, eos_ids=[0])
                tokens.add(int(out.tokens[j]))
            assert len(tokens) == 1, (params, pos, tokens)


def freq(tokens, v):
    return np.bincount(tokens, minlength=v) / len(tokens)


def test_temperature_matches_softmax():
    row = np.array([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2], np.float32)
    n, temp = 8192, 0.7
    p = softmax(row / temp)
    f = freq(draws(row, SP(temperature=temp), n), len(row))
    # Each frequency is binomial: 5 standard deviations (+ a float slack) bounds a correct
    # sampler with overwhelming probability; the draws are seeded so the test is deterministic.
    tol = 5 * np.sqrt(p * (1 - p) / n) + 1e-3
    assert np.all(np.abs(f - p) < tol), (f, p)
    # And it is not the T=1 distribution.
    assert np.abs(f - softmax(row)).max() > 0.02


def test_draw_across_blocks_matches_softmax():
    # 700 tokens = 3 draw blocks (the last one padded); the mass sits on tokens on both sides
    # of block edges, with the remaining ~690 tokens together as one "rest" bucket.
    row = np.random.default_rng(8).normal(size=700).astype(np.float32) * 0.3
    hot = np.array([3, 255, 256, 400, 511, 512, 699])
    row[hot] += np.float32([4.0, 3.5, 3.0, 4.2, 2.5, 3.8, 3.3])
    p = softmax(row)
    n = 8192
    f = freq(draws(row, SP(temperature=1.0), n), 700)
    got, want = np.append(f[hot], 1 - f[hot].sum()), np.append(p[hot], 1 - p[hot].sum())
    assert np.all(np.abs(got - want) < 5 * np.sqrt(want * (1 - want) / n) + 1e-3), (got, want)


def test_top_k_support(sampler_fn):
    row = np.random.default_rng(2).normal(size=32).astype(np.float32)
    support = set(draws(row, SP(temperature=1.0, top_k=5), 2048, sampler_fn).tolist())
    assert support == set(np.argsort(-row)[:5].tolist())


def expected_top_p(row, p):
    order = np.argsort(-row)
    cum = np.cumsum(softmax(row)[order])
    return set(order[:np.searchsorted(cum, p) + 1].tolist())  # smallest prefix with mass >= p


def midpoint_p(row, j):
    cum = np.cumsum(np.sort(softmax(row))[::-1])
    return (cum[j - 1] + cum[j]) / 2  # strictly inside: smallest set = j + 1 tokens


def test_top_p_support(sampler_fn):
    row = np.random.default_rng(3).normal(size=32).astype(np.float32) * 0.8
    p = midpoint_p(row, 6)
    want = expected_top_p(row, p)
    assert len(want) == 7
    assert set(draws(row, SP(temperature=1.0, top_p=float(p)), 4096, sampler_fn).tolist()) == want


def test_top_p_applies_to_top_k_renormalised(sampler_fn):
    row = np.random.default_rng(4).normal(size=32).astype(np.float32)
    top = np.argsort(-row)[:8]
    sub = np.full_like(row, -np.inf)
    sub[top] = row[top]
    p = midpoint_p(sub, 4)  # computed on the renormalised top-8 distribution
    want = expected_top_p(sub, p)
    got = set(draws(row, SP(temperature=1.0, top_k=8, top_p=float(p)), 4096, sampler_fn).tolist())
    assert got == want and len(want) == 5


def test_min_p_support_with_masked_vocab(sampler_fn):
    row = np.random.default_rng(5).normal(size=32).astype(np.float32)
    row[-4:] = -np.inf  # padded vocab entries must never come out
    ratio = np.sort(softmax(row) / softmax(row).max())[::-1]
    min_p = float((ratio[4] + ratio[5]) / 2)
    want = set(np.nonzero(softmax(row) >= min_p * softmax(row).max())[0].tolist())
    assert len(want) == 5
    assert set(draws(row, SP(temperature=1.0, min_p=min_p), 4096, sampler_fn).tolist()) == want
    assert max(draws(row, SP(temperature=1.0, top_p=0.999), 4096, sampler_fn)) < 28


def np_penalties(logits, hist, ctx, plen, rep, pres, freq_):
    out = logits.copy()
    for i in range(len(out)):
        prompt, gen = hist[i, :plen[i]], hist[i, plen[i]:ctx[i]]
        seen = np.zeros(out.shape[1], bool)
        seen[prompt] = seen[gen] = True
        out[i] = np.where(seen, np.where(out[i] > 0, out[i] / rep[i], out[i] * rep[i]), out[i])
        counts = np.bincount(gen, minlength=out.shape[1])
        out[i] -= freq_[i] * counts + pres[i] * (counts > 0)
    return out


def penalty_case(seed, s=6, v=48):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(s, v)).astype(np.float32) * 2
    hist = rng.integers(0, v, size=(s, L)).astype(np.int32)
    ctx = rng.integers(1, L - 3, size=s).astype(np.int32)
    plen = (rng.random(s) * ctx).astype(np.int32)
    hist[:, -3:] = [-7, v + 5, 2 ** 30]  # garbage beyond context_len, some of it out of range
    params = [SP(temperature=0.0, repetition_penalty=float(rng.uniform(0.5, 2.0)),
                 presence_penalty=float(rng.uniform(-2, 2)),
                 frequency_penalty=float(rng.uniform(-2, 2))) for _ in range(s)]
    params[0] = SP(temperature=0.0)  # a row without penalties must come out untouched
    return logits, hist, ctx, plen, params


@pytest.mark.parametrize("seed", range(3))
def test_penalties_match_vllm_definitions(seed):
    logits, hist, ctx, plen, params = penalty_case(seed)
    st = SamplingTensors.from_params(params, [0] * 6, [0] * 6, size=6)
    want = np_penalties(logits, hist, ctx, plen, st.repetition_penalty, st.presence_penalty,
                        st.frequency_penalty)
    got = np.asarray(apply_penalties(jnp.asarray(logits), st, jnp.asarray(hist),
                                     jnp.asarray(ctx), jnp.asarray(plen)))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)
    np.testing.assert_array_equal(got[0], logits[0])
    out = run(logits, params, history=hist, context_lens=ctx, prompt_lens=plen)
    np.testing.assert_array_equal(out.tokens, want.argmax(-1))


def test_penalties_change_greedy_choice_and_skip_prompt_for_presence():
    logits = np.zeros((3, 16), np.float32)
    logits[:, 4], logits[:, 9] = 2.0, 1.9
    hist = np.zeros((3, L), np.int32)
    hist[:, :3] = [4, 1, 4]  # token 4 at positions 0 and 2
    # Slot 0: prompt = [4, 1] -> repetition demotes 4. Slot 1: same prompt, presence ignores it.
    # Slot 2: prompt = [4], output = [1, 4] -> presence demotes 4.
    out = run(logits, [SP(temperature=0.0, repetition_penalty=1.2),
                       SP(temperature=0.0, presence_penalty=1.0),
                       SP(temperature=0.0, presence_penalty=1.0)],
              history=hist, context_lens=[2, 2, 3], prompt_lens=[2, 2, 1])
    assert out.tokens.tolist() == [9, 4, 9]


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    logits = np.zeros((6, 16), np.float32)
    logits[:, 3], logits[:, 5], logits[:, 7] = 10.0, 9.0, 8.0  # 3 = EOS, 5 = stop id
    greedy, hot = SP(temperature=0.0, min_tokens=2, stop_token_ids=(5,)), \
        SP(temperature=1.0, min_tokens=2, stop_token_ids=(5,))
    ign = SP(temperature=0.0, min_tokens=2, stop_token_ids=(5,), ignore_eos=True)
    params = [greedy, greedy, greedy, hot, ign, SP(temperature=0.0, min_tokens=0)]
    for pos in range(20):
        out = run(logits, params, eos_ids=[3], num_generated=[0, 1, 2, 1, 0, 0],
                  positions=np.full(6, pos))
        assert out.tokens[0] == out.tokens[1] == 7  # both still below min_tokens
        assert out.tokens[2] == 3  # reached: EOS allowed again
        assert out.tokens[3] not in (3, 5)
        assert out.tokens[4] == 3  # ignore_eos: only the stop id is banned
        assert out.tokens[5] == 3


def test_from_params_idle_slots_and_limits():
    st = SamplingTensors.from_params([SP(temperature=0.5, top_k=4), None], [9, None], [0, 0],
                                     size=3)
    assert st.temperature.tolist() == [0.5, 0.0, 0.0] and st.top_k.tolist() == [4, 0, 0]
    assert st.stop_ids.shape == (3, MAX_STOP_IDS) and (st.stop_ids == -1).all()
    too_many = SP(min_tokens=1, stop_token_ids=tuple(range(MAX_STOP_IDS)))
    with pytest.raises(ValueError, match="stop token ids"):
        SamplingTensors.from_params([too_many], [0], [0], eos_ids=[99], size=1)
    with pytest.raises(ValueError, match="seed"):
        SamplingTensors.from_params([SP(temperature=1.0)], [None], [0], size=1)
    huge = SamplingTensors.from_params([SP(temperature=0.0, top_k=2 ** 40, max_tokens=2 ** 40,
                                           min_tokens=2 ** 35)],
                                       [None], [0], size=1)  # greedy: no seed needed
    assert huge.top_k[0] == huge.min_tokens[0] == 2 ** 31 - 1
    with pytest.raises(ValueError, match="slots"):
        SamplingTensors.from_params([None, None], [0, 0], [0, 0], size=1)


def test_logprobs_are_raw_log_softmax(logits):
    hist = np.tile(np.arange(L, dtype=np.int32), (8, 1))
    params = SP(temperature=0.8, top_k=10, repetition_penalty=1.3, presence_penalty=0.5)
    out = run(logits, params, history=hist, context_lens=np.full(8, L),
              prompt_lens=np.full(8, 4), want_logprobs=True, k=5)
    lsm = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1,
                          keepdims=True)) - logits.max(-1, keepdims=True)
    np.testing.assert_allclose(out.logprob, lsm[np.arange(8), out.tokens], atol=1e-4)
    want_ids = np.argsort(-logits, axis=-1)[:, :5]
    np.testing.assert_array_equal(out.top_ids, want_ids)
    np.testing.assert_allclose(out.top_logprobs, np.take_along_axis(lsm, want_ids, -1),
                               atol=1e-4)
    off = run(logits, params, want_logprobs=False, k=5)
    assert not off.top_ids.any() and not off.top_logprobs.any()


def test_compiles_once_for_many_parameter_values():
    # A fresh function object: jax.jit(sample) would share the module-level jit's cache.
    f = jax.jit(lambda *args: sample(*args, max_logprobs=4))
    rng = np.random.default_rng(6)
    variants = [SP(temperature=0.0), SP(temperature=0.7), SP(temperature=1.0, top_k=3),
                SP(temperature=1.0, top_p=0.3, min_p=0.1),
                SP(temperature=0.5, repetition_penalty=1.2, frequency_penalty=0.4,
                   min_tokens=3, stop_token_ids=(1,))]
    for i, params in enumerate(variants):
        st = jax.device_put(SamplingTensors.from_params([params] * 4, [i] * 4, [i] * 4, [2],
                                                        size=4))
        f(jnp.asarray(rng.normal(size=(4, 64)), jnp.float32), st,
          jnp.asarray(rng.integers(0, 64, (4, L)), jnp.int32), jnp.full(4, i + 2, jnp.int32),
          jnp.ones(4, jnp.int32), jnp.full(4, i, jnp.int32), jnp.asarray(i % 2 == 0))
    assert f._cache_size() == 1


def test_large_vocab_filters():
    rng = np.random.default_rng(7)
    logits = rng.normal(size=(4, 49152)).astype(np.float32) * 4
    out = run(logits, [SP(temperature=1.0, top_k=1), SP(temperature=1.0, top_p=1e-6),
                       SP(temperature=0.0), SP(temperature=1.0, top_k=50, top_p=0.95)],
              positions=np.arange(4))
    np.testing.assert_array_equal(out.tokens[:3], logits[:3].argmax(-1))
    assert out.tokens[3] in set(np.argsort(-logits[3])[:50].tolist())


@pytest.mark.parametrize("base", [1.0, -1.0])
def test_filters_separate_logits_one_ulp_apart(sampler_fn, base):
    row = np.full(8, base, np.float32)
    for i in range(1, 8):  # each one ulp below the previous: the cutoff must be exact
        row[i] = np.nextafter(row[i - 1], np.float32(-np.inf))
    row = np.concatenate([row, np.float32([-5.0, 3e-3, -0.0, 0.0])])[::-1].copy()
    got = set(draws(row, SP(temperature=1.0, top_k=4), 1024, sampler_fn).tolist())
    assert got == set(np.argsort(-row, kind="stable")[:4].tolist())
