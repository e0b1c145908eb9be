"""Structured outputs: the spec's validation, the device bitmask against llguidance's numpy
reference, and the real model's outputs checked by independent validators (jsonschema, re)."""

import json
import re

import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from jaxserve.core.sampling_params import SamplingParamError, SamplingParams
from jaxserve.core.structured_outputs import StructuredOutputs
from jaxserve.runtime.sampler import SamplingTensors, apply_token_bitmask, sample
from jaxserve.testing.structured_schemas import SCHEMAS


# ---- the spec -------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    ({}, "exactly one"),
    ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"json": [1, 2]}, "must be an object"),
    ({"choice": []}, "1 to"),
    ({"choice": "abc"}, "list of strings"),
    ({"choice": ["a", ""]}, "non-empty"),
    ({"regex": ""}, "non-empty string"),
    ({"grammar": 5}, "non-empty string"),
])
def test_spec_is_validated(kwargs, match):
    with pytest.raises(SamplingParamError, match=match) as e:
        StructuredOutputs(**kwargs)
    assert e.value.param == "structured_outputs"


def test_spec_key_is_canonical():
    a = StructuredOutputs(json={"type": "object", "properties": {}})
    b = StructuredOutputs(json='{"properties": {}, "type": "object"}')
    assert a.key == b.key and a.key != StructuredOutputs(json_object=True).key
    # The order of properties is what the output follows: kept, and part of the key.
    xy = StructuredOutputs(json={"properties": {"y": {}, "x": {"type": "string"}}})
    assert list(json.loads(xy.json)["properties"]) == ["y", "x"]
    assert xy.key != StructuredOutputs(json={"properties": {"x": {"type": "string"},
                                                            "y": {}}}).key


@pytest.mark.parametrize("name, value", [("use_beam_search", True), ("min_tokens", 2)])
def test_unsupported_combinations_are_refused(name, value):
    spec = StructuredOutputs(choice=["a"])
    extra = {"beam_width": 2} if name == "use_beam_search" else {}
    with pytest.raises(SamplingParamError, match="not supported with structured_outputs") as e:
        SamplingParams(structured_outputs=spec, max_tokens=4, **{name: value}, **extra)
    assert e.value.param == name
    with pytest.raises(SamplingParamError, match="StructuredOutputs"):
        SamplingParams(structured_outputs={"json": {}})


# ---- the device bitmask ---------------------------------------------------------------------

