"""Completions with `echo` and `logprobs` (lm-evaluation-harness's log-likelihood request): the
echoed prompt's tokens carry their prompt logprobs, checked against the tiny chat model's own
dense forward (the engine-level check against HF on SmolLM2 is
tests/engine/test_prompt_logprobs.py). An engine of its own: the prompt-logprobs step variant
compiles when first met, which tests/server/test_server.py's engine must not see (it checks
that nothing compiles after warm-up).
"""

import numpy as np
import openai
import pytest

from jaxserve.server import ServerConfig
from http_server import serving, tiny_chat_loop

MODEL = "tiny-chat"
PROMPT = "The largest planet in the solar system is"


@pytest.fixture(scope="module")
def loop():
    with tiny_chat_loop(max_model_len=128, max_num_batched_tokens=64) as loop:
        yield loop


@pytest.fixture(scope="module")
def client(loop):
    with serving(loop, ServerConfig(served_model_name=MODEL)) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def engine(loop):
    return loop.engine


def test_echo_with_logprobs_scores_the_prompt(client, engine):
    """lm-evaluation-harness's log-likelihood request: the echoed prompt's tokens carry their
    logprobs (the first none), then the completion's; streamed, the same lists."""
    ids = engine.model.tokenizer.encode(PROMPT)
    kw = dict(model=MODEL, prompt=ids, max_tokens=2, temperature=0, logprobs=2)
    out = client.completions.create(echo=True, **kw)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(ids) + 2
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    logits = engine.model.forward_logits(ids)  # [T, V]: the model's own dense forward
    shifted = logits - logits.max(-1, keepdims=True)
    log_softmax = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    np.testing.assert_allclose(lp.token_logprobs[1:len(ids)],
                               [log_softmax[p - 1, ids[p]] for p in range(1, len(ids))],
                               atol=1e-5, rtol=0)
    for p in range(1, len(ids)):  # the 2 alternatives are the 2 most likely
        top = sorted(lp.top_logprobs[p].values(), reverse=True)
        np.testing.assert_allclose(top, np.sort(log_softmax[p - 1])[::-1][:len(top)], atol=1e-5)
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    plain = client.completions.create(**kw).choices[0].logprobs  # the completion part
    assert lp.tokens[len(ids):] == plain.tokens
    np.testing.assert_allclose(lp.token_logprobs[len(ids):], plain.token_logprobs, atol=1e-6)
    chunks = list(client.completions.create(echo=True, stream=True, **kw))
    streamed = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for chunk in chunks:
        for choice in chunk.choices:
            for key, values in streamed.items():
                values.extend(getattr(choice.logprobs, key) if choice.logprobs else [])
    assert streamed == {"tokens": lp.tokens, "token_logprobs": lp.token_logprobs,
                        "text_offset": lp.text_offset}
