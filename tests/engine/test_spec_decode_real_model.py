"""Speculative decoding on SmolLM2: greedy output with speculation equals greedy output
without it, token for token, for 16 prompts, n-gram (two k) and a W8A8 SmolLM2 draft, with
preemption forced by a small KV pool. (The engine without speculation is checked against the
dense forward and HF elsewhere: tests/e2e/test_smollm2_parity.py.)"""

import pytest

from jaxserve import LLM, SamplingParams

TEXT = ("def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n")
PROMPTS = [f"Repeat this code exactly:\n{TEXT}\nRepeated:\n", "The capital of France is",
           "Once upon a time", "Copy the list: apples, pears, plums, figs. Copy:",
           "1, 2, 3, 4, 5, 6,", "My favourite colour is", "a b c d e f g a b c",
           "Translate to French: the cat", "def add(a, b):\n    return",
           "The quick brown fox jumps over the lazy dog. The quick brown",
           "Q: What is 2 + 2?\nA:", "import numpy as np\nimport", "Hello, my name is",
           "for i in range(10):\n    print(i)\nfor i in range(10):\n", "Roses are red,",
           "The weather today is"]
N = 20
BASE = dict(max_num_seqs=4, max_model_len=96, max_num_batched_tokens=64, warmup=False)


@pytest.fixture(scope="module")
def reference(smollm2_fp32):
    llm = LLM(smollm2_fp32, **BASE)
    params = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 2},
    {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1},
    {"method": "draft_model", "model": "smollm2-135m", "draft_quantization": "w8a8",
     "num_speculative_tokens": 3},
], ids=["ngram-k2", "ngram-k5", "draft-w8a8-k3"])
def test_greedy_with_speculation_equals_without(smollm2_fp32, reference, spec):
    per_token = smollm2_fp32.config.kv_bytes_per_token(4)
    llm = LLM(smollm2_fp32, draft_model=smollm2_fp32, speculative_config=spec,
              kv_cache_memory=8 * 16 * per_token, **BASE)  # 7 blocks for 4 sequences: preemption
    params = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert got == reference
    st = llm.stats()
    assert st["num_preemptions"] > 0
    assert st["speculation"]["num_accepted_tokens"] > 0
    assert st["kv_blocks_in_use"] == 0
