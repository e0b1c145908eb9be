"""What MoE models support beyond the float single-device path: tensor parallelism (experts
split on their FFN axis), and clear refusals (quantization, MoE GGUF files, HF options not
implemented)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxserve import EngineConfig, LLMEngine, SamplingParams
from jaxserve.runtime.sharding import param_specs
from models.config import ModelConfig
from models.hf_config import config_fields
from models.random_init import random_model
from test_tensor_parallel import run_worker

MOE = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64,
                  architecture="mixtral", num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=16, norm_topk_prob=True)


def test_experts_split_on_their_ffn_axis():
    specs = param_specs(random_model(MOE).params, MOE, 2)
    # [L, D, E] router; [L, E, D, F] gate/up split on F (outputs); [L, E, F, D] down on F.
    assert specs["layers"]["mlp"] == {"router": P(), "gate": P(None, None, None, "model"),
                                      "up": P(None, None, None, "model"),
                                      "down": P(None, None, "model", None)}
    assert specs["layers"]["attn"]["q_proj"]["kernel"] == P(None, None, "model")


def test_expert_ffn_that_does_not_split_is_named():
    odd = dataclasses.replace(MOE, moe_intermediate_size=15)
    needle = r"layers/mlp/(down|gate|up) .* tensor_parallel_size=2 \(dimension 15"
    with pytest.raises(ValueError, match=needle):
        param_specs(random_model(odd).params, odd, 2)


@pytest.mark.subprocess
@pytest.mark.timeout(1000)
def test_tensor_parallel_greedy_equals_one_device():
    # float and w8a16 experts, each on 1 and 2 devices, in one worker process; and the
    # experts on the Pallas kernel (interpreted), run per shard (TensorParallel.grouped_matmul)
    runs = run_worker({"moe": ["tokens", {"config_name": "moe", "sizes": [1, 2]}],
                       "w8a16": ["tokens", {"config_name": "moe", "sizes": [1, 2],
                                            "quantization": "w8a16"}],
                       "kernel": ["tokens", {"config_name": "moe", "sizes": [2],
                                             "linear_backend": "pallas-interpret"}],
                       "kernel_w8": ["tokens", {"config_name": "moe", "sizes": [2],
                                                "linear_backend": "pallas-interpret",
                                                "quantization": "w8a16"}]})
    out, w8 = runs["moe"], runs["w8a16"]
    assert w8["1"]["tokens"] == w8["2"]["tokens"] == runs["kernel_w8"]["2"]["tokens"]
    assert out["1"]["tokens"] == out["2"]["tokens"] == runs["kernel"]["2"]["tokens"]
    # Each device holds half of every expert: the experts are most of this model's weights.
    # (replicated experts would leave each device about 0.67 of the weights here)
    assert max(out["2"]["weights"]) < 0.6 * max(out["1"]["weights"])
    assert len(out["1"]["tokens"]) == 2 and all(len(t) == 5 for t in out["1"]["tokens"])


@pytest.mark.parametrize("quantization", ["w4a16", "w8a8"])
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


@pytest.mark.parametrize("kind", ["ragged", "xla", "pallas"])
def test_sharded_experts_compile_for_2_h200s_with_one_all_reduce(kind):
    """The MoE MLP with EXPERT_ROLES' specs, compiled deviceless for 2 H200s: XLA partitions
    the ragged dots (ragged) and the tiled path's gathers and batched dots (xla) on F, the
    kernel runs per shard (pallas: TensorParallel.grouped_matmul's shard_map); each sums
    down's partial products in one all-reduce and gathers nothing."""
    import re

    import jax.numpy as jnp
    from jax.experimental import topologies
    from jax.sharding import NamedSharding

    from jaxserve.runtime.grouped_matmul import grouped_matmul_backend
    from jaxserve.runtime.sharding import TensorParallel
    from models.moe import moe_ffn
    from tests import cuda_lowering
    reason = cuda_lowering.cuda_compiler_available()
    if reason:
        pytest.skip(reason)
    topo = topologies.get_topology_desc(platform="cuda", topology="1x1x2",
                                        target_config=cuda_lowering.H200_TARGET_CONFIG)
    mesh = jax.sharding.Mesh(topo.devices, ("model",))
    n, e, d, f = 64, 8, 128, 256
    shapes = [(n, d), (d, e), (e, d, f), (e, d, f), (e, f, d)]  # x, router, gate, up, down
    specs = [P(), P(), P(None, None, "model"), P(None, None, "model"), P(None, "model", None)]
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=NamedSharding(mesh, p))
            for s, p in zip(shapes, specs)]
    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)  # compile-only client
    try:
        with jax.set_mesh(mesh):
            gmm = grouped_matmul_backend(kind)
            if kind == "pallas":
                gmm = TensorParallel(mesh).grouped_matmul(gmm)
            fn = jax.jit(lambda *a: moe_ffn(*a, 2, True, gmm)[0],
                         out_shardings=NamedSharding(mesh, P()))
            hlo = fn.trace(*args).lower().compile().as_text()
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)
    found = {op: len(re.findall(op + r"(?:-start)?\(", hlo))
             for op in ("all-reduce", "all-gather", "all-to-all")}
    assert found == {"all-reduce": 1, "all-gather": 0, "all-to-all": 0}
    if kind == "pallas":  # the three projections ran as the kernel
        assert hlo.count('custom_call_target="__gpu$xla.gpu.triton"') == 3


