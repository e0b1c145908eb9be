"""The paged engine on the real model against the dense forward (itself checked against HF).

Greedy decoding through the paged KV cache, continuous batching, chunked prefill and
preemption must give exactly the tokens of the dense full-recompute oracle: argmax is stable
under the tiny fp32 summation-order differences between the two paths except at near-ties,
which these prompts do not hit (the oracle's top-2 margin is asserted below).
"""

import numpy as np
import pytest

from compile_guard import count_compiles
from jaxserve import EngineConfig, LLMEngine, SamplingParams

PROMPTS = [
    "The capital of France is", "def add(a, b):\n    return", "Once upon a time",
    "1, 2, 3, 4,", "The quick brown fox", "In 1969, the first humans",
    "Water boils at", "import numpy as np\nx = np.", "My favourite colour is",
    "Translate to French: good morning ->", "The largest planet in the solar system is",
    "Q: What is 7 times 8?\nA:", "Roses are red,", "The chemical symbol for gold is",
    "SELECT name FROM users WHERE", "A haiku about autumn:\n",
    "Long prompt: " + "the history of the printing press and its effect on Europe " * 6,
]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def model(smollm2_fp32):
    return smollm2_fp32


@pytest.fixture(scope="module")
def prompt_ids(model):
    return [model.tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def oracle(model, prompt_ids):
    """Dense greedy continuations, and the smallest top-2 logit margin along them.

    model.greedy_generate's loop (a full-recompute forward per token, its argmax appended),
    with the margin read off the same logits instead of a second forward per token."""
    outs, margin = [], np.inf
    for ids in prompt_ids:
        out = []
        for _ in range(MAX_TOKENS):
            logits = model.forward_logits(ids + out)[-1]
            top2 = np.sort(logits)[-2:]
            margin = min(margin, top2[1] - top2[0])
            out.append(int(np.argmax(logits)))
        outs.append(out)
    # The loop above is greedy_generate's (no stop ids): one prompt through the method itself.
    assert outs[0] == model.greedy_generate(prompt_ids[0], MAX_TOKENS, stop_token_ids=())
    return outs, margin


def make_engine(model, **kw):
    kw.setdefault("warmup", False)
    kw.setdefault("max_model_len", 256)
    return LLMEngine(EngineConfig(model=model.source, dtype=model.dtype, **kw), model=model)


def run_staggered(engine, prompt_ids, params, first_batch=10, steps_before_rest=3):
    """Adds some requests, steps a few times, then adds the rest while those run."""
    results = {}

    def drain(steps):
        for _ in range(steps):
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = out.outputs[0].token_ids
            bm = engine.scheduler.block_manager
            bm.check_invariants()

    for i, ids in enumerate(prompt_ids[:first_batch]):
        engine.add_request(f"r{i}", ids, params)
    drain(steps_before_rest)
    for i, ids in enumerate(prompt_ids[first_batch:], start=first_batch):
        engine.add_request(f"r{i}", ids, params)
    while engine.has_unfinished_requests():
        drain(1)
    return [results[f"r{i}"] for i in range(len(prompt_ids))]


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def test_oracle_margins_are_clear(oracle):
    # Guards the premise above: a near-tie would make exact equality a coin flip.
    assert oracle[1] > 1e-3


@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_greedy_matches_dense(model, prompt_ids, oracle, block_size):
    engine = make_engine(model, block_size=block_size, max_num_seqs=8)
    assert run_staggered(engine, prompt_ids, GREEDY) == oracle[0]
    stats = engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["running"] == stats["waiting"] == 0


def test_chunked_prefill_matches_dense(model, prompt_ids, oracle):
    # A 16-token budget forces every prompt longer than 16 tokens through several chunks.
    engine = make_engine(model, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    assert max(len(p) for p in prompt_ids) > 3 * 16
    assert run_staggered(engine, prompt_ids, GREEDY) == oracle[0]
    assert engine.stats()["kv_blocks_free"] == engine.stats()["kv_blocks_total"]


def test_preemption_matches_dense(model, prompt_ids, oracle):
    # 11 usable blocks of 8 tokens: one max-length sequence fits, eight growing ones do not.
    per_token = model.config.kv_bytes_per_token(4)
    engine = make_engine(model, block_size=8, max_num_seqs=8, max_model_len=88,
                         kv_cache_memory=12 * 8 * per_token)
    assert max(len(p) for p in prompt_ids) + MAX_TOKENS <= 88
    assert run_staggered(engine, prompt_ids, GREEDY) == oracle[0]
    stats = engine.stats()
    assert stats["num_preemptions"] > 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_no_compiles_after_warmup(model, prompt_ids):
    engine = make_engine(model, block_size=16, max_num_seqs=4, max_model_len=128,
                         max_num_batched_tokens=64, warmup=True)
    mixed = [SamplingParams(temperature=0.0, max_tokens=12),
             SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_tokens=12, seed=1),
             SamplingParams(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5,
                            max_tokens=12, logprobs=3, min_tokens=4, stop=["\n"])]
    with count_compiles() as events:
        for i, ids in enumerate(prompt_ids):
            engine.add_request(str(i), ids[:100], mixed[i % 3])
        while engine.has_unfinished_requests():
            engine.step()
    assert events == []
    assert engine.stats()["num_compiles_after_warmup"] == 0


def test_compile_counter_sees_a_new_shape(model):
    # The guard above must be able to fail: a shape outside the buckets does compile.
    with count_compiles() as events:
        model.forward_logits(list(range(1, 300)))  # a dense bucket not used elsewhere
    assert events


def test_refuses_max_model_len_that_cannot_fit(model):
    per_token = model.config.kv_bytes_per_token(4)
    with pytest.raises(ValueError, match=r"max_model_len=256 needs 16 blocks .* num_blocks >= 17"):
        make_engine(model, block_size=16, max_model_len=256, kv_cache_memory=10 * 16 * per_token)
    with pytest.raises(ValueError, match="exceeds the model's context length"):
        make_engine(model, max_model_len=10000)
