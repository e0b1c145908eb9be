"""The dense families on every serving path: int8 / int4 / W8A8 quantization and tensor
parallelism work for Qwen3 (q/k norms) and Phi-3 (fused projections split at load time), or
are refused with a message that says what to change.

Quantized: the paged engine equals a dense greedy loop over the same quantized params
(test_quantized_engine's oracle). Tensor parallel: greedy tokens on 2 devices equal the dense
forward on one (a fresh 8-device process, tests/tp_worker.py).
"""

import dataclasses

import numpy as np
import pytest

from jaxserve.quantization.paths import activation_bits, prepare_model
from jaxserve.runtime import backends
from jaxserve.runtime.sharding import pad_heads
from models.random_init import random_model
from test_quantized_engine import PROMPTS, TINY, dense_greedy, engine_greedy

QWEN3 = dataclasses.replace(TINY, qk_norm="per_head", architecture="qwen3")


def _with_random_norms(model, seed=0):
    rng = np.random.default_rng(seed)
    attn = model.params["layers"]["attn"]
    norms = {k: {"scale": 1 + 0.3 * rng.standard_normal(attn[k]["scale"].shape)
                 .astype(np.float32)} for k in ("q_norm", "k_norm")}
    layers = dict(model.params["layers"], attn=dict(attn, **norms))
    return dataclasses.replace(model, params=dict(model.params, layers=layers))


# w8a16 serves the same int8 weights as w8a8 with float activations: nothing of the family
# differs between the two, so its compile is spared here.
@pytest.mark.parametrize("path", ["w8a8", "w4a16"])
def test_qwen3_quantized_engine_equals_dense_oracle(path):
    model = _with_random_norms(random_model(QWEN3, seed=7))
    qmodel, served = prepare_model(model, path)
    assert served == path
    # The norms stay float: only linear kernels are quantized.
    assert qmodel.params["layers"]["attn"]["q_norm"]["scale"].dtype == np.float32
    linear = backends.linear_backend("xla", activation_bits(path))
    want = [dense_greedy(qmodel, qmodel.params, linear, p) for p in PROMPTS]
    assert engine_greedy(model, PROMPTS, path) == want


@pytest.mark.hf_ref
def test_phi3_quantized_engine_equals_dense_oracle():
    from test_model_families import MODELS, PROMPTS as HF_PROMPTS, run_reference
    from test_model_families import GREEDY_PROMPTS, GREEDY_TOKENS, ROPE_CASES
    from models import load_model
    ref = run_reference("ref_families", {
        "models": MODELS, "prompts": HF_PROMPTS, "greedy_prompts": GREEDY_PROMPTS,
        "greedy_tokens": GREEDY_TOKENS, "rope_cases": ROPE_CASES})
    model = load_model(ref["workdir"] / "phi3", dtype="float32")
    # The fused projections arrive split, so every linear layer is quantized like Llama's.
    qmodel, _ = prepare_model(model, "w8a8")
    assert type(qmodel.params["layers"]["attn"]["q_proj"]["kernel"]).__name__ == "Int8Weight"
    assert type(qmodel.params["layers"]["mlp"]["up_proj"]["kernel"]).__name__ == "Int8Weight"
    linear = backends.linear_backend("xla", activation_bits("w8a8"))
    prompts = GREEDY_PROMPTS[1:4]
    want = [dense_greedy(qmodel, qmodel.params, linear, p) for p in prompts]
    assert engine_greedy(model, prompts, "w8a8") == want


def test_whole_projection_qk_norm_refuses_padded_heads():
    from tp_worker import SMOL_HEADS
    model = random_model(dataclasses.replace(SMOL_HEADS, qk_norm="full"))
    with pytest.raises(ValueError, match="qk_norm='full'.*pick a size dividing the KV heads"):
        pad_heads(model, 2)


