"""models/lora_weights.py on small hand-made PEFT adapter directories: the factors' layout
(transposes, scaling folded into B, rank padding, untouched layers zero) and one clear
LoRAError, naming the file, for each way an adapter can be unusable."""

from __future__ import annotations

import json
import math

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxserve.core.lora import LoRAError
from models.config import ModelConfig
from models.lora_weights import AdapterWeights, load_peft_adapter

# q: 4 heads x 4 = 16 outputs, k/v: 2 KV heads x 4 = 8, MLP 24.
CONFIG = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=3,
                     num_heads=4, num_kv_heads=2, head_dim=4)
PHI3 = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=4, architecture="phi3")
MOE = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=4, architecture="mixtral",
                  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
# HF module (as in the checkpoint) -> (in, out) of its weight `[out, in]`.
SHAPES = {"q_proj": (16, 16), "k_proj": (16, 8), "v_proj": (16, 8), "o_proj": (16, 16),
          "gate_proj": (16, 24), "up_proj": (16, 24), "down_proj": (24, 16),
          "qkv_proj": (16, 32), "gate_up_proj": (16, 48)}
MAX_RANK = 8


def _block(module: str) -> str:
    return "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj") \
        else "mlp"


def write_adapter(path, *, r=4, alpha=8, modules=("q_proj", "v_proj"), layers=(0, 1, 2),
                  config=None, seed=0, dtype=np.float32, adapter_name=None, ranks=None):
    """A PEFT-format adapter dir; returns {(layer, module): (A [r, in], B [out, r])} float32.

    config: adapter_config.json fields over the defaults; ranks: module -> its own r."""
    rng = np.random.default_rng(seed)
    tensors, factors = {}, {}
    mid = f".{adapter_name}" if adapter_name else ""
    for layer in layers:
        for m in modules:
            k, n = SHAPES[m]
            rm = (ranks or {}).get(m, r)
            a = rng.standard_normal((rm, k)).astype(dtype)  # [r, in]
            b = rng.standard_normal((n, rm)).astype(dtype)  # [out, r]
            key = f"base_model.model.model.layers.{layer}.{_block(m)}.{m}"
            tensors[f"{key}.lora_A{mid}.weight"] = a
            tensors[f"{key}.lora_B{mid}.weight"] = b
            factors[layer, m] = (a.astype(np.float32), b.astype(np.float32))
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    fields = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(modules),
              "bias": "none", "use_rslora": False, "use_dora": False, "fan_in_fan_out": False,
              "modules_to_save": None, "layers_to_transform": None, "rank_pattern": {},
              "alpha_pattern": {}, "init_lora_weights": True, "task_type": "CAUSAL_LM"}
    (path / "adapter_config.json").write_text(json.dumps({**fields, **(config or {})}))
    return factors


def load(path, config=CONFIG, **kw) -> AdapterWeights:
    return load_peft_adapter(path, config, max_rank=kw.pop("max_rank", MAX_RANK), **kw)


def _check_factors(w: AdapterWeights, factors, scaling: dict | float, num_layers=3):
    """Each (layer, module): A = lora_A^T padded, B = scaling * lora_B^T padded; the rest 0."""
    for m, (a, b) in w.modules.items():
        k, n = SHAPES[m]
        assert a.shape == (num_layers, k, MAX_RANK) and b.shape == (num_layers, MAX_RANK, n)
        assert a.dtype == b.dtype == np.float32
        for layer in range(num_layers):
            if (layer, m) not in factors:
                assert not a[layer].any() and not b[layer].any()
                continue
            la, lb = factors[layer, m]
            r = la.shape[0]
            s = scaling[m] if isinstance(scaling, dict) else scaling
            np.testing.assert_array_equal(a[layer, :, :r], la.T)
            np.testing.assert_array_equal(b[layer, :r], lb.T * np.float32(s))
            assert not a[layer, :, r:].any() and not b[layer, r:].any()


