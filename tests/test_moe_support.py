"""What MoE models support beyond the float single-device path: tensor parallelism (experts
replicated), and clear refusals (quantization, MoE GGUF files, HF options not implemented)."""

import pytest
from jax.sharding import PartitionSpec as P

from jaxserve import EngineConfig, LLMEngine
from jaxserve.runtime.sharding import param_specs
from models.config import ModelConfig
from models.hf_config import config_fields
from models.random_init import random_model
from test_tensor_parallel import run_worker

MOE = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64,
                  architecture="mixtral", num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=16, norm_topk_prob=True)


def test_experts_are_replicated_and_attention_split():
    specs = param_specs(random_model(MOE).params, MOE, 2)
    assert {k: specs["layers"]["mlp"][k] for k in ("router", "gate", "up", "down")} == \
        {k: P() for k in ("router", "gate", "up", "down")}
    assert specs["layers"]["attn"]["q_proj"]["kernel"] == P(None, None, "model")


@pytest.mark.subprocess
@pytest.mark.timeout(1000)
def test_tensor_parallel_greedy_equals_one_device():
    out = run_worker({"moe": ["tokens", {"config_name": "moe", "sizes": [1, 2]}]})["moe"]
    assert out["1"]["tokens"] == out["2"]["tokens"]
    assert len(out["1"]["tokens"]) == 2 and all(len(t) == 5 for t in out["1"]["tokens"])


@pytest.mark.parametrize("quantization", ["w8a16", "w4a16", "w8a8"])
def test_quantization_is_refused(quantization):
    model = random_model(MOE)
    with pytest.raises(ValueError, match="not supported for mixture-of-experts models"):
        LLMEngine(EngineConfig(model="tiny", quantization=quantization, warmup=False,
                               max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16),
                  model=model)


def test_quantize_cli_path_is_refused():
    from jaxserve.quantization.convert import quantize_model
    from jaxserve.quantization.core import QuantSpec
    with pytest.raises(ValueError, match="mixture-of-experts"):
        quantize_model(random_model(MOE), "rtn", QuantSpec(bits=4))


def _hf(model_type, **kw):
    base = dict(model_type=model_type, vocab_size=64, hidden_size=32, intermediate_size=64,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    return dict(base, **kw)


@pytest.mark.parametrize("hf,needle", [
    (_hf("qwen3_moe", decoder_sparse_step=2), "a mix of dense and MoE layers"),
    (_hf("qwen3_moe", mlp_only_layers=[0]), "mlp_only_layers=\\[0\\]"),
    (_hf("olmoe", clip_qkv=8.0), "clip_qkv=8.0"),
    (_hf("mixtral", hidden_act="gelu"), "hidden_act='gelu'"),
    (_hf("qwen3_moe", num_experts_per_tok=5), "num_experts_per_tok must be in \\[1, "),
    (dict(_hf("mixtral"), num_experts=None), "lacks num_local_experts"),
])
def test_unsupported_hf_options_are_refused(hf, needle):
    with pytest.raises(ValueError, match=needle):
        ModelConfig(**config_fields(hf))


def test_moe_gguf_is_refused(tmp_path):
    import numpy as np
    from models.gguf_loader import GGUFError, read_gguf
    from test_gguf_loader import gguf_tensors, hf_weights, write_gguf
    path = tmp_path / "moe.gguf"
    write_gguf(path, gguf_tensors(hf_weights(np.random.default_rng(0))),
               meta={"llama.expert_count": 8, "llama.expert_used_count": 2})
    with pytest.raises(GGUFError, match="mixture-of-experts GGUF"):
        read_gguf(path)


def test_random_moe_model_runs_in_the_engine_dense_path():
    # random_model initialises the stacked experts through MoEMLP's own param shapes.
    model = random_model(MOE)
    assert model.params["layers"]["mlp"]["gate"].shape == (2, 4, 32, 16)  # [L, E, D, F]
    assert model.forward_logits([1, 2, 3]).shape == (3, 64)
