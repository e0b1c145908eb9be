"""Tiny random Llama/Qwen2/Phi-3 models with random PEFT LoRA adapters, made by transformers + PEFT:
what each model computes without and with each adapter, and the adapters' merged weights.

Request: {"workdir", "models": [{"name", "model_type", "config", "seed"}],
"adapters": [{"name", "model", "seed", "lora": {peft.LoraConfig arguments}}], "prompts":
[[ids]], "max_new_tokens", "top_k"}. Model and adapter names are one namespace ("variants": a
model's name is the model without adapter). Arrays per variant v, per prompt i:
"<v>/logits/<i>" float32 [len(prompt_i), vocab] (the prompt's full logits);
"<v>/greedy/<i>" int32 [max_new_tokens] (greedy by full recompute, no EOS stop);
"<v>/topk_ids/<i>" int32 and "<v>/topk_logprobs/<i>" float32 [max_new_tokens, top_k] (the
log-softmax top-k at each greedy step, best first); "<v>/margins" float32 [num_prompts] (the
smallest top-2 logit margin along each prompt's greedy path). Per adapter a and linear weight
w of the base model (HF name, e.g. "model.layers.0.self_attn.q_proj.weight"):
"<a>/merged/<w>" float32 [out, in], the weight after PEFT's merge_and_unload() (equal to the
base weight where the adapter does not reach; Phi-3's fused qkv_proj / gate_up_proj as
stored). JSON: {"versions", "differs": {adapter: the prompts whose greedy tokens differ from
the base model's}}.
Each model is saved (safetensors) to workdir/<model>, each adapter with PEFT's
save_pretrained to workdir/<adapter> (adapter_config.json + adapter_model.safetensors); the
outputs with an adapter are computed from those saved files (PeftModel.from_pretrained).
"""

import copy
import math
import os

import peft
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

from common import load_request, save

# Each adapter's delta on a projection's output has about this standard deviation (for inputs
# of unit scale); the base projections' is about 0.16 (transformers' init std 0.02, width 64),
# so an adapter changes the outputs clearly without swamping the model.
DELTA_STD = 0.1
# transformers' init gives a tiny model near-uniform logits (top-2 margins ~1e-3, below what a
# float32 engine may differ by in places); a larger head spreads them so greedy paths and
# top-k are decisive.
HEAD_SCALE = 8.0


def _build(spec):
    torch.manual_seed(spec["seed"])
    config = AutoConfig.for_model(spec["model_type"], **spec["config"])
    model = AutoModelForCausalLM.from_config(config).eval().to(torch.float32)
    # Random init leaves norms at 1 and biases at 0: perturb them so the test sees them.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
        model.lm_head.weight.mul_(HEAD_SCALE)
    return model


def _save_adapter(base, spec, out_dir):
    """A PEFT LoRA adapter on a copy of `base` with random A and non-zero B (PEFT starts B at
    zero, which would make the adapter a no-op), saved to out_dir."""
    torch.manual_seed(spec["seed"])
    config = peft.LoraConfig(lora_dropout=0.0, task_type="CAUSAL_LM", **spec["lora"])
    model = peft.get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, peft.tuners.lora.LoraLayer) and "default" in module.lora_A:
                a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
                r, scaling = a.shape[0], module.scaling["default"]
                a.copy_(torch.randn_like(a) / math.sqrt(a.shape[1]))  # [r, in]
                b.copy_(torch.randn_like(b) * (DELTA_STD / (math.sqrt(r) * scaling)))  # [out, r]
    model.save_pretrained(out_dir, safe_serialization=True)


def _run(model, prompts, max_new_tokens, top_k, name):
    arrays, margins, greedy = {}, [], []
    for i, ids in enumerate(prompts):
        with torch.no_grad():
            arrays[f"{name}/logits/{i}"] = model(torch.tensor([ids])).logits[0].float().numpy()
        out, top_ids, top_lp, margin = [], [], [], float("inf")
        for _ in range(max_new_tokens):
            with torch.no_grad():
                last = model(torch.tensor([ids + out])).logits[0, -1].float()
            top2 = torch.topk(last, 2).values
            margin = min(margin, float(top2[0] - top2[1]))
            lp = torch.topk(torch.log_softmax(last, -1), top_k)
            top_ids.append(lp.indices)
            top_lp.append(lp.values)
            out.append(int(torch.argmax(last)))
        arrays[f"{name}/greedy/{i}"] = torch.tensor(out).int().numpy()
        arrays[f"{name}/topk_ids/{i}"] = torch.stack(top_ids).int().numpy()
        arrays[f"{name}/topk_logprobs/{i}"] = torch.stack(top_lp).numpy()
        margins.append(margin)
        greedy.append(out)
    arrays[f"{name}/margins"] = torch.tensor(margins).numpy()
    return arrays, greedy


def _linear_weights(model):
    """HF name -> weight `[out, in]` of every decoder projection (the LM head excluded)."""
    return {name: p.detach().float().numpy().copy() for name, p in model.named_parameters()
            if name.startswith("model.layers.") and name.endswith("_proj.weight")}


def main():
    req = load_request()
    names = [m["name"] for m in req["models"]] + [a["name"] for a in req["adapters"]]
    assert len(set(names)) == len(names), f"model and adapter names must be unique: {names}"
    run = lambda model, name: _run(model, req["prompts"], req["max_new_tokens"],  # noqa: E731
                                   req["top_k"], name)
    arrays, bases, base_greedy, differs = {}, {}, {}, {}
    for spec in req["models"]:
        model = bases[spec["name"]] = _build(spec)
        model.save_pretrained(os.path.join(req["workdir"], spec["name"]),
                              safe_serialization=True)
        found, base_greedy[spec["name"]] = run(model, spec["name"])
        arrays.update(found)
    for spec in req["adapters"]:
        out_dir = os.path.join(req["workdir"], spec["name"])
        _save_adapter(bases[spec["model"]], spec, out_dir)
        model = peft.PeftModel.from_pretrained(copy.deepcopy(bases[spec["model"]]),
                                               out_dir).eval()
        found, greedy = run(model, spec["name"])
        arrays.update(found)
        differs[spec["name"]] = [i for i, (g, b) in enumerate(zip(greedy,
                                 base_greedy[spec["model"]])) if g != b]
        merged = model.merge_and_unload()
        arrays.update({f"{spec['name']}/merged/{w}": x
                       for w, x in _linear_weights(merged).items()})
    save(arrays, {"versions": {"transformers": transformers.__version__,
                               "peft": peft.__version__, "torch": torch.__version__},
                  "differs": differs})


if __name__ == "__main__":
    main()
