"""Speculative decoding end to end on tiny random models.

Greedy outputs are compared with the dense model's greedy decoding (full recompute, an
independent oracle), with preemption forced by a small KV pool; sampled outputs' distribution
with the exact one computed from the dense forward's logits, by a chi-square test that a
deliberately wrong acceptance rule fails.
"""

import numpy as np
import pytest
from scipy import stats as scipy_stats

from jaxserve import LLM, SamplingParams
from jaxserve.core.spec_decode import speculator as speculator_module
from models.random_init import random_model
from jaxserve.testing.tiny_models import TINY_GQA

# Repetitive prompts, so the n-gram drafter finds matches; the last is plain.
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 10, 11, 5, 6, 7],
           [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2], [40, 41, 42, 43] * 4, [9, 8, 7, 6, 5],
           [100, 101, 102, 103, 104, 100, 101, 102], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]
N = 40
BASE = dict(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=64, block_size=8,
            warmup=False)


@pytest.fixture(scope="module")
def target():
    return random_model(TINY_GQA, seed=1)


@pytest.fixture(scope="module")
def greedy_ref(target):
    return [target.greedy_generate(p, N, stop_token_ids=()) for p in PROMPTS]


def _llm(target, spec, draft=None, **kw):
    return LLM(target, draft_model=draft, speculative_config=spec, **(BASE | kw))


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


GREEDY = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)


@pytest.mark.parametrize("spec,draft_seed", [
    ({"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_min": 1}, None),
    ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}, None),
    ({"method": "draft_model", "model": "tiny", "num_speculative_tokens": 3}, 1),  # the target
    ({"method": "draft_model", "model": "tiny", "num_speculative_tokens": 2}, 7),  # another
], ids=["ngram-k1", "ngram-k4", "draft-self-k3", "draft-other-k2"])
def test_greedy_equals_dense_greedy_with_preemption(target, greedy_ref, spec, draft_seed):
    per_token = TINY_GQA.kv_bytes_per_token(4)
    draft = None if draft_seed is None else random_model(TINY_GQA, seed=draft_seed)
    llm = _llm(target, spec, draft, kv_cache_memory=17 * 8 * per_token)  # 16 usable blocks
    assert _ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == greedy_ref
    st = llm.stats()
    assert st["num_preemptions"] > 0
    assert st["speculation"]["num_draft_tokens"] > 0
    if draft_seed == 1:  # the target as its own draft: every greedy draft is right
        assert st["speculation"]["acceptance_rate"] == 1.0
    assert st["kv_blocks_in_use"] == 0
    llm.engine.scheduler.block_manager.check_invariants()


def test_max_tokens_stop_ids_and_logprobs(target, greedy_ref):
    llm = _llm(target, {"method": "draft_model", "model": "tiny", "num_speculative_tokens": 4},
               random_model(TINY_GQA, seed=1))
    # Every draft is accepted: rows of 5 tokens must still stop exactly at max_tokens.
    for n in (1, 2, 6, 7):
        outs = llm.generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=n,
                                                        ignore_eos=True), use_tqdm=False)
        assert _ids(outs) == [r[:n] for r in greedy_ref[:2]]
    stop = greedy_ref[0][9]  # a stop id first produced inside an accepted row
    first = greedy_ref[0].index(stop)
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=N,
                                                    stop_token_ids=[stop]), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == greedy_ref[0][:first + 1]
    assert out.outputs[0].finish_reason == "stop"
    out = llm.generate([PROMPTS[3]], SamplingParams(temperature=0.0, max_tokens=8,
                                                    ignore_eos=True, logprobs=2),
                       use_tqdm=False)[0]
    logits = target.forward_logits(PROMPTS[3] + greedy_ref[3][:8])[len(PROMPTS[3]) - 1:-1]
    ref = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)  # [8, V] log-softmax
    lps = out.outputs[0].logprobs
    assert len(lps) == 8
    for i, tok in enumerate(greedy_ref[3][:8]):
        assert lps[i][tok] == pytest.approx(ref[i, tok], abs=1e-4)
    m = out.metrics
    assert m.spec_draft_tokens > 0 and m.spec_acceptance_rate == 1.0
    assert m.spec_mean_accepted_length > 1


