"""Tiny random MoE models made by transformers (Mixtral, Qwen3-MoE, OLMoE) vs our loader, model
and paged engine: the same experts per token, dense logits, and greedy tokens under chunked
prefill; and no compile after warm-up in a MoE engine."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from compile_guard import count_compiles
from hf_reference import run_reference
from jaxserve import EngineConfig, LLMEngine, SamplingParams
from models import load_model
from models.layer_layout import unstack_layers

pytestmark = pytest.mark.hf_ref

# Several layers, GQA (4 query heads over 2 KV heads), >= 4 experts, top-2.
BASE = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-5, num_experts_per_tok=2, tie_word_embeddings=False)
MODELS = [
    {"name": "mixtral", "arch": "mixtral", "seed": 0,
     "config": dict(BASE, num_local_experts=8, rope_theta=1e6)},
    {"name": "qwen3_moe", "arch": "qwen3_moe", "seed": 1,
     "config": dict(BASE, num_experts=4, moe_intermediate_size=48, head_dim=16,
                    norm_topk_prob=True, rms_norm_eps=1e-6)},
    {"name": "olmoe", "arch": "olmoe", "seed": 2,
     "config": dict(BASE, num_experts=6, norm_topk_prob=False, pad_token_id=0,
                    eos_token_id=1)},
]
NAMES = [m["name"] for m in MODELS]
PROMPTS = [[5, 17, 42, 3, 200, 7, 7, 7, 1], list(range(1, 150, 3)), [9]]
# >= 8 prompts, most longer than the 16-token step budget so prefill runs in chunks.
GREEDY_PROMPTS = [[(7 * j + 3 * i) % 200 + 1 for i in range(n)]
                  for j, n in enumerate([9, 23, 40, 17, 33, 5, 48, 29, 12])]
MAX_NEW = 8
ATOL = 2e-4  # the llama/qwen2 HF tests' float32 tolerance (tests/modeling/test_model_hf.py)


@pytest.fixture(scope="module")
def reference():
    return run_reference("ref_moe_hf", {"models": MODELS, "prompts": PROMPTS,
                                        "greedy_prompts": GREEDY_PROMPTS,
                                        "max_new_tokens": MAX_NEW})


@pytest.fixture(scope="module")
def models(reference):
    return {n: load_model(reference["workdir"] / n, dtype="float32") for n in NAMES}


def test_configs_read_from_hf(models):
    got = {n: (m.config.architecture, m.config.num_experts, m.config.num_experts_per_tok,
               m.config.norm_topk_prob, m.config.qk_norm) for n, m in models.items()}
    assert got == {"mixtral": ("mixtral", 8, 2, True, "none"),
                   "qwen3_moe": ("qwen3_moe", 4, 2, True, "per_head"),
                   "olmoe": ("olmoe", 6, 2, False, "full")}
    assert models["qwen3_moe"].config.moe_intermediate_size == 48


def test_num_params_counts_experts(models):
    for m in models.values():
        assert m.config.num_params() == sum(x.size for x in jax.tree.leaves(m.params))


def _our_experts(model, prompts, length=64):
    """Each layer's chosen experts per token `[L, T, k]` for each prompt, as MoEMLP sows them
    (layers unrolled). Prompts are padded to one length (one compile): under the causal mask
    the padding changes no earlier token's routing."""
    module = model.module(unroll_layers=True)
    params = unstack_layers(model.params, model.config.num_layers)

    @jax.jit
    def sown(tokens):  # [1, length]
        positions = jnp.arange(length, dtype=jnp.int32)[None]
        return module.apply({"params": params}, tokens, positions,
                            mutable=["intermediates"])[1]["intermediates"]

    out = []
    for ids in prompts:
        inter = sown(np.asarray([ids + [0] * (length - len(ids))], np.int32))
        out.append(np.stack([np.asarray(inter[f"layers_{i}"]["mlp"]["experts"][0][0])
                             for i in range(model.config.num_layers)])[:, :len(ids)])
    return out  # per prompt [L, T, k]


@pytest.mark.parametrize("name", NAMES)
def test_routing_matches_hf(reference, models, name):
    for i, (ids, experts) in enumerate(zip(PROMPTS, _our_experts(models[name], PROMPTS))):
        ours = np.sort(experts, axis=-1)
        theirs = np.sort(reference[f"{name}/experts/{i}"], axis=-1)
        assert ours.shape == theirs.shape == (3, len(ids), 2)
        np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_hf(reference, models, name):
    for i, ids in enumerate(PROMPTS):
        np.testing.assert_allclose(models[name].forward_logits(ids),
                                   reference[f"{name}/logits/{i}"], atol=ATOL, rtol=0)


def _engine(model, **kw):
    kw = dict(dict(warmup=False, max_model_len=128, block_size=4, max_num_seqs=4,
                   max_num_batched_tokens=16), **kw)
    return LLMEngine(EngineConfig(model=model.source, dtype=model.dtype, **kw), model=model)


def _generate(engine, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    for j, ids in enumerate(prompts):
        engine.add_request(f"r{j}", ids, params)
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
    return [list(results[f"r{j}"]) for j in range(len(prompts))]


@pytest.mark.parametrize("kind", ["xla", "pallas-interpret"])
@pytest.mark.parametrize("name", NAMES)
def test_logits_match_hf_on_each_grouped_matmul(reference, models, name, kind):
    """Dense logits with the experts on the tiled XLA path and on the Pallas kernel
    (interpreted; these models' D and F are multiples of 16, so it really runs)."""
    from jaxserve.runtime.grouped_matmul import grouped_matmul_backend
    model = models[name]
    module = model.module(grouped_matmul=grouped_matmul_backend(kind))
    ids = np.asarray(PROMPTS[1], np.int32)[None]  # [1, T]
    positions = np.arange(ids.shape[1], dtype=np.int32)[None]
    logits, _ = jax.jit(module.apply)({"params": model.params}, ids, positions)
    np.testing.assert_allclose(np.asarray(logits[0]), reference[f"{name}/logits/1"], atol=ATOL,
                               rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_paged_engine_greedy_matches_hf_chunked(reference, models, name):
    """On CPU the engine runs the experts on the tiled XLA path (the `xla` linear backend)."""
    # A near-tie would make token equality a coin flip between two float32 implementations.
    assert float(reference[f"{name}/margin"]) > 1e-4
    assert sum(len(p) > 16 for p in GREEDY_PROMPTS) >= 6  # prefill runs in chunks
    engine = _engine(models[name])
    assert engine.runner._module.grouped_matmul.__qualname__.startswith("tiled_gmm")
    got = _generate(engine, GREEDY_PROMPTS)
    want = [reference[f"{name}/greedy/{j}"].tolist() for j in range(len(GREEDY_PROMPTS))]
    assert got == want


def test_moe_engine_adds_no_compiles_after_warmup(models):
    engine = _engine(models["mixtral"], warmup=True, max_num_batched_tokens=32)
    with count_compiles() as events:
        _generate(engine, GREEDY_PROMPTS)
    assert events == []
    assert engine.stats()["num_compiles_after_warmup"] == 0


def test_orbax_roundtrip_matches_hf(reference, models, tmp_path):
    from models.checkpoint import save as save_orbax
    save_orbax(models["olmoe"], tmp_path / "ckpt")
    restored = load_model(tmp_path / "ckpt")
    assert restored.config == models["olmoe"].config
    np.testing.assert_allclose(restored.forward_logits(PROMPTS[0]),
                               reference["olmoe/logits/0"], atol=ATOL, rtol=0)