def test_bitmask_matches_llguidance_reference():
    import llguidance.numpy as lnp
    rng = np.random.default_rng(0)
    s, v = 5, 1000  # V not a multiple of 32: the last word's high bits are padding
    logits = rng.normal(size=(s, v)).astype(np.float32)
    mask = rng.integers(-2 ** 31, 2 ** 31, size=(s, -(-v // 32)), dtype=np.int64)
    mask = mask.astype(np.int32)
    mask[0] = -1  # an unconstrained row: untouched
    want = logits.copy()
    lnp.apply_token_bitmask_inplace(want, mask)
    got = np.asarray(apply_token_bitmask(jnp.asarray(logits), jnp.asarray(mask)))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got[0], logits[0])


def _mask_allowing(rows: list[list[int]], v: int) -> np.ndarray:
    mask = np.zeros((len(rows), -(-v // 32)), np.uint32)
    for r, ids in enumerate(rows):
        for t in ids:
            mask[r, t // 32] |= np.uint32(1 << (t % 32))
    return mask.view(np.int32)


def test_sampler_picks_only_allowed_tokens():
    rng = np.random.default_rng(1)
    s, v = 4, 300
    logits = jnp.asarray(rng.normal(size=(s, v)).astype(np.float32))
    allowed = [[3, 17, 250], [299], [0, 1, 2, 64, 65], list(range(v))]
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=1),
              SamplingParams(temperature=1.5, top_k=2, seed=2),
              SamplingParams(temperature=0.0)]
    hist = jnp.zeros((s, 8), jnp.int32)
    lens = jnp.ones((s,), jnp.int32)
    mask = jnp.asarray(_mask_allowing(allowed, v))
    for pos in range(20):
        st = SamplingTensors.from_params(params, [p.seed for p in params], [0] * s, size=s)
        out = sample(logits, st, hist, lens, lens, jnp.full((s,), pos), mask=mask)
        tokens = np.asarray(out.tokens)
        for r in range(s):
            assert tokens[r] in allowed[r]
        raw = np.asarray(logits)
        assert tokens[0] == max(allowed[0], key=lambda t: raw[0, t])  # greedy among allowed
        assert tokens[3] == raw[3].argmax()  # all allowed: the unconstrained greedy token
        # logprobs are those of the raw logits, as without a mask
        lse = np.log(np.exp(raw.astype(np.float64)).sum(-1))
        np.testing.assert_allclose(np.asarray(out.logprob),
                                   raw[np.arange(s), tokens] - lse, rtol=1e-5, atol=1e-5)


# ---- the real model -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llm(smollm2_fp32):
    from jaxserve import LLM
    return LLM(smollm2_fp32, max_num_seqs=32, max_model_len=768, warmup=False)


def _chat(llm, text: str) -> str:
    return llm.tokenizer.apply_chat_template(
        [{"role": "system", "content": "You reply with JSON only."},
         {"role": "user", "content": text}])


def test_json_schemas_validate_at_temperature(llm):
    assert len(SCHEMAS) >= 30
    prompts = [_chat(llm, f"Give an example value for this JSON schema: {json.dumps(s)}")
               for s in SCHEMAS]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=160,
                             structured_outputs=StructuredOutputs(json=s))
              for i, s in enumerate(SCHEMAS)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for schema, out in zip(SCHEMAS, outs):
        o = out.outputs[0]
        assert out.error is None and o.finish_reason == "stop", (schema, o.text)
        jsonschema.validate(json.loads(o.text), schema)
    assert llm.engine.stats()["running"] == 0


def test_choice_regex_and_n(llm):
    choices = ["Paris", "London", "Berlin", "a city I do not know"]
    regex = r"[0-9]{3}-[0-9]{4}"
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=16,
                             structured_outputs=StructuredOutputs(choice=choices))
              for i in range(4)]
    params += [SamplingParams(temperature=0.8, seed=i, max_tokens=16,
                              structured_outputs=StructuredOutputs(regex=regex))
               for i in range(4)]
    params.append(SamplingParams(temperature=0.8, seed=9, max_tokens=16, n=3,
                                 structured_outputs=StructuredOutputs(regex=regex)))
    prompts = ["The capital of France is"] * 4 + ["Call me at"] * 5
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out in outs[:4]:
        assert out.outputs[0].text in choices
    texts = [o.text for out in outs[4:] for o in out.outputs]
    assert len(texts) == 4 + 3
    for text in texts:
        assert re.fullmatch(regex, text), text


def test_permissive_constraint_keeps_greedy_output(llm):
    prompts = ["The quick brown fox", "def fibonacci(n):", "Once upon a time",
               _chat(llm, "Name three colours.")]
    free = SamplingParams(temperature=0.0, max_tokens=24)
    anything = SamplingParams(temperature=0.0, max_tokens=24,
                              structured_outputs=StructuredOutputs(regex=r"(?s:.*)"))
    plain = llm.generate(prompts, free, use_tqdm=False)
    constrained = llm.generate(prompts, anything, use_tqdm=False)
    for a, b in zip(plain, constrained):
        assert b.error is None
        assert b.outputs[0].token_ids == a.outputs[0].token_ids


def test_stop_strings_and_max_tokens_with_a_constraint(llm):
    spec = StructuredOutputs(regex=r"(ab)+")
    short, stopped = llm.generate(["x"] * 2, [
        SamplingParams(temperature=0.8, seed=1, max_tokens=3, structured_outputs=spec),
        SamplingParams(temperature=0.8, seed=2, max_tokens=40, stop=["ba"],
                       structured_outputs=spec)], use_tqdm=False)
    assert short.outputs[0].finish_reason == "length" and len(short.outputs[0].token_ids) == 3
    assert re.fullmatch(r"(ab)*a?", short.outputs[0].text)
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].text == "a"


def test_a_bad_grammar_fails_only_its_request(llm):
    outs = llm.generate(["a", "b"], [
        SamplingParams(max_tokens=4, structured_outputs=StructuredOutputs(regex="((")),
        SamplingParams(temperature=0.0, max_tokens=4)], use_tqdm=False)
    assert outs[0].error and "invalid regex" in outs[0].error
    assert outs[0].outputs[0].finish_reason == "error"
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 4


