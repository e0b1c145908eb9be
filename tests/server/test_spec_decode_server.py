"""Speculative decoding through the HTTP server: a completion served with n-gram speculation
equals the dense model's greedy tokens, and /metrics exports the acceptance counters."""

import re

import requests

from jaxserve import EngineConfig, LLMEngine
from jaxserve.server import EngineLoop, ServerConfig
from http_server import serving
from jaxserve.testing.tiny_chat import tiny_chat_model

PROMPT = "a b c d a b c d a b c d a b c"


def test_completion_and_metrics_with_speculation():
    model = tiny_chat_model(seed=0)
    engine = LLMEngine(EngineConfig(
        model=model.source, warmup=False, max_num_seqs=2, max_model_len=128,
        max_num_batched_tokens=32, block_size=16, structured_outputs=False,
        speculative_config='{"method": "ngram", "num_speculative_tokens": 3, '
                           '"prompt_lookup_min": 1}'), model=model)
    loop = EngineLoop(engine).start()
    try:
        with serving(loop, ServerConfig(served_model_name="tiny")) as server:
            body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 24, "temperature": 0,
                    "ignore_eos": True}
            got = requests.post(server.url + "/v1/completions", json=body, timeout=120).json()
            text = requests.get(server.url + "/metrics", timeout=10).text
    finally:
        loop.stop()
    tok = model.tokenizer
    ids = ([tok.bos_token_id] if tok.add_bos else []) + tok.encode(PROMPT)
    want = model.greedy_generate(ids, 24, stop_token_ids=())
    assert got["choices"][0]["text"] == tok.decode(want)
    drafted = re.search(r"^jaxserve_spec_decode_num_draft_tokens_total (\S+)$", text, re.M)
    accepted = re.search(r"^jaxserve_spec_decode_num_accepted_tokens_total (\S+)$", text, re.M)
    assert drafted and float(drafted.group(1)) > 0
    assert accepted and 0 <= float(accepted.group(1)) <= float(drafted.group(1))
    assert "jaxserve_spec_decode_acceptance_rate" in text
