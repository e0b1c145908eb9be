"""The paged engine on the tiny Mistral / Gemma 2 / Gemma 3 models (tests/windowed_models.py):
greedy tokens equal HF transformers' greedy tokens (full recompute in HF) for 9 prompts longer
than the 12-position window, under chunked prefill, with block sizes that do not divide the
window; the XLA path serves them (the native CPU kernel has no window: the engine falls back,
saying why), and prefix caching stays correct with windows."""

import logging

import numpy as np
import pytest

from jaxserve import EngineConfig, LLMEngine, SamplingParams
from models import load_model
from windowed_models import (GREEDY_PROMPTS, MAX_NEW_TOKENS, NAMES, SHARED_PROMPTS, WINDOW,
                             windowed_reference)

pytestmark = pytest.mark.hf_ref

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def reference():
    return windowed_reference()


@pytest.fixture(scope="module")
def models(reference):
    return {name: load_model(reference["workdir"] / name) for name in NAMES}


def make_engine(model, **kw):
    kw.setdefault("warmup", False)
    kw.setdefault("max_model_len", 128)
    kw.setdefault("kv_cache_memory", 8 << 20)
    return LLMEngine(EngineConfig(model=model.source, dtype=model.dtype, **kw), model=model)


def run(engine, prompts, slid_past=None):
    """Greedy outputs in prompt order; `slid_past` collects stats()' kv_blocks_slid_past."""
    results = {}
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, GREEDY)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        engine.scheduler.block_manager.check_invariants()
        if slid_past is not None:
            slid_past.append(engine.stats()["kv_blocks_slid_past"])
    return [results[f"r{i}"] for i in range(len(prompts))]


def hf_greedy(reference, name):
    n = len(GREEDY_PROMPTS) + len(SHARED_PROMPTS)
    out = [[int(t) for t in reference[f"{name}/greedy/{i}"]] for i in range(n)]
    return out[:len(GREEDY_PROMPTS)], out[len(GREEDY_PROMPTS):]


# One engine per family (compiles dominate): block sizes 8 and 16, neither dividing the window.
@pytest.mark.parametrize("name,block_size", [("mistral", 8), ("gemma2", 16), ("gemma3", 8)])
def test_chunked_greedy_matches_hf(reference, models, name, block_size, caplog):
    assert sum(len(p) > WINDOW for p in GREEDY_PROMPTS) >= 8 and WINDOW % block_size
    with caplog.at_level(logging.INFO, logger="jaxserve"):
        # A 16-token budget splits every prompt over 16 tokens into chunks.
        engine = make_engine(models[name], block_size=block_size, max_num_seqs=4,
                             max_num_batched_tokens=16)
    assert engine.runner.attention.name == "xla"
    assert "sliding window (the native kernel has none)" in caplog.text
    want, want_shared = hf_greedy(reference, name)
    slid_past = []
    assert run(engine, GREEDY_PROMPTS, slid_past) == want
    # Mistral's layers all slide: long rows leave blocks behind. Gemma's global layers do not.
    assert (max(slid_past) > 0) == (name == "mistral")
    # Prefix caching with a window: the shared prompts reuse the first prompts' cached blocks
    # (including blocks every layer's window has left behind: global layers still read them).
    hits = engine.stats()["prefix_cache_hits_blocks"]
    assert run(engine, SHARED_PROMPTS) == want_shared
    assert engine.stats()["prefix_cache_hits_blocks"] - hits >= \
        len(SHARED_PROMPTS) * (40 // block_size)
