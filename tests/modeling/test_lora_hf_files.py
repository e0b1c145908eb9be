"""Adapters saved by PEFT, read by models/lora_weights.py: each base weight plus our `A @ B`
equals PEFT's merge_and_unload() weight, for every layer and projection. The independent check
that our loader reads PEFT's files (names, transposes, scaling, rsLoRA, layer selection, rank
and alpha patterns, regex targets, Phi-3's fused projections) as PEFT does. numpy only: no
model runs."""

import numpy as np
import pytest
from safetensors.numpy import load_file

from lora_reference import ADAPTERS, MAX_RANK, lora_reference
from models.hf_loader import config_from_hf_json
from models.lora_names import LORA_TARGETS
from models.lora_weights import load_peft_adapter
from models.weights import unfuse

pytestmark = pytest.mark.hf_ref

NAMES = [a["name"] for a in ADAPTERS]
# float32 sums in another order (W + A @ (s B) here, W + s (B @ A) in PEFT) on values below
# ~0.1: a few ulps, far below any misread (a wrong scale or transpose moves them by ~1e-2).
ATOL = 2e-6


def _base(ref, model):
    config = config_from_hf_json(ref.model_dir(model) / "config.json")
    return config, unfuse(load_file(str(ref.model_dir(model) / "model.safetensors")), config)


def _merged(ref, name, config):
    """PEFT's merged weights by HF name, Phi-3's fused ones split like the base's."""
    prefix = f"{name}/merged/"
    return unfuse({k[len(prefix):]: v for k, v in ref.arrays.items() if k.startswith(prefix)},
                  config)


def _hf_name(layer, module):
    block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    return f"model.layers.{layer}.{block}.{module}.weight"


@pytest.mark.parametrize("name", NAMES)
def test_base_plus_our_delta_is_pefts_merged_weight(name):
    ref = lora_reference()
    config, base = _base(ref, ref.base_of(name))
    adapter = load_peft_adapter(ref.adapter_dir(name), config, max_rank=MAX_RANK)
    merged_weights = _merged(ref, name, config)
    changed = set()
    for layer in range(config.num_layers):
        for module in LORA_TARGETS:
            w = _hf_name(layer, module)
            ours = base[w].T  # [in, out], our kernels' layout
            if module in adapter.modules:
                a, b = adapter.modules[module]
                ours = ours + a[layer] @ b[layer]  # [K, r_max] @ [r_max, N]
            merged = merged_weights[w].T
            np.testing.assert_allclose(ours, merged, rtol=0, atol=ATOL, err_msg=f"{name} {w}")
            if not np.array_equal(merged, base[w].T):
                changed.add((layer, module))
    # Not vacuous: PEFT's merge moved every module the adapter has factors for, and only those.
    assert changed == {(layer, m) for m, (a, _) in adapter.modules.items()
                       for layer in range(config.num_layers) if a[layer].any()}
    assert changed


def test_adapters_change_what_the_model_computes():
    # Engine tests compare generations with and without adapters; each adapter must move them.
    ref = lora_reference()
    for name in NAMES:
        base = ref.base_of(name)
        assert not np.allclose(ref.arrays[f"{name}/logits/0"], ref.arrays[f"{base}/logits/0"],
                               atol=1e-2), name
    assert all(ref.json["differs"][n] for n in NAMES), ref.json["differs"]