def test_per_head_qk_norm_survives_padded_heads():
    from tp_worker import SMOL_HEADS
    model = _with_random_norms(random_model(dataclasses.replace(SMOL_HEADS, qk_norm="per_head")))
    ids = [3, 9, 27, 81, 243 % 256, 5, 6]
    padded = pad_heads(model, 8)  # 9/3 heads -> 16/8: zero heads and replicated KV heads
    np.testing.assert_allclose(padded.forward_logits(ids), model.forward_logits(ids),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.subprocess
@pytest.mark.timeout(1000)
def test_tensor_parallel_greedy_equals_dense():
    from test_tensor_parallel import run_worker
    from tp_worker import GQA, SMOL_HEADS, prompts
    runs = run_worker({
        "per_head": ["tokens", {"config_name": "smol_heads", "sizes": [2],
                                "qk_norm": "per_head"}],
        "full": ["tokens", {"config_name": "gqa", "sizes": [2], "qk_norm": "full"}]})
    for label, base in (("per_head", SMOL_HEADS), ("full", GQA)):
        model = random_model(dataclasses.replace(base, qk_norm=label), seed=3)
        want = [model.greedy_generate(p, 5, stop_token_ids=()) for p in prompts(base.vocab_size)]
        assert runs[label]["2"]["tokens"] == want, label


def test_qwen3_on_the_pallas_kernel_equals_dense():
    # The q/k norms sit before the kernel: the interpreted Pallas step serves Qwen3 unchanged.
    from jaxserve import LLM, SamplingParams
    config = dataclasses.replace(QWEN3, head_dim=64, num_heads=2, num_kv_heads=1)
    model = _with_random_norms(random_model(config, seed=4))
    prompts = [PROMPTS[0], PROMPTS[2]]
    want = [model.greedy_generate(p, 4, stop_token_ids=()) for p in prompts]
    llm = LLM(model, attention_backend="pallas-interpret", block_size=8, max_num_seqs=2,
              max_model_len=32, max_num_batched_tokens=16, warmup=False)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want


def test_pallas_names_phi3_minis_head_dim():
    from jaxserve.runtime.attention_backends import PallasAttention
    from models.config import ModelConfig
    phi3_mini = ModelConfig.from_hf({"model_type": "phi3", "vocab_size": 32064,
                                     "hidden_size": 3072, "intermediate_size": 8192,
                                     "num_hidden_layers": 32, "num_attention_heads": 32,
                                     "sliding_window": 2047, "max_position_embeddings": 4096})
    assert phi3_mini.head_dim == 96 and phi3_mini.max_position_embeddings == 2047
    assert any("head_dim 96" in r for r in PallasAttention().supports(phi3_mini, 16))


def test_awq_scale_folding_is_exact_with_qk_norms():
    # AWQ folds input scales into the norms before q/k/v and o_proj's into v_proj: the per-head
    # q/k norms after the projections must come through untouched.
    from jaxserve.quantization.awq import fold_scales
    from jaxserve.quantization.layerwise import layer_slice, replace_kernels
    from test_awq import random_scales
    model = _with_random_norms(random_model(QWEN3, seed=4))
    rng = np.random.default_rng(5)
    layers = [fold_scales(layer_slice(model.params, i), QWEN3, random_scales(rng, QWEN3))
              for i in range(QWEN3.num_layers)]
    folded = dataclasses.replace(model, params=replace_kernels(model.params, layers))
    np.testing.assert_array_equal(folded.params["layers"]["attn"]["q_norm"]["scale"],
                                  model.params["layers"]["attn"]["q_norm"]["scale"])
    ids = np.random.default_rng(6).integers(0, QWEN3.vocab_size, 40)
    want, got = model.forward_logits(ids), folded.forward_logits(ids)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_gptq_runs_through_qk_norms():
    # GPTQ's layer-by-layer calibration replays attention with the q/k norms: its error on the
    # calibration logits must still beat round-to-nearest, and the norms stay as they were.
    import jax
    from jaxserve.quantization import QuantSpec, dequantize_weight
    from jaxserve.quantization.calibration import random_calibration
    from jaxserve.quantization.gptq import gptq_quantize
    from jaxserve.quantization.layerwise import LINEARS, rtn_params
    model = _with_random_norms(random_model(QWEN3, seed=11))
    spec, calib = QuantSpec(4, "group", 32), random_calibration(256, num_seqs=8, seq_len=48)

    def dequantized(params):
        layers = dict(params["layers"])
        for block, name in LINEARS:
            layers[block] = dict(layers[block], **{name: {"kernel": jax.vmap(dequantize_weight)(
                params["layers"][block][name]["kernel"])}})
        return dataclasses.replace(model, params=dict(params, layers=layers))

    gptq = gptq_quantize(model, spec, calib, progress=False)
    np.testing.assert_array_equal(gptq["layers"]["attn"]["k_norm"]["scale"],
                                  model.params["layers"]["attn"]["k_norm"]["scale"])
    ids = calib.tokens[0]
    want = model.forward_logits(ids)
    err = {name: np.linalg.norm(dequantized(p).forward_logits(ids) - want)
           for name, p in (("gptq", gptq), ("rtn", rtn_params(model.params, spec)))}
    assert err["gptq"] < err["rtn"], err
