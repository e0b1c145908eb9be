"""Engine greedy decoding on each quantized path.

Fast: on a tiny random model the paged engine equals a dense (no KV cache) greedy loop over the
same quantized params and linear backend, per path: the plumbing is exact.
Slow: on SmolLM2 each path agrees with the float32 engine at a measured level (docs/quantization.md,
"Quantized inference"), and a deliberately broken path falls below that level.
"""

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.runtime import backends
from jaxserve.quantization.paths import activation_bits, auto_path, prepare_model
from jaxserve.testing.tiny_models import TINY_TIED
from models.model import Model
from models.random_init import random_model
from test_gguf_native import TINY as GGUF_TINY
from test_gguf_native import tiny_gguf_model

TINY = TINY_TIED
ENGINE = dict(block_size=16, max_num_seqs=4, max_model_len=64, max_num_batched_tokens=32,
              warmup=False)
NEW = 8


def engine_greedy(model, prompts, quantization, new=NEW, **kw):
    llm = LLM(model, quantization=quantization, **{**ENGINE, **kw})
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def dense_greedy(model, params, linear, prompt, new=NEW, width=64):
    """Full recompute per token, padded to one width (causal: the padding cannot leak back)."""
    module = model.module(linear=linear)
    fwd = jax.jit(lambda p, t: module.apply({"params": p}, t,
                                            jnp.arange(width, dtype=jnp.int32)[None])[0][0])
    ids = list(prompt)
    for _ in range(new):
        tokens = np.zeros((1, width), np.int32)
        tokens[0, :len(ids)] = ids
        ids.append(int(np.argmax(np.asarray(fwd(params, tokens))[len(ids) - 1])))
    return ids[len(prompt):]


PROMPTS = [[5, 17, 99, 3], list(range(30, 52)), [200, 1, 1, 7, 9, 250, 4]]


@pytest.mark.parametrize("path", ["w8a16", "w8a8", "w4a16"])
def test_engine_equals_dense_oracle_on_quantized_params(path):
    model = random_model(TINY, seed=5)
    qmodel, served = prepare_model(model, path)
    assert served == path and qmodel.quantization == path
    linear = backends.linear_backend("xla", activation_bits(path))
    want = [dense_greedy(qmodel, qmodel.params, linear, p) for p in PROMPTS]
    assert engine_greedy(model, PROMPTS, path) == want


def test_gguf_engine_equals_dense_oracle_on_native_blocks():
    _, params, raw = tiny_gguf_model()
    model = Model(config=GGUF_TINY, params=params, tokenizer=None, dtype="float32",
                  source="tiny.gguf", raw=raw)
    qmodel, _ = prepare_model(model, "gguf")
    linear = backends.linear_backend("xla")
    prompts = [p[:6] for p in PROMPTS]
    got = engine_greedy(model, [[t % 128 for t in p] for p in prompts], "gguf")
    want = [dense_greedy(qmodel, qmodel.params, linear, [t % 128 for t in p]) for p in prompts]
    assert got == want
    # ...and the native blocks are exactly the dequantized weights the float engine runs on.
    assert got == engine_greedy(model, [[t % 128 for t in p] for p in prompts], "none")


def test_auto_serves_a_gguf_files_blocks_and_none_serves_float(caplog):
    """quantization="auto" (the default) serves a GGUF model's own blocks, as llama.cpp and
    vLLM do, and says so; "none" serves the dequantized float weights; where the gguf path
    cannot run (tensor parallel, mixture of experts) auto falls back to float and says why."""
    _, params, raw = tiny_gguf_model()
    model = Model(config=GGUF_TINY, params=params, tokenizer=None, dtype="float32",
                  source="tiny.gguf", raw=raw)
    prompts = [[t % 128 for t in p[:6]] for p in PROMPTS]
    with caplog.at_level(logging.INFO, logger="jaxserve"):
        auto = LLM(model, **ENGINE)
    assert auto.engine.quantization == "gguf"
    assert "weights: the file's own Q4_0/Q4_1/Q8_0 blocks (quantization='none'" in caplog.text
    assert LLM(model, quantization="none", **ENGINE).engine.quantization is None
    assert engine_greedy(model, prompts, "auto") == engine_greedy(model, prompts, "gguf")
    assert auto_path(model, tensor_parallel_size=2)[0] is None
    assert "runs on one device" in auto_path(model, tensor_parallel_size=2)[1]
    moe = dataclasses.replace(model, config=dataclasses.replace(
        GGUF_TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32))
    assert auto_path(moe) == (None, "float weights: the file's Q4_0/Q4_1/Q8_0 blocks are "
                              "dequantized, as a mixture-of-experts model has no gguf path")
    # A model without blocks (an HF checkpoint, or the blocks dropped) stays float.
    assert auto_path(dataclasses.replace(model, raw={}))[0] is None


