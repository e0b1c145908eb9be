"""Tiny random MoE models (Mixtral, Qwen3-MoE, OLMoE) made by transformers: logits, routing,
greedy tokens.

Request: {"workdir", "models": [{"name", "arch", "config", "seed"}], "prompts": [[ids]],
"greedy_prompts": [[ids]], "max_new_tokens"}. Arrays per model: "<name>/logits/<i>" float32
[len(prompt_i), vocab]; "<name>/experts/<i>" int32 [layers, len(prompt_i), top_k] (each
token's chosen experts, from forward hooks on the routers); "<name>/greedy/<j>" int32
[max_new_tokens] (greedy by full recompute, no EOS stop); "<name>/margin" the smallest top-2
logit margin along the greedy paths. Each model is saved (safetensors) to workdir/<name>.
"""

import math
import os

import torch
import transformers

from common import load_request, save

ARCHS = {"mixtral": ("MixtralConfig", "MixtralForCausalLM"),
         "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
         "olmoe": ("OlmoeConfig", "OlmoeForCausalLM")}


def _build(spec):
    config_cls, model_cls = (getattr(transformers, n) for n in ARCHS[spec["arch"]])
    torch.manual_seed(spec["seed"])
    model = model_cls(config_cls(**spec["config"])).eval().to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Random init leaves norms at 1 (and a Qwen3-MoE router at 0): perturb them so the
            # test sees them and the routing is decisive.
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("gate.weight") and p.dim() == 2 and p.shape[0] < p.shape[1]:
                p.copy_(torch.randn_like(p) * (2.0 / math.sqrt(p.shape[1])))
    return model


def _routers(model):
    for layer in model.model.layers:
        moe = getattr(layer, "block_sparse_moe", None) or layer.mlp
        yield moe.gate


def main():
    req = load_request()
    arrays = {}
    for spec in req["models"]:
        name = spec["name"]
        model = _build(spec)
        model.save_pretrained(os.path.join(req["workdir"], name), safe_serialization=True)
        captured = []
        hooks = [g.register_forward_hook(lambda m, i, out: captured.append(out[2]))
                 for g in _routers(model)]
        for i, ids in enumerate(req["prompts"]):
            captured.clear()
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0]
            arrays[f"{name}/logits/{i}"] = logits.float().numpy()
            arrays[f"{name}/experts/{i}"] = torch.stack(captured).int().numpy()  # [L, T, k]
        for h in hooks:
            h.remove()
        margin = float("inf")
        for j, ids in enumerate(req["greedy_prompts"]):
            out = []
            for _ in range(req["max_new_tokens"]):
                with torch.no_grad():
                    last = model(torch.tensor([ids + out])).logits[0, -1]
                top2 = torch.topk(last, 2).values
                margin = min(margin, float(top2[0] - top2[1]))
                out.append(int(torch.argmax(last)))
            arrays[f"{name}/greedy/{j}"] = torch.tensor(out).int().numpy()
        arrays[f"{name}/margin"] = torch.tensor(margin).numpy()
    save(arrays, {"transformers": transformers.__version__})


if __name__ == "__main__":
    main()