def test_factors_are_transposed_scaled_and_padded(tmp_path):
    factors = write_adapter(tmp_path, r=4, alpha=8)
    w = load(tmp_path)
    assert sorted(w.modules) == ["q_proj", "v_proj"]
    assert (w.rank, w.scaling) == (4, 2.0)
    _check_factors(w, factors, 2.0)
    assert w.nbytes == 3 * 4 * (16 * 8 + 8 * 16 + 16 * 8 + 8 * 8)


def test_delta_is_pefts_formula(tmp_path):
    # PEFT's forward: x @ lora_A^T @ lora_B^T * scaling; ours: x @ A @ B (padding adds zeros).
    factors = write_adapter(tmp_path, r=3, alpha=5, modules=("down_proj",))
    a, b = load(tmp_path).modules["down_proj"]
    x = np.random.default_rng(1).standard_normal((5, 24)).astype(np.float32)
    la, lb = factors[1, "down_proj"]
    np.testing.assert_allclose(x @ a[1] @ b[1], x @ la.T @ lb.T * (5 / 3), rtol=1e-5, atol=1e-5)


def test_rslora_scales_by_the_square_root_of_the_rank(tmp_path):
    factors = write_adapter(tmp_path, r=4, alpha=6, config={"use_rslora": True})
    w = load(tmp_path)
    assert w.scaling == 6 / math.sqrt(4)
    _check_factors(w, factors, 3.0)


def test_layers_to_transform_leaves_other_layers_zero(tmp_path):
    factors = write_adapter(tmp_path, layers=(1,), modules=("o_proj",),
                            config={"layers_to_transform": [1]})
    w = load(tmp_path)
    _check_factors(w, factors, 2.0)
    assert w.modules["o_proj"][0][1].any() and not w.modules["o_proj"][0][[0, 2]].any()


def test_rank_and_alpha_patterns_set_each_modules_rank_and_scaling(tmp_path):
    factors = write_adapter(tmp_path, r=4, alpha=8, modules=("q_proj", "up_proj"),
                            ranks={"up_proj": 6},
                            config={"rank_pattern": {"up_proj": 6},
                                    "alpha_pattern": {"mlp.up_proj": 3}})
    w = load(tmp_path)
    assert (w.rank, w.scaling) == (6, 2.0)
    _check_factors(w, factors, {"q_proj": 2.0, "up_proj": 0.5})


def test_adapter_name_in_keys_and_half_precision(tmp_path):
    # Some PEFT versions keep the adapter name (`lora_A.default.weight`); bf16 has no numpy type.
    for dtype in (ml_dtypes.bfloat16, np.float16):
        d = tmp_path / np.dtype(dtype).name
        factors = write_adapter(d, dtype=dtype, adapter_name="default")
        _check_factors(load(d), factors, 2.0)


def test_regex_all_linear_and_exclude_targets(tmp_path):
    # PEFT: a string is a regex fullmatched against the module's full name.
    regex = r"model\.layers\.[02]\.self_attn\.(q|o)_proj"
    factors = write_adapter(tmp_path / "re", modules=("q_proj", "o_proj"), layers=(0, 2),
                            config={"target_modules": regex})
    _check_factors(load(tmp_path / "re"), factors, 2.0)
    every = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    write_adapter(tmp_path / "all", modules=every, config={"target_modules": "all-linear"})
    assert sorted(load(tmp_path / "all").modules) == sorted(every)
    write_adapter(tmp_path / "ex", modules=("q_proj",), config={
        "target_modules": ["q_proj", "k_proj"], "exclude_modules": ["k_proj"]})
    assert sorted(load(tmp_path / "ex").modules) == ["q_proj"]


