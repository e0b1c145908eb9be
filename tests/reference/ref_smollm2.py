"""HF transformers on the SmolLM2 GGUF (HF's own GGUF dequantization): the parity reference.

Request: {"gguf", "prompts": [text], "chat": [text], "max_new_tokens", "dtypes": [...], "topk"}.
Arrays per dtype d and prompt i: "{d}/ids/{i}" HF's token ids, "{d}/top_idx/{i}" and
"{d}/top_val/{i}" the top-k logits at every position, "{d}/greedy/{j}" the greedy continuation of
chat prompt j and "{d}/greedy_margin/{j}" HF's top-1 minus top-2 logit at each of its steps (how
close each greedy choice was). JSON: the decoded greedy texts and the chat-templated strings.
"""

import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from common import load_request, save


def main():
    req = load_request()
    torch.set_num_threads(2)
    folder, name = os.path.split(req["gguf"])
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    arrays, payload = {}, {"greedy_text": {}, "chat_text": []}
    for dtype in req["dtypes"]:
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=getattr(torch, dtype)).eval()
        for i, text in enumerate(req["prompts"]):
            ids = tok(text, add_special_tokens=False).input_ids
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0].float()
            top = torch.topk(logits, req["topk"], dim=-1)
            arrays[f"{dtype}/ids/{i}"] = ids
            arrays[f"{dtype}/top_idx/{i}"] = top.indices.numpy()
            arrays[f"{dtype}/top_val/{i}"] = top.values.numpy()
        texts = []
        for j, question in enumerate(req["chat"]):
            prompt = tok.apply_chat_template([{"role": "user", "content": question}],
                                             tokenize=False, add_generation_prompt=True)
            ids = tok(prompt, add_special_tokens=False, return_tensors="pt").input_ids
            with torch.no_grad():
                gen = model.generate(ids, max_new_tokens=req["max_new_tokens"], do_sample=False,
                                     output_scores=True, return_dict_in_generate=True)
            out = gen.sequences
            top2 = torch.topk(torch.cat(gen.scores).float(), 2, dim=-1).values  # [steps, 2]
            arrays[f"{dtype}/chat_ids/{j}"] = ids[0].numpy()
            arrays[f"{dtype}/greedy/{j}"] = out[0, ids.shape[1]:].numpy()
            arrays[f"{dtype}/greedy_margin/{j}"] = (top2[:, 0] - top2[:, 1]).numpy()
            texts.append(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
            payload["chat_text"].append(prompt)
        payload["greedy_text"][dtype] = texts
    save(arrays, payload)


if __name__ == "__main__":
    main()
