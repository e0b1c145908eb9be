"""A tiny random model with a real tokenizer and chat template, for tests of text in and out.

The tokenizer is a byte-level BPE trained in milliseconds on a fixed text (so it is the same
on every machine), with ChatML special tokens and template: what the server and engine need
from SmolLM2's tokenizer, without loading the real model. Its alphabet is only the printable
ASCII bytes of that text, so every token decodes to valid UTF-8 on its own.
"""

from __future__ import annotations

import dataclasses
import string

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from models.tokenizer import Tokenizer
from jaxserve.testing.tiny_models import TINY_CHAT

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
                 "{{ message['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TRAINING_TEXT = "\n".join([
    string.printable,
    "The capital of France is Paris. Water boils at one hundred degrees.",
    "def add(a, b):\n    return a + b\n\nOnce upon a time there was a quick brown fox.",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10. Roses are red, violets are blue.",
    "The largest planet in the solar system is Jupiter. Name a colour: green, red, blue.",
    "Hello! How are you today? I am fine, thank you. What is the answer to the question?",
    "user assistant system: the model answers every message with a short reply.",
] * 3)


def tiny_tokenizer(vocab_size: int = TINY_CHAT.vocab_size) -> Tokenizer:
    """The BPE tokenizer of exactly `vocab_size` tokens (specials first), eos <|endoftext|>."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=[], show_progress=False)
    tok.train_from_iterator([TRAINING_TEXT], trainer)
    if tok.get_vocab_size() != vocab_size:  # the text ran out of merges
        raise ValueError(f"the training text gives {tok.get_vocab_size()} tokens, not "
                         f"{vocab_size}: lengthen TRAINING_TEXT")
    specials = [tok.token_to_id(t) for t in SPECIAL_TOKENS]
    return Tokenizer(tok, vocab_size=vocab_size, bos_token_id=None, eos_token_id=specials[0],
                     add_bos=False, chat_template=CHAT_TEMPLATE, special_token_ids=specials,
                     source="tiny-bpe")


def tiny_chat_model(seed: int = 0):
    """A random TINY_CHAT model (float32) that carries the tiny tokenizer."""
    from models.random_init import random_model
    model = random_model(TINY_CHAT, seed=seed)
    return dataclasses.replace(model, tokenizer=tiny_tokenizer(),
                               source=f"tiny-chat(seed={seed})")
