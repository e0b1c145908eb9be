"""HF transformers' prompt logprobs on the SmolLM2 GGUF (HF's own GGUF dequantization), float32.

Request: {"gguf", "prompts": [[ids]], "topk"}. Arrays per prompt i: "target/{i}" [T - 1] the
log-softmax of each prompt token given the tokens before it (positions 1..T-1), "top_idx/{i}"
and "top_lp/{i}" [T - 1, k] the top-k log-softmax entries at the position before each.
"""

import os

import torch
from transformers import AutoModelForCausalLM

from common import load_request, save


def main():
    req = load_request()
    torch.set_num_threads(2)
    folder, name = os.path.split(req["gguf"])
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                 dtype=torch.float32).eval()
    arrays = {}
    for i, ids in enumerate(req["prompts"]):
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
        lp = lp[:-1]  # [T - 1, V]: position p predicts token p + 1
        arrays[f"target/{i}"] = lp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()
        top = torch.topk(lp, req["topk"], dim=-1)
        arrays[f"top_idx/{i}"] = top.indices.numpy()
        arrays[f"top_lp/{i}"] = top.values.numpy()
    save(arrays)


if __name__ == "__main__":
    main()
