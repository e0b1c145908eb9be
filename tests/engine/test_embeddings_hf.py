"""Embeddings from a decoder model against HF transformers' hidden states on the same weights
(tests/embedding_reference.py: a tiny random Llama saved by transformers; HF's
`output_hidden_states=True` last entry, after the final norm).

Two engines of the same shapes (so the second reuses the first's compiled programs from the
persistent cache), mean and last-token pooling. The KV cache is small (19 usable blocks of 16
tokens for prompts up to 256) and the step budget 16 tokens, so the embedding prompts are
chunked and preempted while generation requests decode in the same steps. float32 on both
sides: differences are summation order (~1e-6); the tolerances leave room for that only.
"""

import math

import numpy as np
import pytest

from embedding_reference import (ID_PROMPTS, LONG, MAX_MODEL_LEN, all_prompts,
                                 embedding_reference, hf_embedding, load_tiny_chat)
from jaxserve import EngineConfig, LLMEngine, PoolingParams, SamplingParams
from jaxserve.core.sampling_params import SamplingParamError
from jaxserve.testing.tiny_models import TINY_CHAT

pytestmark = pytest.mark.hf_ref

ATOL = 1e-5      # unit-norm embeddings (entries ~0.1), float32 vs float32
RAW_ATOL = 2e-4  # unnormalised pools of hidden states of magnitude ~1 (as the logits tests)
BUDGET = 16
BLOCKS = 20  # the null block + 19: a 256-token prompt takes 16 of them
SHARED = ID_PROMPTS[3]  # LONG's first 96 tokens (6 blocks), then its own
GENERATE = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
GEN_PROMPTS = [[3, 14, 15, 92, 65], [27, 18, 28, 18, 28, 45, 90, 45]]


def make_engine(pooling: str, warmup: bool, model=None, **kw) -> LLMEngine:
    kv = BLOCKS * 16 * TINY_CHAT.kv_bytes_per_token(4)
    return LLMEngine(EngineConfig(
        model="tiny-chat-hf", dtype="float32", enable_embeddings=True, pooling=pooling,
        max_num_seqs=4, max_num_batched_tokens=BUDGET, block_size=16,
        max_model_len=MAX_MODEL_LEN, kv_cache_memory=kv, structured_outputs=False,
        warmup=warmup, **kw), model=model or load_tiny_chat())


class PlanLog:
    """Records every plan the engine launches (wraps the runner's launch, nothing else)."""

    def __init__(self, engine):
        self.plans, launch = [], engine.runner.launch

        def recorded(plan):
            self.plans.append(plan)
            return launch(plan)
        engine.runner.launch = recorded


@pytest.fixture(scope="module")
def mean_engine():
    engine = make_engine("mean", warmup=True)
    return engine, PlanLog(engine)


@pytest.fixture(scope="module")
def last_engine():
    engine = make_engine("last", warmup=False)
    return engine, PlanLog(engine)


def drain(engine, add=(), embed_after: int = 0, embeds=()):
    """Adds `add` (id, prompt, params), steps `embed_after` times, adds `embeds`, then steps
    to the end; returns every finished output by request id."""
    done = {}

    def step():
        for out in engine.step():
            if out.finished:
                assert out.error is None, out.error
                done[out.request_id] = out
    for rid, prompt, params in add:
        engine.add_request(rid, prompt, params)
    for _ in range(embed_after):
        step()
    for rid, prompt, params in embeds:
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished_requests():
        step()
    stats = engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"], "blocks leaked"
    return done


def embed(engine, prompts, params=None):
    done = drain(engine, embeds=[(f"e{i}", p, params or PoolingParams())
                                 for i, p in enumerate(prompts)])
    return [np.asarray(done[f"e{i}"].outputs.embedding) for i in range(len(prompts))]


def check(got, prompt, pooling, normalize=True):
    want = hf_embedding(embedding_reference().of(prompt), pooling, normalize)
    np.testing.assert_allclose(got, want, atol=ATOL if normalize else RAW_ATOL, rtol=0,
                               err_msg=f"{pooling} pooling of a {len(prompt)}-token prompt")


def test_mean_pooling_batched_with_generation(mean_engine):
    engine, log = mean_engine
    prompts = all_prompts()
    gens = [(f"g{i}", p, GENERATE) for i, p in enumerate(GEN_PROMPTS)]
    embeds = [(f"e{i}", p, PoolingParams()) for i, p in enumerate(prompts)]
    done = drain(engine, gens, embed_after=2, embeds=embeds)
    for i, p in enumerate(prompts):
        assert done[f"e{i}"].prompt_token_ids == p
        check(np.asarray(done[f"e{i}"].outputs.embedding), p, "mean")
    # Generation ran in the same steps as embedding rows (decodes beside pooled chunks) ...
    mixed = [plan for plan in log.plans if plan.pooled and any(
        item.request_id.startswith("g") for item in plan.schedule.decodes)]
    assert mixed, "no step ran generation decodes and embedding rows together"
    # ... the long prompts were chunked, and the small cache preempted embeddings mid-prompt
    # (their pools restart with the recompute) ...
    long_id = f"e{prompts.index(LONG)}"
    assert sum(long_id in plan.pooled for plan in log.plans) >= math.ceil(len(LONG) / BUDGET)
    preempted = [sid for plan in log.plans for sid in plan.schedule.preempted]
    assert any(sid.startswith("e") for sid in preempted), preempted  # recomputed from 0
    # ... and its tokens are those it generates alone.
    alone = drain(engine, gens)
    for rid, _, _ in gens:
        assert done[rid].outputs[0].token_ids == alone[rid].outputs[0].token_ids
    assert len(done["g0"].outputs[0].token_ids) == GENERATE.max_tokens


