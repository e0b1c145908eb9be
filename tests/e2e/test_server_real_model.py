"""The official `openai` client against the real SmolLM2 over HTTP: the path a user runs.

tests/server/test_server.py checks the protocol on a tiny model; here the point is the real model's
answers through it, so the engine skips warm-up and compiles only what these requests use.
"""

import openai
import pytest

from jaxserve import EngineConfig, LLMEngine
from jaxserve.server import EngineLoop, ServerConfig
from http_server import serving

MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def client(smollm2_fp32):
    engine = LLMEngine(EngineConfig(model=smollm2_fp32.source, warmup=False, max_num_seqs=4,
                                    max_model_len=256, max_num_batched_tokens=64),
                       model=smollm2_fp32)
    loop = EngineLoop(engine).start()
    try:
        with serving(loop, ServerConfig(served_model_name=MODEL)) as server:
            yield openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                                timeout=120)
    finally:
        loop.stop()


def test_completion_stream_and_chat_answer_on_smollm2(client):
    kw = dict(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0,
              extra_body={"ignore_eos": True})
    out = client.completions.create(**kw)
    assert out.choices[0].text.startswith(" Paris")
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw)
                       if c.choices)
    assert streamed == out.choices[0].text
    # HF transformers' greedy answer (tests/e2e/test_cli.py, tests/e2e/test_smollm2_parity.py).
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24, temperature=0)
    assert chat.choices[0].message.content == "The capital of France is Paris."
    assert chat.choices[0].finish_reason == "stop"
