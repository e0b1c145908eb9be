"""Tiny tokenizers with the Gemma 2 / Gemma 3 / Mistral chat templates, saved by transformers,
and HF's apply_chat_template renders (text and ids) of the test conversations.

Request: {"workdir", "families": {name: {template, specials, bos, eos, pad}}, "conversations",
"training_text"}. Payload: {name: [{"text", "ids"} or {"error"}, ...]}; tokenizers saved to
workdir/<name>.
"""

import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from common import load_request, save


def build(spec, text):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=200, special_tokens=spec["specials"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=spec["bos"],
                                   eos_token=spec["eos"], pad_token=spec["pad"],
                                   chat_template=spec["template"])


def main():
    req = load_request()
    payload = {}
    for name, spec in req["families"].items():
        tok = build(spec, req["training_text"])
        tok.save_pretrained(os.path.join(req["workdir"], name))
        renders = []
        for conv in req["conversations"]:
            try:
                text = tok.apply_chat_template(conv["messages"], tokenize=False,
                                               add_generation_prompt=conv["add_generation_prompt"])
                renders.append({"text": text, "ids": tok.encode(text, add_special_tokens=False)})
            except Exception as e:  # the test checks that we refuse with the same message
                renders.append({"error": str(e)})
        payload[name] = renders
    save({}, payload)


if __name__ == "__main__":
    main()