def test_pooled_programs_compiled_at_warmup_only(mean_engine):
    engine, _ = mean_engine
    runner = engine.runner
    # Every step bucket twice (plain and pooled), the slot-write buckets, the block copy.
    assert runner.num_compiled == 2 * len(runner.shapes()) + len(runner.slot_buckets) + 1
    assert engine.stats()["num_compiles_after_warmup"] == 0  # after the mixed run above


def test_mean_pooling_skips_the_prefix_cache(mean_engine):
    engine, _ = mean_engine
    embed(engine, [LONG])  # its blocks are cached for others ...
    before = engine.stats()
    (got,) = embed(engine, [SHARED])  # ... but a mean pool computes every position
    after = engine.stats()
    check(got, SHARED, "mean")
    for key in ("prefix_cache_hits_tokens", "prefix_cache_queries_tokens"):
        assert after[key] == before[key], key
    assert after["prompt_tokens_computed"] - before["prompt_tokens_computed"] == len(SHARED)
    # A generation request with the same prefix reads the blocks the embedding wrote.
    drain(engine, [("g", SHARED, SamplingParams(max_tokens=1))])
    assert engine.stats()["prefix_cache_hits_tokens"] - after["prefix_cache_hits_tokens"] == 96


def test_last_token_pooling(last_engine):
    engine, _ = last_engine
    prompts = all_prompts()
    for p, got in zip(prompts, embed(engine, prompts)):
        check(got, p, "last")
    raw = embed(engine, ID_PROMPTS[:2], PoolingParams(normalize=False))
    for p, got in zip(ID_PROMPTS[:2], raw):
        check(got, p, "last", normalize=False)


def test_last_token_pooling_with_a_cached_prefix(last_engine):
    engine, log = last_engine
    embed(engine, [LONG])
    before = engine.stats()
    start = len(log.plans)
    (got,) = embed(engine, [SHARED])
    after = engine.stats()
    assert after["prefix_cache_hits_tokens"] - before["prefix_cache_hits_tokens"] == 96
    # Only the 5 tokens after the cached blocks ran, and the last token pooled is still HF's.
    assert after["prompt_tokens_computed"] - before["prompt_tokens_computed"] == len(SHARED) - 96
    assert [p.schedule.scheduled[0].start_pos for p in log.plans[start:]] == [96]
    check(got, SHARED, "last")


def test_dimensions(last_engine):
    engine, _ = last_engine
    (got,) = embed(engine, [[9]], PoolingParams(dimensions=TINY_CHAT.hidden_size))
    check(got, [9], "last")
    with pytest.raises(SamplingParamError, match="not a matryoshka model") as e:
        engine.add_request("x", [9], PoolingParams(dimensions=32))
    assert e.value.param == "dimensions"
    assert not engine.has_unfinished_requests()


def test_prompt_limits(last_engine):
    engine, _ = last_engine
    with pytest.raises(ValueError, match=r"exceeds max_model_len \(256\)"):
        engine.add_request("x", [5] * (MAX_MODEL_LEN + 1), PoolingParams())
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add_request("x", [], PoolingParams())
    assert not engine.has_unfinished_requests()


def test_lora_adapter_embeddings_equal_the_merged_model(tmp_path):
    """An embedding request with a LoRA adapter pools the adapted model's states: equal to
    an engine's on the adapter merged into the weights (numpy, float64)."""
    import dataclasses
    from jaxserve import LoRARequest
    from jaxserve.testing.peft_files import merged_params, scaling, write_adapter
    base = load_tiny_chat()
    written = write_adapter(tmp_path / "a", base.config, rank=4, targets=["q_proj", "up_proj"],
                            seed=1, alpha=8)
    merged = dataclasses.replace(base, params=merged_params(base.params, written, scaling(4, 8)))
    want = embed(make_engine("last", warmup=False, model=merged), [LONG, ID_PROMPTS[0]])
    engine = make_engine("last", warmup=False, model=base, enable_lora=True, max_lora_rank=4)
    lora = LoRARequest("a", 1, str(tmp_path / "a"))
    for i, p in enumerate([LONG, ID_PROMPTS[0]]):
        engine.add_request(f"l{i}", p, PoolingParams(), lora_request=lora)
    engine.add_request("b", LONG, PoolingParams())  # the base model, in the same steps
    done = drain(engine)
    for i, w in enumerate(want):
        np.testing.assert_allclose(done[f"l{i}"].outputs.embedding, w, atol=ATOL, rtol=0)
    check(np.asarray(done["b"].outputs.embedding), LONG, "last")
    assert np.abs(want[0] - done["b"].outputs.embedding).max() > 100 * ATOL  # it adapts


def test_engine_without_embeddings_refuses_them():
    engine = LLMEngine(EngineConfig(model="tiny-chat-hf", dtype="float32", max_num_seqs=2,
                                    max_num_batched_tokens=16, max_model_len=32,
                                    kv_cache_memory=1 << 20, warmup=False),
                       model=load_tiny_chat())
    with pytest.raises(SamplingParamError, match="enable_embeddings=True"):
        engine.add_request("x", [1, 2], PoolingParams())
    assert engine.runner.pooling is False
