"""Tiny random models of the dense families (Qwen3, Phi-3, RoPE variants) made by transformers.

Request: {"workdir", "models": [{"name", "model_type", "config": {...}, "seed"}],
"prompts": [[ids]], "greedy_prompts": [[ids]], "greedy_tokens": int,
"rope_cases": [{"config": {...llama config...}, "seq_lens": [int]}]}.
Arrays: "<name>/<i>" float32 logits [len(prompt_i), vocab]; "<name>/greedy/<i>" int64 greedy
continuation of greedy_prompts[i] by full recompute (no KV cache, so the dense forward decides);
"rope/<c>/<seq_len>" transformers' inv_freq. JSON: {"margins": {name: smallest top-2 logit
gap along the greedy continuations}, "rope_factors": [[attention_factor per seq_len]]}.
Each model is saved (safetensors) to workdir/<name>.
"""

import os

import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from common import load_request, save


def _build(spec):
    torch.manual_seed(spec["seed"])
    config = AutoConfig.for_model(spec["model_type"], **spec["config"])
    model = AutoModelForCausalLM.from_config(config).eval().to(torch.float32)
    # Random init leaves norms at 1 and biases at 0; perturb them so the test sees them.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def _greedy(model, ids, n):
    ids, margin = list(ids), float("inf")
    out = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids + out])).logits[0, -1]
            top2 = torch.topk(logits, 2).values
            margin = min(margin, float(top2[0] - top2[1]))
            out.append(int(torch.argmax(logits)))
    return out, margin


def _rope(case, arrays, c):
    config = LlamaConfig(**case["config"])
    kind = config.rope_parameters["rope_type"]
    factors = []
    for n in case["seq_lens"]:
        inv_freq, factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu", seq_len=n)
        arrays[f"rope/{c}/{n}"] = inv_freq.float().numpy()
        factors.append(float(factor))
    return factors


def main():
    req = load_request()
    arrays, margins = {}, {}
    for spec in req["models"]:
        model = _build(spec)
        model.save_pretrained(os.path.join(req["workdir"], spec["name"]),
                              safe_serialization=True)
        with torch.no_grad():
            for i, ids in enumerate(req["prompts"]):
                arrays[f"{spec['name']}/{i}"] = model(torch.tensor([ids])).logits[0].numpy()
        margins[spec["name"]] = float("inf")
        for i, ids in enumerate(req["greedy_prompts"] if spec.get("greedy") else []):
            out, margin = _greedy(model, ids, req["greedy_tokens"])
            arrays[f"{spec['name']}/greedy/{i}"] = torch.tensor(out).numpy()
            margins[spec["name"]] = min(margins[spec["name"]], margin)
    factors = [_rope(case, arrays, c) for c, case in enumerate(req.get("rope_cases", []))]
    save(arrays, {"margins": margins, "rope_factors": factors})


if __name__ == "__main__":
    main()
