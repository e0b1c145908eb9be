"""The HF + PEFT multi-LoRA reference that LoRA tests share (tests/reference/ref_lora_hf.py).

One fixed request: tiny random Llama, Qwen2 and Phi-3 models (saved as HF checkpoints) and
random PEFT LoRA adapters on them (saved by PEFT) of ranks 4, 8 and 16, attention-only,
MLP-only and all-projection targets, rsLoRA, lora_alpha != r, layers_to_transform with
rank/alpha patterns, a regex target, and Phi-3's fused qkv_proj / gate_up_proj. Every test
calling `lora_reference()` gets the same cached result, so torch runs once per change of the
request or script.

Array names (numpy, in `LoRAReference.arrays`; a variant is a model name, the model without
adapter, or an adapter name, the adapter on its model):
  "<v>/logits/<i>"         float32 [len(PROMPTS[i]), vocab]   the prompt's full logits
  "<v>/greedy/<i>"         int32   [MAX_NEW_TOKENS]            greedy by full recompute, no EOS
  "<v>/topk_ids/<i>"       int32   [MAX_NEW_TOKENS, TOP_K]     log-softmax top-k per greedy step
  "<v>/topk_logprobs/<i>"  float32 [MAX_NEW_TOKENS, TOP_K]     (best first)
  "<v>/margins"            float32 [len(PROMPTS)]              smallest top-2 logit margin along
                                                              each prompt's greedy path
  "<a>/merged/<hf weight>" float32 [out, in]  e.g. "llama_qv_r4/merged/model.layers.0.self_attn.
                           q_proj.weight": the base weight after PEFT's merge_and_unload()
                           (Phi-3: its fused qkv_proj / gate_up_proj as stored)
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib

import numpy as np

from hf_reference import run_reference

_BASE = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             tie_word_embeddings=False)
MODELS = [
    {"name": "llama", "model_type": "llama", "seed": 0,
     "config": dict(_BASE, rope_theta=10000.0, rms_norm_eps=1e-5)},
    {"name": "qwen2", "model_type": "qwen2", "seed": 1,
     "config": dict(_BASE, rope_theta=1000000.0, rms_norm_eps=1e-6)},
    {"name": "phi3", "model_type": "phi3", "seed": 2,
     "config": dict(_BASE, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)},
]
_ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = [
    {"name": "llama_qv_r4", "model": "llama", "seed": 10,
     "lora": {"r": 4, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"]}},
    {"name": "llama_all_r8", "model": "llama", "seed": 11,
     "lora": {"r": 8, "lora_alpha": 16, "target_modules": _ALL}},
    {"name": "llama_mlp_r16_rslora", "model": "llama", "seed": 12,
     "lora": {"r": 16, "lora_alpha": 8, "use_rslora": True,
              "target_modules": ["gate_proj", "up_proj", "down_proj"]}},
    {"name": "llama_layers_patterns", "model": "llama", "seed": 13,
     "lora": {"r": 8, "lora_alpha": 16, "target_modules": ["k_proj", "o_proj", "down_proj"],
              "layers_to_transform": [0, 2], "rank_pattern": {"o_proj": 4},
              "alpha_pattern": {"down_proj": 4}}},
    {"name": "llama_regex_r4", "model": "llama", "seed": 14,
     "lora": {"r": 4, "lora_alpha": 12,
              "target_modules": r".*\.layers\.1\.(self_attn\.q_proj|mlp\.up_proj)"}},
    {"name": "qwen2_all_r8", "model": "qwen2", "seed": 15,
     "lora": {"r": 8, "lora_alpha": 8, "target_modules": _ALL}},
    {"name": "qwen2_qv_r16", "model": "qwen2", "seed": 16,
     "lora": {"r": 16, "lora_alpha": 32, "target_modules": ["q_proj", "v_proj"]}},
    {"name": "phi3_fused_r8", "model": "phi3", "seed": 17,
     "lora": {"r": 8, "lora_alpha": 16,
              "target_modules": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]}},
]
# Lengths 9, 23, 40, 1 and 17: most longer than a small prefill chunk, one a single token.
PROMPTS = [[5, 17, 42, 3, 200, 7, 7, 7, 1], [(7 * i + 3) % 200 + 1 for i in range(23)],
           list(range(1, 120, 3)), [9], [(11 * i + 5) % 210 + 1 for i in range(17)]]
MAX_NEW_TOKENS = 8
TOP_K = 5
MAX_RANK = 16  # the largest adapter rank above


@dataclasses.dataclass(frozen=True)
class LoRAReference:
    arrays: dict[str, np.ndarray]  # the names in the module docstring
    json: dict  # {"versions", "differs": adapter -> prompts whose greedy path leaves the base's}
    workdir: pathlib.Path

    def model_dir(self, model: str) -> pathlib.Path:
        """The HF checkpoint (config.json + model.safetensors) of model `model`."""
        return self.workdir / model

    def adapter_dir(self, adapter: str) -> pathlib.Path:
        """The PEFT adapter directory (adapter_config.json + adapter_model.safetensors)."""
        return self.workdir / adapter

    @staticmethod
    def base_of(adapter: str) -> str:
        return next(a["model"] for a in ADAPTERS if a["name"] == adapter)


@functools.cache
def lora_reference() -> LoRAReference:
    """Runs (or reads from the cache) ref_lora_hf on the fixed request; tests calling it need the
    `hf_ref` marker."""
    out = run_reference("ref_lora_hf", {"models": MODELS, "adapters": ADAPTERS,
                                        "prompts": PROMPTS, "max_new_tokens": MAX_NEW_TOKENS,
                                        "top_k": TOP_K})
    workdir = out.pop("workdir")
    payload = out.pop("json")
    return LoRAReference(arrays=out, json=payload, workdir=workdir)
