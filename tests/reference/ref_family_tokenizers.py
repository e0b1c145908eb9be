"""Tiny tokenizers of the dense families, saved as HF directories, and transformers' renders.

Request: {"workdir", "families": [{"name", "specials": [str], "added": [str], "bos", "eos",
"pad", "chat_template", "text"}], "conversations": [{"messages", "add_generation_prompt",
"kwargs"}], "strings": [str]}. For each family a byte-level BPE is trained on "text" with the
special tokens (and non-special added tokens such as <think>), saved with tokenizer_config.json
(the real chat template) to workdir/<name>, and loaded back with AutoTokenizer. JSON:
{name: {"chats": [rendered text], "chat_ids": [ids of each render], "ids": [ids of strings],
"eos_id", "bos_id"}}.
"""

import json
import os

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer

from common import load_request, save


def _build(spec, directory):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=spec["specials"],
                                  show_progress=False)
    tok.train_from_iterator([spec["text"]], trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec["added"]])
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template":
              spec["chat_template"], "bos_token": spec["bos"], "eos_token": spec["eos"],
              "pad_token": spec["pad"], "add_bos_token": False}
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def main():
    req = load_request()
    payload = {}
    for spec in req["families"]:
        directory = os.path.join(req["workdir"], spec["name"])
        _build(spec, directory)
        tok = AutoTokenizer.from_pretrained(directory)
        chats = [tok.apply_chat_template(c["messages"], tokenize=False,
                                         add_generation_prompt=c["add_generation_prompt"],
                                         **c.get("kwargs", {}))
                 for c in req["conversations"]]
        payload[spec["name"]] = {
            "chats": chats,
            "chat_ids": [tok.encode(c, add_special_tokens=False) for c in chats],
            "ids": [tok.encode(s, add_special_tokens=False) for s in req["strings"]],
            "eos_id": tok.eos_token_id, "bos_id": tok.bos_token_id}
    save({}, payload)


if __name__ == "__main__":
    main()
