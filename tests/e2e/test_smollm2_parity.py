"""The real default model (SmolLM2-135M-Instruct GGUF) against HF transformers on the same file.

HF dequantizes the GGUF with its own code path and runs its own Llama; we use our loader, our
RoPE layout and our Flax model. Tolerances:
- float32: both sides compute in fp32 from identical dequantized weights, so the only differences
  are summation order over 30 layers. Measured max |diff| on the top-5 logits is 6.7e-5 on logits
  of magnitude up to ~38; we allow 2e-3 (a 1e-3 target with a 2x margin), and require the same
  argmax wherever HF's top-2 margin exceeds 10x that tolerance.
- bfloat16: activations are rounded to 8 mantissa bits (relative step 2^-8 = 0.4%) at every
  layer on both sides but in different places (fused ops, accumulation order); measured max
  |diff| on the top-5 logits is 1.25 (logits up to ~38) and raw top-1 agreement 93-100% per
  prompt. We require top-1 agreement on >= 95% of positions whose HF margin exceeds 1.0, and
  equal greedy tokens on the chat prompts up to HF's first step where its two best bf16 logits
  tie exactly: there both tokens are the argmax and the choice is the library's tie-break
  (measured: "Name three primary colors." ties at its 6th token, " Red" vs "\n", in HF's bf16
  logits, margin 0.036 in fp32; HF's pick there differed between machines).
"""

import numpy as np
import pytest

from hf_reference import run_reference
from models import load_model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Once upon a time, in a small village nestled between the mountains, there lived",
    "1, 2, 3, 5, 8, 13, 21,",
    "Translate to French: I love reading books in the evening.",
    "<|im_start|>user\nWhy is the sky blue?<|im_end|>\n<|im_start|>assistant\n",
]
CHAT = ["What is the capital of France?", "Name three primary colors."]
FP32_ATOL = 2e-3
BF16_MARGIN = 1.0


@pytest.fixture(scope="module")
def reference(smollm2_path):
    return run_reference("ref_smollm2", {
        "gguf": str(smollm2_path), "prompts": PROMPTS, "chat": CHAT, "max_new_tokens": 24,
        "dtypes": ["float32", "bfloat16"], "topk": 5}, input_files=[smollm2_path])


@pytest.fixture(scope="module")
def model_fp32(smollm2_fp32):
    return smollm2_fp32


@pytest.fixture(scope="module")
def model_bf16(smollm2_path):
    return load_model(smollm2_path, dtype="bfloat16")


@pytest.mark.parametrize("i", range(len(PROMPTS)))
@pytest.mark.hf_ref
def test_fp32_logits_match_hf(reference, model_fp32, i):
    ids = reference[f"float32/ids/{i}"]
    top_idx, top_val = reference[f"float32/top_idx/{i}"], reference[f"float32/top_val/{i}"]
    ours = model_fp32.forward_logits(ids)  # [T, V]
    np.testing.assert_allclose(np.take_along_axis(ours, top_idx, axis=1), top_val,
                               atol=FP32_ATOL, rtol=0)
    clear = (top_val[:, 0] - top_val[:, 1]) > 10 * FP32_ATOL
    assert clear.sum() >= len(ids) // 2  # the check below must cover most positions
    np.testing.assert_array_equal(ours.argmax(-1)[clear], top_idx[clear, 0])


@pytest.mark.parametrize("i", range(len(PROMPTS)))
@pytest.mark.hf_ref
def test_bf16_top1_matches_hf(reference, model_bf16, i):
    ids = reference[f"bfloat16/ids/{i}"]
    top_idx, top_val = reference[f"bfloat16/top_idx/{i}"], reference[f"bfloat16/top_val/{i}"]
    ours = model_bf16.forward_logits(ids)
    clear = (top_val[:, 0] - top_val[:, 1]) > BF16_MARGIN
    agree = ours.argmax(-1)[clear] == top_idx[clear, 0]
    assert agree.mean() >= 0.95, f"bf16 top-1 agrees on {agree.mean():.0%} of clear positions"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.hf_ref
def test_greedy_chat_matches_hf(reference, model_fp32, model_bf16, dtype):
    model = model_fp32 if dtype == "float32" else model_bf16
    for j in range(len(CHAT)):
        ids = reference[f"{dtype}/chat_ids/{j}"].tolist()
        expected = reference[f"{dtype}/greedy/{j}"].tolist()
        ours = model.greedy_generate(ids, len(expected))
        if dtype == "bfloat16":
            margins = reference[f"{dtype}/greedy_margin/{j}"]
            ties = np.flatnonzero(margins <= 0)
            decided = int(ties[0]) if ties.size else len(expected)
            assert decided >= 4, f"chat prompt {j}: HF's greedy path ties at step {decided}"
            ours, expected = ours[:decided], expected[:decided]
        assert ours == expected[:len(ours)], (model.tokenizer.decode(ours),
                                              reference["json"]["greedy_text"][dtype][j])
        assert len(ours) == len(expected) or ours[-1] in model.tokenizer.stop_token_ids


@pytest.mark.hf_ref
def test_capital_of_france(reference, model_fp32):
    assert reference["json"]["greedy_text"]["float32"][0] == "The capital of France is Paris."
    tok = model_fp32.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": CHAT[0]}])
    assert prompt == reference["json"]["chat_text"][0]
    out = model_fp32.greedy_generate(tok.encode(prompt), 24)
    text = tok.decode([t for t in out if t not in tok.stop_token_ids])
    assert text == "The capital of France is Paris."


def test_orbax_save_restores_model_and_tokenizer(model_fp32, tmp_path):
    from models.checkpoint import save
    save(model_fp32, tmp_path / "ckpt")
    restored = load_model(tmp_path / "ckpt", dtype="float32")
    assert restored.config == model_fp32.config
    ids = model_fp32.tokenizer.encode("Orbax restores the same weights: 3.14 ✓")
    assert restored.tokenizer.encode("Orbax restores the same weights: 3.14 ✓") == ids
    # Same weights and program: bit-identical logits.
    np.testing.assert_array_equal(restored.forward_logits(ids), model_fp32.forward_logits(ids))
    msgs = [{"role": "user", "content": "hi"}]
    assert restored.tokenizer.apply_chat_template(msgs) == \
        model_fp32.tokenizer.apply_chat_template(msgs)
    assert restored.tokenizer.stop_token_ids == model_fp32.tokenizer.stop_token_ids
