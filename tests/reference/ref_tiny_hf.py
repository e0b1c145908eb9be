"""Creates tiny random Llama/Qwen2 models with transformers, saves them, returns their logits.

Request: {"workdir", "models": [{"name", "arch": "llama"|"qwen2", "config": {...}, "seed",
"max_shard_size": str|null}], "prompts": [[token ids]]}. Arrays: "<name>/<i>" float32 logits
[len(prompt_i), vocab]. Each model is saved (safetensors) to workdir/<name>.
"""

import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from common import load_request, save

ARCHS = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}


def main():
    req = load_request()
    arrays = {}
    for spec in req["models"]:
        config_cls, model_cls = ARCHS[spec["arch"]]
        torch.manual_seed(spec["seed"])
        model = model_cls(config_cls(**spec["config"])).eval().to(torch.float32)
        # Random init leaves norms at 1 and biases at 0; perturb them so the test sees them.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight") or name.endswith(".bias"):
                    p.add_(0.1 * torch.randn_like(p))
        out = os.path.join(req["workdir"], spec["name"])
        kwargs = {"max_shard_size": spec["max_shard_size"]} if spec.get("max_shard_size") else {}
        model.save_pretrained(out, safe_serialization=True, **kwargs)
        for i, ids in enumerate(req["prompts"]):
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0]
            arrays[f"{spec['name']}/{i}"] = logits.float().numpy()
    save(arrays, {"files": {s["name"]: sorted(os.listdir(os.path.join(req["workdir"], s["name"])))
                            for s in req["models"]}})


if __name__ == "__main__":
    main()
