"""Sampling parameters, stop conditions and request handling, end to end on the real model.

Expected values come from the dense forward (checked against HF elsewhere) plus numpy
implementations of each parameter's definition, never from the engine itself.
"""

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams

PROMPTS = ["The capital of France is", "Once upon a time", "def add(a, b):\n    return",
           "My favourite colour is"]
N = 12


@pytest.fixture(scope="module")
def model(smollm2_fp32):
    return smollm2_fp32


@pytest.fixture(scope="module")
def llm(model):
    return LLM(model, max_num_seqs=8, max_model_len=256, warmup=False)


@pytest.fixture(scope="module")
def greedy_ref(model):
    return [model.greedy_generate(model.tokenizer.encode(p), N, stop_token_ids=())
            for p in PROMPTS]


def token_ids(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=1, max_tokens=N, ignore_eos=True, seed=3),
    SamplingParams(temperature=1.5, top_p=1e-6, max_tokens=N, ignore_eos=True, seed=4),
    SamplingParams(temperature=1.0, min_p=1.0, max_tokens=N, ignore_eos=True, seed=5),
], ids=["top_k=1", "tiny top_p", "min_p=1"])
def test_filters_that_leave_one_token_equal_greedy(llm, greedy_ref, params):
    assert token_ids(llm.generate(PROMPTS, params, use_tqdm=False)) == greedy_ref


def test_seed_reproducible_and_batch_independent(llm):
    p = SamplingParams(temperature=1.0, max_tokens=N, ignore_eos=True, seed=1234)
    alone = token_ids(llm.generate([PROMPTS[1]], p, use_tqdm=False))[0]
    others = SamplingParams(temperature=0.7, max_tokens=N + 5, ignore_eos=True)
    batch = llm.generate(PROMPTS, [others, p, others, others], use_tqdm=False)
    assert token_ids(batch)[1] == alone


def test_different_seeds_differ(llm):
    outs = [token_ids(llm.generate([PROMPTS[1]], SamplingParams(
        temperature=1.0, max_tokens=N, ignore_eos=True, seed=s), use_tqdm=False))[0]
        for s in range(4)]
    assert len({tuple(o) for o in outs}) == 4


def test_unseeded_requests_differ(llm):
    p = SamplingParams(temperature=1.0, max_tokens=N, ignore_eos=True)
    outs = token_ids(llm.generate([PROMPTS[1]] * 4, p, use_tqdm=False))
    assert len({tuple(o) for o in outs}) > 1


def penalised_greedy(model, ids, n, rep, presence, frequency):
    """vLLM's definitions in numpy over the dense forward's logits."""
    out = []
    for _ in range(n):
        logits = model.forward_logits(ids + out)[-1].astype(np.float64)
        seen = np.zeros(logits.shape, bool)
        seen[ids + out] = True
        logits = np.where(seen, np.where(logits > 0, logits / rep, logits * rep), logits)
        counts = np.bincount(out, minlength=logits.size) if out else np.zeros(logits.size)
        logits -= presence * (counts > 0) + frequency * counts
        out.append(int(np.argmax(logits)))
    return out


@pytest.mark.parametrize("rep,presence,frequency", [(1.8, 0.0, 0.0), (1.0, 1.5, 0.0),
                                                    (1.0, 0.0, 2.0), (1.3, 0.5, 0.5)])
def test_penalties_follow_their_definitions(llm, model, greedy_ref, rep, presence, frequency):
    p = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True, repetition_penalty=rep,
                       presence_penalty=presence, frequency_penalty=frequency)
    ours = token_ids(llm.generate(PROMPTS[:2], p, use_tqdm=False))
    expected = [penalised_greedy(model, model.tokenizer.encode(t), N, rep, presence, frequency)
                for t in PROMPTS[:2]]
    assert ours == expected
    assert ours != greedy_ref[:2]  # the penalties changed something


@pytest.fixture(scope="module")
def chat_prompt(model):
    return model.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}])