def test_speculation_switches_off_for_a_drafter_always_wrong(target, greedy_ref):
    llm = _llm(target, {"method": "ngram", "num_speculative_tokens": 3, "disable_window": 4})
    wrong = lambda seqs, limits: [[(s.all_token_ids[-1] + 1) % 256] * k
                                  for s, k in zip(seqs, limits)]
    llm.engine.spec.speculator.proposer = wrong
    outs = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    assert _ids(outs) == greedy_ref[:2]
    st = llm.stats()["speculation"]
    assert st["num_disabled"] == 2
    # 4 rows of 3 drafted tokens each, then off: not one drafted row per step.
    assert st["num_draft_tokens"] == 2 * 12 and st["num_accepted_tokens"] == 0


def exact_joint(model, prompt, temperature, top_k):
    """P(x1, x2) [V, V] of the first two sampled tokens, from the dense forward's logits."""
    def dist(ids):
        z = model.forward_logits(ids)[-1].astype(np.float64) / temperature
        keep = np.argsort(-z)[:top_k]
        p = np.zeros_like(z)
        p[keep] = np.exp(z[keep] - z[keep].max())
        return p / p.sum()
    p1 = dist(prompt)
    joint = np.zeros((p1.size, p1.size))
    for x1 in np.flatnonzero(p1):
        joint[x1] = p1[x1] * dist(prompt + [int(x1)])
    return joint


def _always_accept(drafts, sampled):
    return len(drafts)


@pytest.mark.parametrize("rule", ["exact", "always-accept"])
def test_sampled_distribution_matches_the_target(target, rule, monkeypatch):
    """2048 samples of (x1, x2, x3) with the target as its own greedy draft (so drafts are the
    likeliest tokens and are accepted or rejected often); (x1, x2) against the exact joint."""
    if rule == "always-accept":
        monkeypatch.setattr(speculator_module, "accepted_length", _always_accept)
    prompt, t, k = [17, 33, 94, 120, 8], 0.8, 6
    llm = _llm(target, {"method": "draft_model", "model": "tiny", "num_speculative_tokens": 2},
               random_model(TINY_GQA, seed=1), max_num_seqs=64, max_num_batched_tokens=256)
    params = [SamplingParams(temperature=t, top_k=k, max_tokens=3, ignore_eos=True, n=64,
                             seed=s) for s in range(32)]
    outs = llm.generate([prompt] * 32, params, use_tqdm=False)
    samples = np.array([c.token_ids for o in outs for c in o.outputs])  # [2048, 3]
    assert samples.shape == (2048, 3)
    assert llm.stats()["speculation"]["num_draft_tokens"] > 1000
    joint = exact_joint(target, prompt, t, k)
    cells = np.flatnonzero(joint.ravel() > 0)
    expected = joint.ravel()[cells] * len(samples)
    observed = np.bincount(samples[:, 0] * joint.shape[1] + samples[:, 1],
                           minlength=joint.size)
    outside = len(samples) - observed[cells].sum()  # samples the exact law gives no mass
    p_value = scipy_stats.chisquare(observed[cells], expected)[1] if outside == 0 else 0.0
    if rule == "exact":
        assert p_value > 1e-3, (p_value, outside)
    else:
        assert p_value < 1e-6, p_value


def test_warmup_compiles_the_verification_programs(target, greedy_ref):
    llm = LLM(target, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                          "prompt_lookup_min": 1},
              max_num_seqs=2, max_model_len=96, max_num_batched_tokens=32, block_size=8)
    runner = llm.engine.runner
    assert runner.num_compiled == 2 * len(runner.shapes()) + len(runner.slot_buckets) + 1
    outs = llm.generate(PROMPTS[:3], SamplingParams(temperature=0.0, max_tokens=24,
                                                    ignore_eos=True), use_tqdm=False)
    assert _ids(outs) == [r[:24] for r in greedy_ref[:3]]
    st = llm.stats()
    assert st["speculation"]["num_draft_tokens"] > 0 and st["num_compiles_after_warmup"] == 0
