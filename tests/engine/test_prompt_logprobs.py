"""Prompt logprobs (SamplingParams.prompt_logprobs) computed in the engine's ragged step.

Against HF transformers on the real SmolLM2 (float32, the same GGUF file), alone, chunked
(a 32-token budget splits a 40-token prompt in two), next to another request's decode rows,
and with its prefix cached by an earlier request. On the tiny model, against the model's own
dense forward (a fast check of the step's bookkeeping: which flat token scores which position).

Tolerance, float32: tests/e2e/test_smollm2_parity.py holds the engine's logits to HF's within
2e-3 (measured 6.7e-5); a logprob is a logit minus the row's log-sum-exp, each within that, so
4e-3. Top-k ids are compared where HF's neighbouring entries are more than 10x that apart.
"""

import numpy as np
import pytest

from hf_reference import run_reference
from jaxserve import EngineConfig, LLMEngine, SamplingParams
from jaxserve.testing.tiny_chat import tiny_chat_model

FP32_ATOL = 4e-3
K = 5
TEXTS = ["The history of the Roman Empire spans more than a thousand years, from the founding "
         "of the city to the fall of Constantinople, and its laws, roads and language shaped "
         "the continent that came after it.",
         "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "
         "fibonacci(n - 2)\n"]


def run(engine, requests):
    """requests: {id: (prompt ids, SamplingParams)} added together; their final outputs."""
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
    return outs


def scored(params_k=K, **kw):
    return SamplingParams(max_tokens=kw.pop("max_tokens", 1), temperature=0,
                          prompt_logprobs=params_k, **kw)


@pytest.fixture(scope="module")
def smollm2_ids(smollm2_fp32):
    tok = smollm2_fp32.tokenizer
    return [tok.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def reference(smollm2_path, smollm2_ids):
    return run_reference("ref_prompt_logprobs", {"gguf": str(smollm2_path),
                                                 "prompts": smollm2_ids, "topk": K},
                         input_files=[smollm2_path])


@pytest.fixture(scope="module")
def engine(smollm2_fp32):
    return LLMEngine(EngineConfig(model=smollm2_fp32.source, warmup=False, max_num_seqs=4,
                                  max_model_len=256, max_num_batched_tokens=32, block_size=16,
                                  enable_prefix_caching=True), model=smollm2_fp32)


def check_against_hf(out, ids, reference, i):
    plp = out.prompt_logprobs
    assert len(plp) == len(ids) and plp[0] is None
    target = np.array([entry[t] for entry, t in zip(plp[1:], ids[1:])])
    np.testing.assert_allclose(target, reference[f"target/{i}"], atol=FP32_ATOL, rtol=0)
    top_idx, top_lp = reference[f"top_idx/{i}"], reference[f"top_lp/{i}"]
    for p, entry in enumerate(plp[1:]):
        ours = {t: lp for t, lp in entry.items() if t in set(top_idx[p])}
        np.testing.assert_allclose([ours[t] for t in top_idx[p]], top_lp[p], atol=FP32_ATOL)
        # The entry holds the prompt token and the top K (K + 1 ids where it is not among them).
        assert set(top_idx[p]) <= set(entry) and len(entry) in (K, K + 1)


@pytest.mark.hf_ref
def test_prompt_logprobs_match_hf_chunked_and_beside_a_decode(engine, smollm2_ids, reference):
    assert len(smollm2_ids[0]) > 32  # the 32-token budget chunks it
    outs = run(engine, {"scored": (smollm2_ids[0], scored()),
                        "decoding": (smollm2_ids[1][:6], SamplingParams(max_tokens=40,
                                                                        temperature=0))})
    check_against_hf(outs["scored"], smollm2_ids[0], reference, 0)
    assert outs["decoding"].prompt_logprobs is None


@pytest.mark.hf_ref
def test_prompt_logprobs_of_a_cached_prefix_match_hf(engine, smollm2_ids, reference):
    ids = smollm2_ids[1]
    run(engine, {"warm": (ids, SamplingParams(max_tokens=1))})  # caches the prompt's blocks
    hits = engine.stats()["prefix_cache_hits_tokens"]
    outs = run(engine, {"again": (ids, scored())})
    check_against_hf(outs["again"], ids, reference, 1)
    # It took nothing from the cache (every position needs its logits), while a plain
    # request on the same prompt does.
    assert engine.stats()["prefix_cache_hits_tokens"] == hits
    run(engine, {"plain": (ids, SamplingParams(max_tokens=1))})
    assert engine.stats()["prefix_cache_hits_tokens"] > hits


def test_tiny_model_prompt_logprobs_equal_its_dense_forward():
    model = tiny_chat_model(seed=0)
    engine = LLMEngine(EngineConfig(model=model.source, warmup=False, max_num_seqs=4,
                                    max_model_len=128, max_num_batched_tokens=32,
                                    block_size=16), model=model)
    rng = np.random.default_rng(0)
    prompts = {f"r{i}": rng.integers(3, model.config.vocab_size, n).tolist()
               for i, n in enumerate((45, 9, 2, 1))}
    outs = run(engine, {rid: (ids, scored(k)) for (rid, ids), k
                        in zip(prompts.items(), (3, 0, 1, 2))})
    for (rid, ids), k in zip(prompts.items(), (3, 0, 1, 2)):
        lp = model.forward_logits(ids)
        lp = lp - np.log(np.exp(lp - lp.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - lp.max(-1, keepdims=True)  # [T, V] log-softmax
        plp = outs[rid].prompt_logprobs
        assert len(plp) == len(ids) and plp[0] is None
        for p in range(1, len(ids)):
            want = {ids[p]: lp[p - 1, ids[p]]}
            want.update({int(t): lp[p - 1, t] for t in np.argsort(-lp[p - 1])[:k]})
            assert set(plp[p]) == set(want), (rid, p)
            np.testing.assert_allclose([plp[p][t] for t in want], list(want.values()),
                                       atol=1e-5, rtol=0)


def test_prompt_logprobs_refused_with_beam_search():
    with pytest.raises(ValueError, match="prompt_logprobs is not supported with beam search"):
        SamplingParams(use_beam_search=True, beam_width=2, prompt_logprobs=1)
