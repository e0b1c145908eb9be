"""Faults that belong to one request (a NaN/inf row of logits, a detokenizer or grammar error)
end that request with finish_reason "error"; every other request finishes with exactly the
tokens of its solo dense greedy run, and no block leaks. Faults of the whole step raise out
of `step()` (the server's engine loop turns that into 503s). Injected with jaxserve/faults.py
on a tiny random model."""

import pytest

from jaxserve import EngineConfig
from jaxserve.faults import FaultConfig, InjectedFault
from models.random_init import random_model
from test_engine_errors import GREEDY, PROMPTS, TINY, drain, make_engine

BAD = [5, 5, 5, 5, 5, 5, 5, 5, 5, 5]


@pytest.fixture(scope="module")
def model():
    return random_model(TINY, seed=5)


@pytest.fixture(scope="module")
def want(model):
    return {rid: model.greedy_generate(p, GREEDY.max_tokens, stop_token_ids=())
            for rid, p in PROMPTS.items()}


def test_spec_parsing_and_validation():
    f = FaultConfig.parse("nan_request=#2, nan_at=3,nan_value=inf,step_stall=1,stall_s=0.5")
    assert (f.nan_request, f.nan_at, f.nan_value, f.step_stall, f.stall_s) == \
        ("#2", 3, "inf", 1, 0.5)
    assert FaultConfig.parse(None) is None and FaultConfig.parse(" ") is None
    for spec, message in [("nan_at=x", "nan_at must be an integer"),
                          ("bogus=1", "is not key=value with a key among"),
                          ("step_raise", "is not key=value"),
                          ("nan_value=zero", "nan_value must be one of"),
                          ("stall_s=-1", "stall_s must be a positive number")]:
        with pytest.raises(ValueError, match=message):
            EngineConfig(faults=spec)


def _serve_three(engine, bad_params=GREEDY):
    engine.add_request("a", PROMPTS["a"], GREEDY)
    engine.add_request("bad", BAD, bad_params)
    engine.add_request("b", PROMPTS["b"], GREEDY)
    return drain(engine)  # asserts 0 blocks and 0 runner slots leaked


def _check_others(done, want):
    for rid in ("a", "b"):
        assert done[rid].error is None and done[rid].outputs[0].finish_reason == "length"
        assert done[rid].outputs[0].token_ids == want[rid]


@pytest.mark.parametrize("value,nan_at,async_scheduling", [
    ("nan", 2, True), ("inf", 0, False)])
def test_poisoned_logits_row_fails_only_its_request(model, want, value, nan_at,
                                                    async_scheduling):
    engine = make_engine(model, async_scheduling=async_scheduling,
                         faults=f"nan_request=#2,nan_value={value},nan_at={nan_at}")
    assert engine.runner.poison_rows
    done = _serve_three(engine)
    bad = done["bad"]
    assert bad.error is not None and "non-finite logits" in bad.error
    assert [c.finish_reason for c in bad.outputs] == ["error"]
    assert len(bad.outputs[0].token_ids) == nan_at  # the poisoned token is not kept
    _check_others(done, want)
    engine.add_request("c", PROMPTS["c"], GREEDY)  # the engine goes on
    assert drain(engine)["c"].outputs[0].token_ids == want["c"]


def test_poisoned_branch_fails_all_branches_of_its_request(model, want):
    from jaxserve import SamplingParams
    engine = make_engine(model, faults="nan_request=bad,nan_at=1")
    done = _serve_three(engine, SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=8,
                                               ignore_eos=True))
    assert done["bad"].error is not None
    assert all(c.finish_reason == "error" for c in done["bad"].outputs)
    _check_others(done, want)


def test_without_faults_the_step_has_no_poison_input(model):
    engine = make_engine(model)
    assert engine.faults is None and not engine.runner.poison_rows
    assert engine.runner.step_template(16).inputs.poison is None


def test_detokenizer_error_fails_only_its_request(model, want):
    engine = make_engine(model, faults="detokenizer_request=bad")
    done = _serve_three(engine)
    assert done["bad"].error.startswith("InjectedFault: injected detokenizer fault")
    assert done["bad"].outputs[0].finish_reason == "error"
    _check_others(done, want)


def test_step_fault_raises_out_of_step(model):
    engine = make_engine(model, faults="step_raise=2")
    engine.add_request("a", PROMPTS["a"], GREEDY)
    engine.step()
    engine.step()
    with pytest.raises(InjectedFault, match="step 2"):
        engine.step()


def test_env_switch_is_read_at_start(model, monkeypatch):
    monkeypatch.setenv("JAXSERVE_FAULTS", "step_raise=0")
    engine = make_engine(model)
    engine.add_request("a", PROMPTS["a"], GREEDY)
    with pytest.raises(InjectedFault):
        engine.step()


def test_grammar_error_fails_only_its_request():
    from jaxserve import LLMEngine, SamplingParams
    from jaxserve.core.structured_outputs import StructuredOutputs
    from jaxserve.testing.tiny_chat import tiny_chat_model
    from jaxserve.testing.tiny_models import TINY_CHAT
    chat = tiny_chat_model(seed=0)
    engine = LLMEngine(EngineConfig(
        model=chat.source, warmup=False, max_num_seqs=4, max_model_len=64,
        max_num_batched_tokens=32, block_size=16, faults="grammar_request=bad",
        kv_cache_memory=16 * 16 * TINY_CHAT.kv_bytes_per_token(4)), model=chat)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = {"a": [3, 1, 4, 1, 5], "b": [2, 7, 1, 8]}
    engine.add_request("a", prompts["a"], greedy)
    engine.add_request("bad", [5, 5, 5], SamplingParams(
        temperature=0, max_tokens=6, structured_outputs=StructuredOutputs(choice=["yes", "no"])))
    engine.add_request("b", prompts["b"], greedy)
    done = drain(engine)
    assert done["bad"].error.startswith("InjectedFault: injected grammar fault")
    assert done["bad"].outputs[0].finish_reason == "error"
    for rid, p in prompts.items():
        assert done[rid].outputs[0].token_ids == chat.greedy_generate(p, 6, stop_token_ids=())
