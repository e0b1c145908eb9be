"""A tiny random Llama made by transformers: its last layer's hidden states (after the final
norm) for each prompt, which embeddings pool.

Request: {"workdir", "config": {LlamaConfig arguments}, "seed", "prompts": [[ids]]}. Arrays:
"hidden/<i>" float32 [len(prompt_i), hidden_size]: `output_hidden_states=True`'s last entry
(checked equal to the base model's last_hidden_state, the final norm's output). The model is
saved (safetensors) to workdir/model.
"""

import os

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

from common import load_request, save

# transformers' init gives a tiny model near-uniform logits; a larger head spreads them, so that
# the tests' greedy generations beside the embeddings have decisive tokens (as ref_lora_hf.py).
HEAD_SCALE = 8.0


def main():
    req = load_request()
    torch.manual_seed(req["seed"])
    model = LlamaForCausalLM(LlamaConfig(**req["config"])).eval().to(torch.float32)
    # Random init leaves the norms at 1: perturb them so that the final norm's weight shows.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
        model.lm_head.weight.mul_(HEAD_SCALE)
    model.save_pretrained(os.path.join(req["workdir"], "model"), safe_serialization=True)
    arrays = {}
    for i, ids in enumerate(req["prompts"]):
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True)
            last = model.model(torch.tensor([ids])).last_hidden_state[0]
        hidden = out.hidden_states[-1][0]
        # The final norm's output, not the last layer's: what embeddings pool.
        assert torch.equal(hidden, last), "hidden_states[-1] is not the normed last state"
        arrays[f"hidden/{i}"] = hidden.float().numpy()
    save(arrays, {"transformers": transformers.__version__})


if __name__ == "__main__":
    main()