def test_a_quantized_checkpoint_is_served_on_its_path_and_refuses_float():
    qmodel, _ = prepare_model(random_model(TINY, seed=5), "w8a16")
    assert prepare_model(qmodel, "auto")[1] == "w8a16"
    with pytest.raises(ValueError, match="holds w8a16 weights; it cannot be served as float"):
        prepare_model(qmodel, "none")


# ---- the real model -----------------------------------------------------------------------

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "Explain photosynthesis in one sentence.", "List three prime numbers.",
             "Who wrote Hamlet?", "Translate 'good morning' to Spanish.", "What is 12 times 7?",
             "Give me a tip for learning to code.", "Name a famous painter.",
             "What is the boiling point of water?", "Describe a cat.", "Why is the sky blue?",
             "Suggest a name for a dog.", "What do bees make?",
             "How many legs does a spider have?", "Tell me a fun fact."]
SMOL = dict(max_num_seqs=16, max_model_len=256, kv_cache_memory=1 << 28)


def prefix_agreement(ref, out) -> float:
    """Mean over prompts of the fraction of tokens generated before the first difference."""
    fracs = []
    for a, b in zip(ref, out):
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        fracs.append(k / len(a))
    return float(np.mean(fracs))


def scaled(model, path, factor):
    """`path`'s weights with every decoder scale off by `factor`: a broken dequantization."""
    qmodel, _ = prepare_model(model, path)
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: x * factor if "scales" in str(p) and "layers" in str(p) else x,
        qmodel.params)
    return dataclasses.replace(qmodel, params=params)


@pytest.fixture(scope="module")
def chat_prompts(smollm2_fp32):
    tok = smollm2_fp32.tokenizer
    return [tok.apply_chat_template([{"role": "user", "content": q}], True) for q in QUESTIONS]


@pytest.fixture(scope="module")
def fp32_tokens(smollm2_fp32, chat_prompts):
    return engine_greedy(smollm2_fp32, chat_prompts, "none", **SMOL)


# Bounds from measurements (16 prompts x 8 greedy tokens; docs/quantization.md, "Quantized
# inference"):
# measured prefix agreement gguf 1.0 (the same weights), w8a16 0.92 (12/16 identical, every
# first token equal: int8 per-channel weights err ~0.9% rms), w8a8 0.56 (per-token int8
# activations: SmolLM2 has outlier channels), w4a16 0.375 (re-quantizing the file's 4-bit g32
# weights to g64/g128). Each bound sits below its measurement with margin, and above what the
# same path with its decoder scales off by a few percent gives (the broken controls below:
# w8a16 x1.05 measured 0.60, w4a16 x1.05 0.0; W8A8's loose bound needs x1.25 - x1.1 gave 0.47:
# a uniform scale error is partly absorbed by the RMSNorms). On CPU, w4a16 and gguf run the
# native kernel (two int8 activation limbs): measured the same 0.375 and 1.0; w4a8 (int4
# weights, int8 activations per token, int8 head) measured 0.3125.
BOUNDS = {"gguf": 1.0, "w8a16": 0.75, "w8a8": 0.4, "w4a16": 0.3, "w4a8": 0.25}


@pytest.mark.parametrize("path", list(BOUNDS))
@pytest.mark.model
def test_smollm2_greedy_agrees_with_fp32(smollm2_gguf, chat_prompts, fp32_tokens, path):
    out = engine_greedy(smollm2_gguf, chat_prompts, path, **SMOL)
    assert prefix_agreement(fp32_tokens, out) >= BOUNDS[path]


@pytest.mark.parametrize("path,factor", [("w8a16", 1.05), ("w8a8", 1.25), ("w4a16", 1.05),
                                         ("w4a8", 1.05)])
@pytest.mark.model
def test_smollm2_broken_scales_fail_the_bound(smollm2_fp32, chat_prompts, fp32_tokens, path,
                                              factor):
    out = engine_greedy(scaled(smollm2_fp32, path, factor), chat_prompts, "auto", **SMOL)
    assert prefix_agreement(fp32_tokens, out) < BOUNDS[path]