def test_phi3_fused_projections_split_like_the_base_weights(tmp_path):
    factors = write_adapter(tmp_path, modules=("qkv_proj", "gate_up_proj"), layers=(0, 1))
    w = load(tmp_path, config=PHI3)
    assert sorted(w.modules) == ["gate_proj", "k_proj", "q_proj", "up_proj", "v_proj"]
    rows = {"q_proj": ("qkv_proj", 0, 16), "k_proj": ("qkv_proj", 16, 24),
            "v_proj": ("qkv_proj", 24, 32), "gate_proj": ("gate_up_proj", 0, 24),
            "up_proj": ("gate_up_proj", 24, 48)}
    split = {(layer, part): (la, lb[lo:hi]) for part, (fused, lo, hi) in rows.items()
             for (layer, m), (la, lb) in factors.items() if m == fused}
    _check_factors(w, split, 2.0, num_layers=2)


def test_moe_adapter_on_attention_loads(tmp_path):
    factors = write_adapter(tmp_path, modules=("q_proj", "o_proj"), layers=(0, 1),
                            config={"target_modules": ["q_proj", "o_proj", "gate_proj"]})
    _check_factors(load(tmp_path, config=MOE), factors, 2.0, num_layers=2)


# --- errors: each a LoRAError naming the problem and the file ---------------------------------


def _raises(path, match, **kw):
    with pytest.raises(LoRAError, match=match) as e:
        load(path, **kw)
    assert str(path) in str(e.value)
    return str(e.value)


def _edit_config(path, **fields):
    cfg = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**cfg, **fields}))


