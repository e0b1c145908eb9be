"""Prefix caching, n > 1 and beam search end to end on a tiny random model.

References are independent of the engine: greedy outputs with caching off (and the dense
forward), log-probabilities of each branch's tokens recomputed by the dense forward, and a numpy
beam search driven by the dense forward's log-softmax.
"""

import numpy as np
import pytest

from jaxserve import EngineConfig, LLMEngine, SamplingParams
from jaxserve.testing.tiny_models import TINY_GQA
from models.random_init import random_model

TINY = TINY_GQA
BS = 4


@pytest.fixture(scope="module")
def model():
    return random_model(TINY, seed=3)


def make_engine(model, blocks=400, **kw):
    kw = dict(block_size=BS, max_num_seqs=8, max_model_len=72, max_num_batched_tokens=32,
              warmup=False, kv_cache_memory=blocks * BS * TINY.kv_bytes_per_token(4)) | kw
    return LLMEngine(EngineConfig(model="tiny", **kw), model=model)


def drain(engine, staged=()):
    """Steps to the end, checking the block manager's invariants every step.

    staged: (step, request_id, prompt, params) added when that step is reached.
    """
    staged, done, step = sorted(staged, key=lambda r: r[0]), {}, 0
    while staged or engine.has_unfinished_requests():
        while staged and staged[0][0] <= step:
            _, rid, prompt, params = staged.pop(0)
            engine.add_request(rid, prompt, params)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.scheduler.block_manager.check_invariants()
        step += 1
    stats = engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"], "blocks leaked"
    assert stats["running"] == stats["waiting"] == 0
    return done


def shared_prompts(seed, n=24):
    rng = np.random.default_rng(seed)
    system = rng.integers(1, 256, 45).tolist()
    prompts = []
    for i in range(n):
        k = [0, 3, 4, 9, 16, 17, 30, 45][i % 8]  # block-aligned and not
        prompts.append(system[:k] + rng.integers(1, 256, int(rng.integers(1, 10))).tolist())
    return prompts


GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.mark.parametrize("blocks", [400, 40], ids=["roomy", "tight"])
def test_greedy_equal_with_caching_on_and_off(model, blocks):
    prompts = shared_prompts(blocks)
    staged = [(i // 3, f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
    results = {}
    for cache in (False, True):
        engine = make_engine(model, blocks=blocks, enable_prefix_caching=cache)
        done = drain(engine, staged)
        results[cache] = [done[f"r{i}"].outputs[0].token_ids for i in range(len(prompts))]
        stats = engine.stats()
        if cache:
            assert stats["prefix_cache_hits_blocks"] > 0
            if blocks == 40:  # the small cache preempts and evicts
                assert stats["num_preemptions"] > 0 and stats["prefix_cache_evictions"] > 0
        else:
            assert stats["prefix_cache_queries_tokens"] == 0 == stats["prefix_cache_blocks"]
        assert stats["num_compiles_after_warmup"] == 0
    assert results[True] == results[False]
    # And both equal the dense oracle on a few of them.
    for i in (0, 5, 7):
        assert results[True][i] == model.greedy_generate(prompts[i], 10, stop_token_ids=())


def log_softmax(x):
    x = np.asarray(x, np.float64)
    return x - (np.log(np.exp(x - x.max()).sum()) + x.max())


def dense_cum_logprob(model, prompt, tokens):
    logits = np.asarray(model.forward_logits(prompt + tokens[:-1]))
    return sum(log_softmax(logits[len(prompt) - 1 + i])[t] for i, t in enumerate(tokens))


def test_n_branches_reproducible_distinct_and_prompt_computed_once(model):
    prompt = shared_prompts(1)[6]  # 30 + k tokens: a partly filled tail block
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    runs = []
    for _ in range(2):
        engine = make_engine(model)
        out = drain(engine, [(0, "x", prompt, params)])["x"]
        runs.append([c.token_ids for c in out.outputs])
        stats = engine.stats()
        # Prompt once; each other branch recomputes only the last prompt token.
        assert stats["prompt_tokens_computed"] == len(prompt) + 3
        assert stats["cow_copies"] >= 3
    assert runs[0] == runs[1]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(r) for r in runs[0]}) == 4
    # Branch 0 is the n=1 stream of the same seed; the others are their own streams.
    one = drain(make_engine(model), [(0, "y", prompt, SamplingParams(
        temperature=1.0, seed=11, max_tokens=12, ignore_eos=True))])["y"]
    assert one.outputs[0].token_ids == runs[0][0]
    # No branch saw a sibling's KV: its logprobs equal the dense forward over its own tokens.
    for c in out.outputs:
        assert c.cumulative_logprob == pytest.approx(dense_cum_logprob(model, prompt, c.token_ids),
                                                     abs=2e-3)


def test_n_branches_share_with_caching_off_and_under_preemption(model):
    prompts = shared_prompts(2)[:6]
    params = SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=14, ignore_eos=True)
    outs = {}
    for blocks, cache in ((400, True), (20, True), (20, False)):
        engine = make_engine(model, blocks=blocks, enable_prefix_caching=cache)
        done = drain(engine, [(i, f"r{i}", p, params) for i, p in enumerate(prompts)])
        outs[blocks, cache] = [[c.token_ids for c in done[f"r{i}"].outputs]
                               for i in range(len(prompts))]
        if blocks == 20:
            assert engine.stats()["num_preemptions"] > 0
    assert outs[400, True] == outs[20, True] == outs[20, False]