def test_chat_greedy_and_eos(llm, chat_prompt):
    out = llm.generate(chat_prompt, SamplingParams(temperature=0, max_tokens=32),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == "The capital of France is Paris."
    assert out.finish_reason == "stop" and out.token_ids[-1] in llm.tokenizer.stop_token_ids
    chat = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                    SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    assert chat.outputs[0].text == out.text


@pytest.mark.parametrize("stop,expected", [(["Paris"], "The capital of France is "),
                                           (["of Fr", "Paris"], "The capital "),
                                           ([" is P"], "The capital of France")])
def test_stop_strings_cut_and_are_not_returned(llm, chat_prompt, stop, expected):
    out = llm.generate(chat_prompt, SamplingParams(temperature=0, max_tokens=32, stop=stop),
                       use_tqdm=False)[0].outputs[0]
    assert (out.text, out.finish_reason) == (expected, "stop")
    assert out.stop_reason in stop


def test_stop_token_ids_and_max_tokens(llm, greedy_ref):
    third = greedy_ref[0][2]
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=N,
                                                  stop_token_ids=[third]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == greedy_ref[0][:3] and out.finish_reason == "stop"
    assert out.stop_reason == third
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == greedy_ref[0][:5] and out.finish_reason == "length"


def test_min_tokens_bans_eos(llm, chat_prompt):
    eos = llm.tokenizer.stop_token_ids
    out = llm.generate(chat_prompt, SamplingParams(temperature=0, max_tokens=20, min_tokens=14),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 14
    assert not set(out.token_ids[:13]) & set(eos)


def test_logprobs_equal_log_softmax_of_dense_logits(llm, model):
    ids = model.tokenizer.encode(PROMPTS[2])
    out = llm.generate([ids], SamplingParams(temperature=0.8, max_tokens=6, logprobs=5, seed=9),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 6
    for i, tok in enumerate(out.token_ids):
        logits = model.forward_logits(ids + out.token_ids[:i])[-1].astype(np.float64)
        logp = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
        got = out.logprobs[i]
        assert got[tok] == pytest.approx(logp[tok], abs=1e-3)
        top5 = set(np.argsort(-logp)[:5].tolist())
        assert top5 <= set(got)
        for t in top5:
            assert got[t] == pytest.approx(logp[t], abs=1e-3)


def test_outputs_in_input_order_with_timing(llm, greedy_ref):
    outs = llm.generate(PROMPTS[::-1], SamplingParams(temperature=0, max_tokens=N,
                                                      ignore_eos=True), use_tqdm=False)
    assert token_ids(outs) == greedy_ref[::-1]
    assert [o.prompt for o in outs] == PROMPTS[::-1]
    m = outs[0].metrics
    assert m.time_to_first_token > 0 and m.decode_time >= 0


@pytest.mark.parametrize("prompt,params,message", [
    ("hi", SamplingParams(max_tokens=300), "exceeds max_model_len"),
    ([5, 49152], None, "token ids must be integers in"),
    ([-1, 3], None, "token ids must be integers in"),
    ([], None, "empty prompt"),
])
def test_bad_requests_rejected_and_engine_keeps_serving(llm, greedy_ref, prompt, params,
                                                        message):
    with pytest.raises(ValueError, match=message):
        llm.generate([PROMPTS[0], prompt], params or SamplingParams(), use_tqdm=False)
    stats = llm.stats()
    assert (stats["running"], stats["waiting"]) == (0, 0)
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=N, ignore_eos=True),
                       use_tqdm=False)
    assert token_ids(out) == greedy_ref[:1]


def test_abort_frees_blocks(llm):
    engine = llm.engine
    for i in range(3):
        engine.add_request(f"abort{i}", PROMPTS[i], SamplingParams(max_tokens=50,
                                                                   ignore_eos=True))
    engine.step()
    engine.step()
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("abort1", PROMPTS[0])
    assert all(engine.abort(f"abort{i}") for i in range(3))
    assert not engine.abort("never-added")
    stats = engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and not stats["running"]


def test_bf16_kv_cache_logprobs_close_to_dense_fp32(model):
    """kv_cache_dtype="bfloat16" under an fp32 model: half the bytes per token (so twice the
    blocks in the same budget), and logprobs within bf16 rounding of the fp32 dense forward."""
    budget = 40 * 16 * model.config.kv_bytes_per_token(4)  # 40 fp32 blocks
    engines = {d: LLM(model, max_num_seqs=4, max_model_len=256, warmup=False,
                      kv_cache_memory=budget, kv_cache_dtype=d) for d in ("auto", "bfloat16")}
    blocks = {d: e.engine.stats()["kv_blocks_total"] for d, e in engines.items()}
    assert blocks["bfloat16"] in (2 * blocks["auto"], 2 * blocks["auto"] - 1, 2 * blocks["auto"] + 1)
    prompts = [model.tokenizer.encode(p) for p in PROMPTS[:3]]
    outs = engines["bfloat16"].generate(prompts, SamplingParams(temperature=0, max_tokens=6,
                                                                logprobs=3, ignore_eos=True),
                                        use_tqdm=False)
    for ids, o in zip(prompts, outs):
        out = o.outputs[0]
        for i, tok in enumerate(out.token_ids):
            logits = model.forward_logits(ids + out.token_ids[:i])[-1].astype(np.float64)
            logp = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
            # bf16 K/V moves logits by a few hundredths on this model; greedy picks a token
            # within that of the fp32 argmax.
            assert out.logprobs[i][tok] == pytest.approx(logp[tok], abs=0.05)
            assert logp[tok] >= logp.max() - 0.1