def _edit_tensors(path, edit):
    from safetensors.numpy import load_file
    tensors = load_file(str(path / "adapter_model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "adapter_model.safetensors"))


KEY = "base_model.model.model.layers.1.self_attn.q_proj.lora_{}.weight"


def test_missing_directory_and_files(tmp_path):
    _raises(tmp_path / "nope", "adapter directory not found")
    write_adapter(tmp_path)
    (tmp_path / "adapter_model.safetensors").rename(tmp_path / "adapter_model.bin")
    msg = _raises(tmp_path, "no adapter_model.safetensors")
    assert "adapter_model.bin" in msg and "pickle" in msg
    (tmp_path / "adapter_config.json").unlink()
    _raises(tmp_path, "no adapter_config.json")


def test_malformed_json(tmp_path):
    write_adapter(tmp_path)
    (tmp_path / "adapter_config.json").write_text('{"r": 4,')
    _raises(tmp_path, "adapter_config.json: invalid JSON")
    (tmp_path / "adapter_config.json").write_text("[4]")
    _raises(tmp_path, "must hold a JSON object")


@pytest.mark.parametrize("fields,match", [
    ({"peft_type": "IA3"}, "peft_type is 'IA3'; only LoRA adapters"),
    ({"use_dora": True}, "use_dora=True is not supported: DoRA"),
    ({"bias": "all"}, "bias='all' is not supported"),
    ({"modules_to_save": ["lm_head"]}, "heads and embeddings are not adapted"),
    ({"target_modules": ["q_proj", "lm_head"]}, "selects 'lm_head': heads and embeddings"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, "selects 'model.embed_tokens': heads"),
    ({"init_lora_weights": "pissa_niter_4"}, "rewrote the base weights"),
    ({"r": 0}, "r must be a positive integer"),
    ({"lora_alpha": "8"}, "lora_alpha must be a finite number"),
    ({"target_modules": "(q_proj"}, "not a valid regular expression"),
    ({"target_modules": ["q_proj", "k_proj", "v_proj"]}, "missing tensor .*k_proj.lora_A"),
    ({"target_modules": ["mlp"]}, "selects no module"),
    ({"layers_to_transform": [0, 7]}, "layers_to_transform names layer 7; the base model has 3"),
])
def test_config_problems(tmp_path, fields, match):
    write_adapter(tmp_path)
    _edit_config(tmp_path, **fields)
    _raises(tmp_path, match)


def test_rank_above_max_lora_rank(tmp_path):
    write_adapter(tmp_path, r=32)
    _raises(tmp_path, r"rank 32 exceeds max_lora_rank 16; restart with --max-lora-rank 32",
            max_rank=16)
    _edit_config(tmp_path, r=4, rank_pattern={"v_proj": 32})  # a pattern's rank counts too
    _raises(tmp_path, "rank 32 exceeds max_lora_rank 16", max_rank=16)


def test_module_outside_the_engines_targets(tmp_path):
    write_adapter(tmp_path, modules=("q_proj", "down_proj"))
    _raises(tmp_path, r"adapts \['down_proj'\], which this engine has no LoRA slots for",
            target_modules=("q_proj", "k_proj", "v_proj", "o_proj"))


def test_phi3_fused_target_needs_all_its_parts(tmp_path):
    write_adapter(tmp_path, modules=("qkv_proj",), layers=(0, 1))
    _raises(tmp_path, r"adapts \['k_proj', 'v_proj'\]", config=PHI3, target_modules=("q_proj",))


def test_tensor_shape_mismatch_names_module_expected_and_got(tmp_path):
    write_adapter(tmp_path)
    _edit_tensors(tmp_path, lambda t: t.update({KEY.format("B"): np.ones((12, 4), np.float32)}))
    _raises(tmp_path, r"q_proj lora_B\) has shape \(12, 4\), expected \(16, 4\)")


def test_tensor_rank_differs_from_config(tmp_path):
    write_adapter(tmp_path, r=4)
    _edit_config(tmp_path, r=2)
    _raises(tmp_path, r"has shape \(4, 16\), expected \(2, 16\) for rank 2")


def test_missing_tensor(tmp_path):
    write_adapter(tmp_path)
    _edit_tensors(tmp_path, lambda t: t.pop(KEY.format("A")))
    _raises(tmp_path, "missing tensor 'base_model.model.model.layers.1.self_attn.q_proj.lora_A")


@pytest.mark.parametrize("key,match", [
    ("base_model.model.model.layers.5.self_attn.q_proj.lora_A.weight",
     "layer 5 is out of range: the base model has 3 layers"),
    ("base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight",
     "is not among the modules adapter_config.json targets"),
    ("base_model.model.lm_head.lora_A.weight", "heads and embeddings are not adapted"),
    ("base_model.model.model.embed_tokens.lora_embedding_A", "heads and embeddings"),
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector", "DoRA"),
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.other.weight", "several adapters"),
])
def test_unexpected_tensors(tmp_path, key, match):
    write_adapter(tmp_path)
    _edit_tensors(tmp_path, lambda t: t.update({key: np.ones((4, 16), np.float32)}))
    _raises(tmp_path, match)


def test_moe_expert_tensors_are_refused(tmp_path):
    write_adapter(tmp_path, modules=("q_proj",), layers=(0, 1))
    _edit_tensors(tmp_path, lambda t: t.update({
        "base_model.model.model.layers.0.mlp.experts.1.gate_proj.lora_A.weight":
            np.ones((4, 16), np.float32)}))
    _raises(tmp_path, "mixture-of-experts MLPs are not adapted", config=MOE)
    _edit_config(tmp_path, target_modules="all-linear")  # PEFT's all-linear takes the router
    _raises(tmp_path, "a mixture-of-experts router is not adapted", config=MOE)


def test_non_finite_values_and_non_float_dtype(tmp_path):
    write_adapter(tmp_path)
    bad = np.ones((16, 4), np.float32)
    bad[3, 1] = np.nan
    _edit_tensors(tmp_path, lambda t: t.update({KEY.format("B"): bad}))
    _raises(tmp_path, f"tensor '{KEY.format('B')}' holds non-finite values")
    _edit_tensors(tmp_path, lambda t: t.update({KEY.format("B"): np.ones((16, 4), np.int32)}))
    _raises(tmp_path, "has dtype I32; LoRA factors must be floating point")
    _edit_tensors(tmp_path, lambda t: t.update({KEY.format("B"): np.full((16, 4), 1e38,
                                                                          np.float32)}))
    _edit_config(tmp_path, lora_alpha=1e6)
    _raises(tmp_path, "overflows float32")


def test_unreadable_safetensors(tmp_path):
    write_adapter(tmp_path)
    (tmp_path / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{")
    _raises(tmp_path, "not a readable safetensors file")