def reference_beam_search(model, prompt, width, max_tokens, length_penalty, stop_ids):
    """Numpy beam search on the dense forward, written from the definition in beam_search.py."""
    def score(h):
        return h[1] / len(h[0]) ** length_penalty

    live, hyps = [([], 0.0)], []
    for step in range(1, max_tokens + 1):
        cands = []
        for b, (toks, cum) in enumerate(live):
            logp = log_softmax(np.asarray(model.forward_logits(prompt + toks))[-1])
            for rank, t in enumerate(np.argsort(-logp, kind="stable")[:2 * width]):
                cands.append((cum + logp[t], b, rank, int(t)))
        cands.sort(key=lambda c: (-c[0], c[1], c[2]))
        new = []
        for pos, (s, b, _, t) in enumerate(cands):
            if len(new) == width:
                break
            if t in stop_ids:
                if pos < width:
                    hyps.append((live[b][0] + [t], s, "stop"))
                continue
            new.append((live[b][0] + [t], s))
        if step == max_tokens:
            hyps += [(toks, s, "length") for toks, s in new]
            break
        if not new:
            break
        if len(hyps) >= width:
            worst = sorted((score(h) for h in hyps), reverse=True)[width - 1]
            if worst >= max(s for _, s in new) / step ** length_penalty:
                break
        live = new
    return sorted(hyps, key=lambda h: -score(h))


@pytest.mark.parametrize("width,length_penalty,use_stop", [
    (1, 1.0, False), (3, 1.0, False), (4, 0.5, True), (3, 2.0, True)])
def test_beam_search_equals_numpy_reference(model, width, length_penalty, use_stop):
    prompt = shared_prompts(3)[3 + width]
    stop_ids = set()
    if use_stop:  # a token that ends a hypothesis early: the second best first token
        stop_ids = {int(np.argsort(-np.asarray(model.forward_logits(prompt))[-1])[1])}
    want = reference_beam_search(model, prompt, width, 8, length_penalty, stop_ids)
    params = SamplingParams(use_beam_search=True, beam_width=width, n=width, max_tokens=8,
                            length_penalty=length_penalty, ignore_eos=True,
                            stop_token_ids=tuple(stop_ids))
    engine = make_engine(model)
    out = drain(engine, [(0, "b", prompt, params)])["b"]
    assert [c.token_ids for c in out.outputs] == [w[0] for w in want[:width]]
    assert [c.finish_reason for c in out.outputs] == [w[2] for w in want[:width]]
    for c, w in zip(out.outputs, want):
        assert c.cumulative_logprob == pytest.approx(w[1], abs=2e-3)
    if use_stop:  # the stop token really ended a hypothesis in the reference
        assert any(h[2] == "stop" for h in want)
    if width > 1:
        assert engine.stats()["cow_copies"] > 0  # forks wrote into shared tails


def test_beam_search_rejects_sampling_knobs():
    with pytest.raises(ValueError, match="top_p is not supported with beam search"):
        SamplingParams(use_beam_search=True, beam_width=2, top_p=0.5)
    with pytest.raises(ValueError, match="at most beam_width"):
        SamplingParams(use_beam_search=True, beam_width=2, n=3)
    with pytest.raises(ValueError, match="beam_width must be in"):
        SamplingParams(use_beam_search=True, beam_width=11)


def test_request_needing_more_slots_than_max_num_seqs_is_refused(model):
    engine = make_engine(model, max_num_seqs=2)
    with pytest.raises(ValueError, match="batch slots"):
        engine.add_request("a", [1, 2, 3], SamplingParams(n=3))
    assert not engine.has_unfinished_requests()


@pytest.mark.model
def test_real_model_greedy_equal_with_caching_on_and_off(smollm2_fp32):
    """SmolLM2: chat prompts sharing a system prompt, a small cache (preemption and eviction)."""
    from jaxserve import LLM
    m = smollm2_fp32
    system = {"role": "system", "content": "You are a concise assistant. Answer in one short "
              "sentence, use plain words, and never repeat the question back to the user."}
    questions = ["What is the capital of France?", "Name a primary colour.", "What is 2 + 2?",
                 "Who wrote Hamlet?", "What do bees make?", "Which planet is the largest?"]
    prompts = [m.tokenizer.apply_chat_template([system, {"role": "user", "content": q}], True)
               for q in questions]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    per_token = m.config.kv_bytes_per_token(4)
    results, stats = {}, {}
    for cache in (False, True):
        llm = LLM(m, block_size=16, max_num_seqs=4, max_model_len=128, warmup=False,
                  kv_cache_memory=20 * 16 * per_token, enable_prefix_caching=cache)
        results[cache] = [o.outputs[0].token_ids for o in
                          llm.generate(prompts, params, use_tqdm=False)]
        stats[cache] = llm.stats()
    assert results[True] == results[False]
    assert stats[True]["prefix_cache_hits_tokens"] > 0
    assert stats[True]["prompt_tokens_computed"] < stats[False]["prompt_tokens_computed"]
    ids = m.tokenizer.encode(prompts[0])
    bos = [m.tokenizer.bos_token_id] if m.tokenizer.add_bos and m.tokenizer.bos_token_id is not None else []
    assert results[True][0] == m.greedy_generate(bos + ids, 8, stop_token_ids=())


def test_beam_search_under_preemption_equals_reference(model):
    """A cache too small for all beams at once: held beams are preempted and recomputed."""
    prompt = shared_prompts(3)[7]  # the 45-token system prompt plus a question
    want = reference_beam_search(model, prompt, 4, 12, 1.0, set())
    engine = make_engine(model, blocks=20)
    params = SamplingParams(use_beam_search=True, beam_width=4, n=4, max_tokens=12,
                            ignore_eos=True)
    out = drain(engine, [(0, "b", prompt, params), (0, "g", shared_prompts(4)[7], GREEDY)])["b"]
    assert engine.stats()["num_preemptions"] > 0
    assert [c.token_ids for c in out.outputs] == [w[0] for w in want[:4]]
