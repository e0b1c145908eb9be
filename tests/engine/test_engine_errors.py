"""A request the engine cannot run must not wedge it: refused when added, or, failing inside a
step, finished with an error while the other requests run on (tiny random model)."""

import dataclasses

import pytest

from jaxserve import EngineConfig, LLMEngine, SamplingParams
from jaxserve.core.sampling_params import MAX_STOP_IDS, SamplingParamError
from jaxserve.core.sequence import PLACEHOLDER
from models.random_init import random_model
from jaxserve.testing.tiny_models import TINY_GQA

BS = 4
EOS = 7
TINY = dataclasses.replace(TINY_GQA, eos_token_ids=(EOS,))
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = {"a": [3, 1, 4, 1, 5, 9, 2, 6], "b": [2, 7, 1, 8, 2, 8], "c": [1, 6, 1, 8, 0, 3, 3]}


@pytest.fixture(scope="module")
def model():
    return random_model(TINY, seed=5)


@pytest.fixture(scope="module")
def want(model):
    return {rid: model.greedy_generate(p, GREEDY.max_tokens, stop_token_ids=())
            for rid, p in PROMPTS.items()}


def make_engine(model, **kw):
    kw = dict(block_size=BS, max_num_seqs=8, max_model_len=64, max_num_batched_tokens=32,
              warmup=False, kv_cache_memory=60 * BS * TINY.kv_bytes_per_token(4)) | kw
    return LLMEngine(EngineConfig(model="tiny", **kw), model=model)


def drain(engine):
    """Steps to the end, checking the block manager every step; no block may leak."""
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.scheduler.block_manager.check_invariants()
    stats = engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"], "blocks leaked"
    assert stats["running"] == stats["waiting"] == 0 and not engine.requests
    assert not engine.runner.slot_of, "runner slots leaked"
    return done


@pytest.mark.parametrize("stop_ids,ignore_eos", [
    (tuple(range(10, 10 + MAX_STOP_IDS + 1)), True),  # 17 stop ids
    (tuple(range(10, 10 + MAX_STOP_IDS)), False),  # 16 stop ids plus the model's EOS
])
def test_min_tokens_with_too_many_stop_ids_refused_at_add(model, want, stop_ids, ignore_eos):
    engine = make_engine(model)
    engine.add_request("a", PROMPTS["a"], GREEDY)
    bad = SamplingParams(min_tokens=2, max_tokens=8, stop_token_ids=stop_ids,
                         ignore_eos=ignore_eos)
    with pytest.raises(SamplingParamError, match="at most 16 stop token ids") as info:
        engine.add_request("bad", PROMPTS["b"], bad)
    assert info.value.param == "stop_token_ids"
    assert "bad" not in engine.requests and engine.scheduler.num_waiting == 1
    done = drain(engine)
    assert set(done) == {"a"} and done["a"].outputs[0].token_ids == want["a"]


def test_sixteen_banned_ids_are_served(model):
    engine = make_engine(model)
    ok = SamplingParams(min_tokens=2, max_tokens=4, stop_token_ids=tuple(range(10, 26)),
                        ignore_eos=True)  # 16: the sampler's table is full, not over
    engine.add_request("ok", PROMPTS["a"], ok)
    out = drain(engine)["ok"].outputs[0]
    assert len(out.token_ids) >= 2 and out.finish_reason in ("stop", "length")


@pytest.mark.parametrize("bad_params,fail_after", [
    (SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=8, ignore_eos=True), 0),
    (SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=8, ignore_eos=True), 4),
    (SamplingParams(use_beam_search=True, beam_width=3, n=2, max_tokens=8, ignore_eos=True), 5),
], ids=["n3-first-step", "n3-forked", "beam-forked"])
def test_request_failing_inside_a_step_ends_with_error(model, want, monkeypatch, bad_params,
                                                       fail_after):
    """A fault injected into one request's row preparation: that request (all its branches or
    beams) ends with finish_reason "error", the others finish with the dense greedy tokens."""
    engine = make_engine(model)
    calls = {"n": 0}
    prepare = engine._prepare_row

    def faulty(state, item):
        if state.request_id == "bad":
            calls["n"] += 1
            if calls["n"] > fail_after:
                raise RuntimeError("injected fault")
        return prepare(state, item)

    monkeypatch.setattr(engine, "_prepare_row", faulty)
    engine.add_request("a", PROMPTS["a"], GREEDY)
    engine.add_request("bad", [5, 5, 5, 5, 5, 5, 5, 5, 5, 5], bad_params)
    engine.add_request("b", PROMPTS["b"], GREEDY)
    done = drain(engine)
    assert calls["n"] == fail_after + 1  # failed once, then gone
    bad = done["bad"]
    assert bad.finished and bad.error == "RuntimeError: injected fault"
    assert bad.outputs and all(c.finish_reason == "error" for c in bad.outputs)
    # Failed after its step was committed: no placeholder of an id never applied.
    assert all(PLACEHOLDER not in c.token_ids for c in bad.outputs)
    for rid in ("a", "b"):
        assert done[rid].error is None
        assert done[rid].outputs[0].token_ids == want[rid]
        assert done[rid].outputs[0].finish_reason == "length"
    # The engine goes on: a later request runs normally.
    engine.add_request("c", PROMPTS["c"], GREEDY)
    assert drain(engine)["c"].outputs[0].token_ids == want["c"]
