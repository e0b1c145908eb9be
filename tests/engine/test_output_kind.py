"""SamplingParams.output_kind on the real model: CUMULATIVE, DELTA and FINAL_ONLY report the same
completions (greedy ids checked against the dense forward, text against the tokenizer), DELTA
hands out only what is new and FINAL_ONLY nothing before the end."""

import dataclasses

import pytest

from jaxserve import LLM, EngineConfig, LLMEngine, RequestOutputKind, SamplingParams
from jaxserve.core.sampling_params import SamplingParamError

PROMPTS = ["The capital of France is", "Once upon a time", "def add(a, b):\n    return"]
N = 12
KINDS = tuple(RequestOutputKind)


@pytest.fixture(scope="module")
def model(smollm2_fp32):
    return smollm2_fp32


@pytest.fixture(scope="module")
def engine(model):
    return LLMEngine(EngineConfig(model=model.source, dtype=model.dtype, max_num_seqs=8,
                                  max_model_len=256, warmup=False), model=model)


@pytest.fixture(scope="module")
def greedy_ref(model):
    return [model.greedy_generate(model.tokenizer.encode(p), N, stop_token_ids=())
            for p in PROMPTS]


def run(engine, params_list):
    """All outputs each request's steps returned, by request index."""
    rids = [f"ok-{engine.next_request_id()}" for _ in params_list]
    for rid, prompt, p in zip(rids, PROMPTS, params_list):
        engine.add_request(rid, prompt, p)
    seen = {rid: [] for rid in rids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    return [seen[rid] for rid in rids]


def joined(outs, index=0):
    """(text, ids) of one branch, concatenating what each output adds (DELTA)."""
    branch = [c for o in outs for c in o.outputs if c.index == index]
    return "".join(c.text for c in branch), [t for c in branch for t in c.token_ids]


def test_kinds_agree_with_the_dense_forward(engine, model, greedy_ref):
    base = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
    for kind in KINDS:
        runs = run(engine, [dataclasses.replace(base, output_kind=kind)] * len(PROMPTS))
        for outs, ref in zip(runs, greedy_ref):
            final = outs[-1].outputs[0]
            assert outs[-1].finished and final.finish_reason == "length"
            text = model.tokenizer.decode(ref, skip_special_tokens=True)
            if kind is RequestOutputKind.DELTA:
                assert joined(outs) == (text, ref)
                for o in outs:  # each output carries its own delta only
                    c = o.outputs[0]
                    assert c.token_ids == c.delta_token_ids and c.text == c.delta_text
            else:
                assert (final.text, final.token_ids) == (text, ref)
            if kind is RequestOutputKind.FINAL_ONLY:
                assert len(outs) == 1
            else:
                assert len(outs) == N  # one per generated token


def test_delta_holds_back_a_stop_string(engine, model, greedy_ref):
    """The stop string is cut out of the joined deltas exactly as from the cumulative text."""
    text = model.tokenizer.decode(greedy_ref[1], skip_special_tokens=True)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), text
    expected = text[:text.index(stop)]
    params = [SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True, stop=stop,
                             output_kind=k) for k in KINDS]
    for kind, p in zip(KINDS, params):
        outs = run(engine, [p] * len(PROMPTS))[1]
        got = joined(outs)[0] if kind is RequestOutputKind.DELTA else outs[-1].outputs[0].text
        assert got == expected and outs[-1].outputs[0].finish_reason == "stop", kind


def test_delta_and_final_only_with_n_branches(engine):
    """n = 2, seeded: each branch's joined deltas and its final-only output equal the
    cumulative run's branch."""
    def params(kind):
        return SamplingParams(n=2, temperature=0.8, seed=11, max_tokens=N, ignore_eos=True,
                              output_kind=kind)
    cumulative = run(engine, [params(RequestOutputKind.CUMULATIVE)] * len(PROMPTS))
    delta = run(engine, [params(RequestOutputKind.DELTA)] * len(PROMPTS))
    final = run(engine, [params(RequestOutputKind.FINAL_ONLY)] * len(PROMPTS))
    for c, d, f in zip(cumulative, delta, final):
        assert len(f) == 1
        for i in range(2):
            want = next(o for o in c[-1].outputs if o.index == i)
            assert joined(d, i) == (want.text, want.token_ids)
            got = next(o for o in f[0].outputs if o.index == i)
            assert (got.text, got.token_ids) == (want.text, want.token_ids)


def test_generate_asks_for_final_outputs_only(model, greedy_ref):
    """LLM.generate returns the same completions, leaving the caller's params as they were."""
    llm = LLM(model, max_num_seqs=8, max_model_len=256, warmup=False)
    params = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == greedy_ref
    assert params.output_kind is RequestOutputKind.CUMULATIVE


def test_output_kind_is_validated():
    with pytest.raises(SamplingParamError, match="output_kind must be a RequestOutputKind"):
        SamplingParams(output_kind=2)
