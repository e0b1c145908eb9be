"""HF reference for tests/test_tokenizer.py: transformers' own tokenizer built from the GGUF.

Request: {"gguf": path, "strings": [...], "conversations": [{"messages": [...],
"add_generation_prompt": bool, "continue_final_message"?: bool}, ...], "digit_strings": [...],
"custom_templates": [...], "workdir": dir}  (workdir is added by tests/hf_reference.py).
Writes a JSON payload with HF's ids, decodes and rendered chat templates, and saves the tokenizer
(tokenizer.json + tokenizer_config.json) to workdir/saved for the test to load as an HF directory.

For tokenizer.ggml.pre='smollm' transformers keeps GPT-2's plain ByteLevel split, while SmolLM2's
own tokenizer.json (HuggingFaceTB/SmolLM2-*) splits with Sequence[Digits(individual_digits=True),
ByteLevel(use_regex=True)], as llama.cpp does; the two differ on whitespace runs before a digit
("a  1"). "original_ids" re-encodes with that original pipeline.
"""

import os

from tokenizers import Tokenizer, pre_tokenizers
from transformers import AutoTokenizer

from common import load_request, save


def _render(tok, template, conv):
    try:
        return tok.apply_chat_template(conv["messages"], chat_template=template, tokenize=False,
                                       add_generation_prompt=conv["add_generation_prompt"],
                                       continue_final_message=conv.get("continue_final_message",
                                                                       False))
    except Exception as e:  # the test checks that we raise the same message
        return {"error": str(e)}


def main():
    req = load_request()
    gguf = req["gguf"]
    tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    ids = [tok.encode(s, add_special_tokens=False) for s in req["strings"]]
    original = Tokenizer.from_str(tok.backend_tokenizer.to_str())
    original.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    every = req["strings"] + req["digit_strings"]
    payload = {
        "digit_ids": [tok.encode(s, add_special_tokens=False) for s in req["digit_strings"]],
        "original_ids": [original.encode(s, add_special_tokens=False).ids for s in every],
        "ids": ids,
        "decoded": [tok.decode(i) for i in ids],
        "decoded_skip": [tok.decode(i, skip_special_tokens=True) for i in ids],
        "chats": [_render(tok, None, c) for c in req["conversations"]],
        "custom": [[_render(tok, t, c) for c in req["conversations"]]
                   for t in req["custom_templates"]],
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "vocab_size": len(tok),
        "im_end_id": tok.convert_tokens_to_ids("<|im_end|>"),
    }
    save_dir = os.path.join(req["workdir"], "saved")
    os.makedirs(save_dir, exist_ok=True)
    tok.save_pretrained(save_dir)
    payload["saved_files"] = sorted(os.listdir(save_dir))
    save({}, payload)


if __name__ == "__main__":
    main()