def _dequantized(w):
    """numpy: an output-major per-channel Int8Weight as the float kernel it stands for."""
    return np.swapaxes(np.asarray(w.q8, np.float64), -1, -2) * np.asarray(w.scales)


def test_w8a16_experts_equal_their_dequantized_float_weights():
    from jaxserve.quantization.moe import quantize_experts
    from jaxserve.quantization.paths import INT8_CHANNEL
    model = random_model(MOE, seed=2)
    params = quantize_experts(model.params, INT8_CHANNEL)
    gate = params["layers"]["mlp"]["gate"]
    assert gate.q8.shape == (2, 4, 16, 32) and gate.scales.shape == (2, 4, 1, 16)  # [L, E, ..]
    mlp = {k: _dequantized(v) if k != "router" else v
           for k, v in params["layers"]["mlp"].items()}
    floats = dict(model.params, layers=dict(model.params["layers"], mlp=mlp))
    reference = dataclasses.replace(model, params=jax.tree.map(jnp.asarray, floats))
    ids = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    want = reference.forward_logits(ids)
    got = dataclasses.replace(model, params=params).forward_logits(ids)
    # Same math on both sides (the codes convert exactly): summation order only.
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    # and quantization really changed the experts (else the check above is vacuous)
    assert np.abs(want - model.forward_logits(ids)).max() > 1e-4


def test_w8a16_engine_greedy_equals_its_dense_forward():
    from jaxserve.runtime.backends import linear_backend
    engine = LLMEngine(EngineConfig(model="tiny", quantization="w8a16", warmup=False,
                                    max_model_len=64, max_num_seqs=2, block_size=4,
                                    max_num_batched_tokens=8), model=random_model(MOE, seed=4))
    params = engine.model.params
    assert type(params["layers"]["mlp"]["down"]).__name__ == "Int8Weight"
    module = engine.model.module(linear=linear_backend("xla"))
    forward = jax.jit(lambda t: module.apply({"params": params}, t,
                                             jnp.arange(32, dtype=jnp.int32)[None])[0][0])
    prompts = [[5, 9, 2, 33, 7, 1, 8, 8, 8, 4, 2, 60], [17, 3]]
    want = []
    for ids in prompts:  # greedy by full recompute (the 32 slots hold prompt + 6 tokens)
        out = []
        for _ in range(6):
            seq = ids + out
            logits = forward(jnp.asarray([seq + [0] * (32 - len(seq))], jnp.int32))
            out.append(int(np.argmax(np.asarray(logits[len(seq) - 1]))))
        want.append(out)
    params_greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, params_greedy)
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = list(o.outputs[0].token_ids)
    assert [done[str(i)] for i in range(len(prompts))] == want


def test_quantized_expert_specs_split_like_the_float_ones():
    from jaxserve.quantization.moe import quantize_experts
    from jaxserve.quantization.paths import INT8_CHANNEL
    params = quantize_experts(random_model(MOE).params, INT8_CHANNEL)
    specs = param_specs(params, MOE, 2)["layers"]["mlp"]
    # codes are output-major [L, E, N, K]: gate's N (= F) and down's K (= F) split
    assert (specs["gate"].q8, specs["gate"].scales) == (P(None, None, "model", None),
                                                        P(None, None, None, "model"))
    assert (specs["down"].q8, specs["down"].scales) == (P(None, None, None, "model"),
                                                        P(None, None, None, None))