def test_a_rejected_token_ends_the_request_with_an_error(llm, monkeypatch):
    # With the mask switched off the model writes tokens the grammar rejects: the request
    # ends with an error, its neighbour runs on, and the engine stays usable.
    monkeypatch.setattr(llm.engine.structured.compiler, "fill", lambda mask, rows: None)
    outs = llm.generate(["Hello", "Hello"], [
        SamplingParams(temperature=0.0, max_tokens=8,
                       structured_outputs=StructuredOutputs(regex="[0-9]{8}")),
        SamplingParams(temperature=0.0, max_tokens=8)], use_tqdm=False)
    assert outs[0].error is not None and "rejected token" in outs[0].error
    assert outs[0].outputs[0].finish_reason == "error"
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 8
    monkeypatch.undo()
    again = llm.generate(["Hello"], SamplingParams(
        temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputs(regex="[0-9]{8}")),
        use_tqdm=False)[0]
    assert again.error is None and re.fullmatch("[0-9]{8}", again.outputs[0].text)
    stats = llm.engine.stats()
    assert stats["running"] == 0 and stats["kv_blocks_in_use"] == 0


def test_constrained_steps_compile_nothing_after_warmup(smollm2_fp32):
    # The masked program variant of every bucket is compiled at warm-up: a mix of
    # constrained and free requests (prefill chunks, decodes, n > 1) compiles nothing new.
    from compile_guard import count_compiles
    from jaxserve import EngineConfig, LLMEngine
    engine = LLMEngine(EngineConfig(model=smollm2_fp32.source, warmup=True, max_num_seqs=4,
                                    max_num_batched_tokens=16, max_model_len=128),
                       model=smollm2_fp32)
    assert engine.wait_until_warm(timeout=900)  # the masked variants compile after warm-up
    specs = [StructuredOutputs(regex=r"[a-z ]{1,12}"), None,
             StructuredOutputs(json={"type": "array", "items": {"type": "integer"},
                                     "maxItems": 3}), StructuredOutputs(choice=["yes", "no"])]
    with count_compiles() as events:
        for i, spec in enumerate(specs):
            engine.add_request(str(i), "Tell me something about the sea, in a few words:",
                               SamplingParams(temperature=0.8, seed=i, max_tokens=10,
                                              n=2 if i == 2 else 1, structured_outputs=spec))
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
    assert events == [] and engine.stats()["num_compiles_after_warmup"] == 0
    assert sorted(done) == ["0", "1", "2", "3"] and all(o.error is None for o in done.values())
    assert done["3"].outputs[0].text in ("yes", "no")


def test_masked_variants_compile_after_warmup_without_holding_others(smollm2_fp32,
                                                                      monkeypatch):
    """Serving starts before the masked variants are compiled: a free request runs to the end
    meanwhile, a constrained one waits (no slot held) and runs once they are ready."""
    import threading
    from jaxserve import EngineConfig, LLMEngine
    from jaxserve.runtime.runner import ModelRunner
    gate, real = threading.Event(), ModelRunner.masked_warmup

    def gated(self):
        job = real(self)

        def run():
            assert gate.wait(timeout=600)
            return job()
        return run
    monkeypatch.setattr(ModelRunner, "masked_warmup", gated)
    engine = LLMEngine(EngineConfig(model=smollm2_fp32.source, warmup=True, max_num_seqs=4,
                                    max_num_batched_tokens=16, max_model_len=128),
                       model=smollm2_fp32)
    masked = [k for k in engine.runner._executables if k[2]]
    assert masked == [] and not engine.wait_until_warm(timeout=0)
    engine.add_request("c", "Pick one:", SamplingParams(
        temperature=0.0, max_tokens=4, structured_outputs=StructuredOutputs(choice=["yes", "no"])))
    engine.add_request("f", "The sea is", SamplingParams(temperature=0.0, max_tokens=4))
    done = {}
    while "f" not in done:
        for out in engine.step():
            done[out.request_id] = out
        assert engine.stats()["running"] + engine.stats()["waiting"] <= 1  # "c" is outside
    assert "c" not in done and engine.has_unfinished_requests()
    gate.set()
    assert engine.wait_until_warm(timeout=900)
    assert engine.stats()["num_compiles_after_warmup"] == 0
    assert len([k for k in engine.runner._executables if k[2]]) == len(engine.runner.shapes())
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    assert done["c"].outputs[0].text in ("yes", "no") and done["c"].error is None


def test_beam_search_runs_beside_a_constrained_request(llm):
    outs = llm.generate(["The sea is", "My number is"], [
        SamplingParams(use_beam_search=True, beam_width=2, max_tokens=4),
        SamplingParams(temperature=0.0, max_tokens=6,
                       structured_outputs=StructuredOutputs(regex="[0-9]{6}"))], use_tqdm=False)
    assert outs[0].error is None and 1 <= len(outs[0].outputs[0].token_ids) <= 4
    assert outs[1].error is None and re.fullmatch("[0-9]{6}", outs[1].outputs[0].text)
