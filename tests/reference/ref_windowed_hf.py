"""Tiny random Mistral / Gemma 2 / Gemma 3 text models made by transformers: saved, with their
logits and greedy continuations (full recompute, no HF cache) on the test prompts.

Request: {"workdir", "models": [{"name", "arch": "mistral"|"gemma2"|"gemma3_text", "config",
"seed"}], "prompts": [[ids]], "greedy_prompts": [[ids]], "max_new_tokens": int}. Arrays:
"<name>/<i>" float32 logits [len(prompt_i), vocab]; "<name>/greedy/<i>" int32 [max_new_tokens].
Each model is saved (safetensors) to workdir/<name>.
"""

import os

import torch
from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig,
                          MistralConfig, MistralForCausalLM)

from common import load_request, save

ARCHS = {"mistral": (MistralConfig, MistralForCausalLM),
         "gemma2": (Gemma2Config, Gemma2ForCausalLM),
         "gemma3_text": (Gemma3TextConfig, Gemma3ForCausalLM)}


def build(spec):
    config_cls, model_cls = ARCHS[spec["arch"]]
    torch.manual_seed(spec["seed"])
    # Eager attention: the only transformers path that applies Gemma 2's logit soft-capping.
    config = config_cls(**spec["config"], attn_implementation="eager")
    model = model_cls(config).eval().to(torch.float32)
    with torch.no_grad():  # random init leaves norms at 1 (Gemma: 0); perturb them
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def greedy(model, ids, n):
    out = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids + out])).logits[0, -1]
            out.append(int(torch.argmax(logits)))
    return out


def main():
    req = load_request()
    arrays = {}
    for spec in req["models"]:
        model = build(spec)
        model.save_pretrained(os.path.join(req["workdir"], spec["name"]),
                              safe_serialization=True)
        for i, ids in enumerate(req["prompts"]):
            with torch.no_grad():
                arrays[f"{spec['name']}/{i}"] = model(torch.tensor([ids])).logits[0].numpy()
        for i, ids in enumerate(req["greedy_prompts"]):
            arrays[f"{spec['name']}/greedy/{i}"] = torch.tensor(
                greedy(model, ids, req["max_new_tokens"]), dtype=torch.int32).numpy()
    save(arrays)


if __name__ == "__main__":
    main()
