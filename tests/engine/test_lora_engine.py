"""Multi-LoRA in the engine on a tiny random model and random PEFT-format adapters, against the
model with each adapter merged into its kernels (a dense forward, no LoRA code): more adapters
than device slots and than host slots across a workload, no compile after warm-up while they
load and swap, prefix caching kept apart per adapter, n-gram speculation, forks, and bad input
refused with nothing changed."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxserve import EngineConfig, LLMEngine, LoRARequest, SamplingParams
from jaxserve.core.lora import AdapterInUse, LoRAError, UnknownAdapter
from jaxserve.testing.peft_files import merged_params, scaling, write_adapter
from jaxserve.testing.tiny_models import TINY_GQA
from models.lora_names import LORA_TARGETS
from models.random_init import random_model

NEW = 6
ENGINE = dict(block_size=16, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=96,
              kv_cache_memory=1 << 22, enable_lora=True, max_lora_rank=8)
# (rank, alpha, targets, rsLoRA) of each adapter: five adapters, two device slots.
SPECS = [(8, 16, LORA_TARGETS, False), (4, 4, ("q_proj", "v_proj"), False),
         (8, 8, ("gate_proj", "up_proj", "down_proj"), True), (2, 6, ("o_proj", "k_proj"), False),
         (8, 32, ("q_proj", "down_proj"), False)]
PROMPTS = [[5, 17, 99, 3, 8], list(range(30, 70)), [200, 1, 1, 7], [9], list(range(100, 121))]


@pytest.fixture(scope="module")
def model():
    return random_model(TINY_GQA, seed=11)


@pytest.fixture(scope="module")
def adapters(model, tmp_path_factory):
    """{lora_int_id: (LoRARequest, merged params)} for SPECS (ids 1..5)."""
    root = tmp_path_factory.mktemp("adapters")
    params = jax.tree.map(np.asarray, model.params)
    out = {}
    for i, (rank, alpha, targets, rs) in enumerate(SPECS, start=1):
        written = write_adapter(root / f"a{i}", TINY_GQA, rank=rank, targets=targets, seed=i,
                                alpha=alpha, use_rslora=rs)
        out[i] = (LoRARequest(f"a{i}", i, str(root / f"a{i}")),
                  merged_params(params, written, scaling(rank, alpha, rs)))
    return out


@pytest.fixture(scope="module")
def want(model, adapters):
    """Greedy tokens of every (prompt, adapter or 0) by full recompute on merged weights."""
    out = {}
    for lora_id in [0, *adapters]:
        m = model if lora_id == 0 else dataclasses.replace(model, params=adapters[lora_id][1])
        for p, prompt in enumerate(PROMPTS):
            out[p, lora_id] = m.greedy_generate(prompt, NEW, stop_token_ids=[])
    return out


def generate(engine, jobs, params=None):
    params = params or SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    for i, (prompt, lora) in enumerate(jobs):
        engine.add_request(f"r{i}", prompt, params, lora_request=lora)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[f"r{i}"] for i in range(len(jobs))]


@pytest.fixture(scope="module")
def engine(model):
    # Two device slots and three adapters in host memory for five adapters.
    e = LLMEngine(EngineConfig(model="tiny", max_loras=2, max_cpu_loras=3, **ENGINE),
                  model=model)
    yield e
    e.close()


def test_adapters_outnumbering_device_and_host_slots_each_get_their_own_output(
        engine, adapters, want):
    jobs = [(prompt, adapters[k][0] if k else None)
            for k in [0, 1, 2, 3, 4, 5] for prompt in PROMPTS]
    # Twice: the second pass finds adapters dropped from host memory and reads them again.
    for _ in range(2):
        outs = generate(engine, jobs)
        for (prompt, lora), out in zip(jobs, outs):
            k = lora.lora_int_id if lora else 0
            assert out.outputs[0].token_ids == want[PROMPTS.index(prompt), k], (k, prompt)
    stats = engine.stats()
    assert stats["lora"]["device_loads"] > 5 and stats["lora"]["host_loads"] > 5
    assert stats["lora"]["in_host_memory"] <= 3
    assert stats["num_compiles_after_warmup"] == 0
    # The adapters change the outputs: the comparison above is not vacuous.
    assert sum(want[p, k] != want[p, 0] for p in range(len(PROMPTS)) for k in adapters) >= 10


def test_prefix_cache_is_kept_apart_per_adapter(engine, model, adapters):
    prompt = list(range(40, 80))  # two full blocks of 16, then a partial one
    a1, merged1 = adapters[1]
    expect = {None: model.greedy_generate(prompt, NEW, stop_token_ids=[]),
              a1: dataclasses.replace(model, params=merged1).greedy_generate(
                  prompt, NEW, stop_token_ids=[])}
    assert expect[None] != expect[a1]
    hits = []
    for lora in (a1, None, a1):
        before = engine.stats()["prefix_cache_hits_blocks"]
        out = generate(engine, [(prompt, lora)])[0]
        assert out.outputs[0].token_ids == expect[lora]
        hits.append(engine.stats()["prefix_cache_hits_blocks"] - before)
    # The base model finds none of the adapter's blocks; the adapter's second run its own.
    assert hits == [0, 0, 2]


def test_forks_keep_their_adapter(engine, adapters, want):
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, n=2)
    out = generate(engine, [(PROMPTS[0], adapters[2][0])], params)[0]
    assert [c.token_ids for c in out.outputs] == [want[0, 2]] * 2


def test_bad_adapters_are_refused_and_nothing_changes(engine, adapters, tmp_path):
    before = engine.lora.adapters()
    missing = LoRARequest("missing", 40, str(tmp_path / "nope"))
    with pytest.raises(LoRAError, match="nope"):
        engine.add_request("bad1", [1, 2], lora_request=missing)
    big = tmp_path / "big"
    write_adapter(big, TINY_GQA, rank=16, targets=["q_proj"], seed=0)
    with pytest.raises(LoRAError, match="max_lora_rank"):
        engine.add_request("bad2", [1, 2], lora_request=LoRARequest("big", 41, str(big)))
    with pytest.raises(LoRAError, match="already"):  # an id taken by another name
        engine.add_request("bad3", [1, 2], lora_request=LoRARequest("other", 1, str(big)))
    assert not engine.has_unfinished_requests()
    assert engine.lora.adapters() == before
    with pytest.raises(UnknownAdapter):
        engine.lora.remove("missing")


def test_an_adapter_in_use_cannot_be_removed(engine, adapters):
    a3 = adapters[3][0]
    engine.add_request("busy", PROMPTS[0], SamplingParams(max_tokens=3), lora_request=a3)
    with pytest.raises(AdapterInUse, match="in use by 1"):
        engine.lora.remove("a3")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.lora.remove("a3") == a3
    assert engine.lora.get("a3") is None
    # A request naming the unloaded adapter is refused, not a silent re-registration.
    with pytest.raises(UnknownAdapter, match="unloaded"):
        engine.add_request("late", PROMPTS[0], lora_request=a3)
    assert not engine.has_unfinished_requests() and engine.lora.get("a3") is None
    engine.lora.add(a3)  # back, for the other tests


def test_ngram_speculation_with_adapters(model, adapters, want):
    e = LLMEngine(EngineConfig(model="tiny", max_loras=2, warmup=False, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3}, **ENGINE), model=model)
    # A repetitive prompt so that n-gram drafts are proposed (and some accepted).
    jobs = [(PROMPTS[0] * 4, adapters[1][0]), (PROMPTS[0] * 4, None),
            (PROMPTS[4], adapters[2][0])]
    outs = generate(e, jobs)
    for (prompt, lora), out in zip(jobs, outs):
        m = model if lora is None else dataclasses.replace(
            model, params=adapters[lora.lora_int_id][1])
        assert out.outputs[0].token_ids == m.greedy_generate(prompt, NEW, stop_token_ids=[])
    assert e.stats()["speculation"]["num_draft_tokens"] > 0
    e.close()


def test_lora_requests_need_an_engine_serving_them(model):
    e = LLMEngine(EngineConfig(model="tiny", warmup=False, **{**ENGINE, "enable_lora": False}),
                  model=model)
    with pytest.raises(LoRAError, match="enable_lora=True"):
        e.add_request("x", [1, 2], lora_request=LoRARequest("a", 1, "/x"))
    assert not e.has_unfinished_requests() and e.lora is None


@pytest.mark.parametrize("kw, match", [
    (dict(max_loras=0), "max_loras"), (dict(max_lora_rank=-1), "max_lora_rank"),
    (dict(max_loras=3, max_cpu_loras=2), "max_cpu_loras"),
    (dict(speculative_config={"method": "draft_model", "model": "x",
                              "num_speculative_tokens": 2}), "draft model")])
def test_config_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(model="tiny", **{**ENGINE, **kw})


def test_a_request_whose_adapter_fails_to_load_again_ends_with_an_error(model, tmp_path, want,
                                                                        adapters):
    e = LLMEngine(EngineConfig(model="tiny", max_loras=1, max_cpu_loras=1, warmup=False,
                               **ENGINE), model=model)
    gone = tmp_path / "gone"
    write_adapter(gone, TINY_GQA, rank=4, targets=["q_proj"], seed=9)
    e.lora.add(LoRARequest("gone", 9, str(gone)))
    e.lora.add(adapters[2][0])  # host memory holds one adapter: "gone" is dropped
    (gone / "adapter_model.safetensors").unlink()
    outs = generate(e, [(PROMPTS[0], LoRARequest("gone", 9, str(gone))),
                        (PROMPTS[0], adapters[2][0])])
    assert outs[0].outputs[0].finish_reason == "error"
    assert "adapter_model.safetensors" in outs[0].error
    assert outs[1].outputs[0].token_ids == want[0, 2]  # the others run on
    e.close()
