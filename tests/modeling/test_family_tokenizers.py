"""Tokenizers and chat templates of the dense families load from their files and render like
transformers' `apply_chat_template` (tiny BPE copies carrying each family's special tokens and
its real template, tests/chat_templates/)."""

import pathlib

import pytest

from hf_reference import run_reference
from models.tokenizer import Tokenizer

pytestmark = pytest.mark.hf_ref

TEMPLATES = pathlib.Path(__file__).resolve().parents[1] / "chat_templates"
TEXT = ("The capital of France is Paris. Think step by step: 2 + 2 = 4. "
        "Hello! How are you today? I am fine, thank you. def add(a, b): return a + b\n") * 4
FAMILIES = [
    {"name": "qwen3", "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
     "added": ["<think>", "</think>", "<tool_call>", "</tool_call>"],
     "bos": None, "eos": "<|im_end|>", "pad": "<|endoftext|>",
     "chat_template": (TEMPLATES / "qwen3.jinja").read_text(), "text": TEXT},
    {"name": "phi3", "specials": ["<unk>", "<s>", "<|endoftext|>", "<|assistant|>",
                                  "<|end|>", "<|system|>", "<|user|>"],
     "added": [], "bos": "<s>", "eos": "<|endoftext|>", "pad": "<|endoftext|>",
     "chat_template": (TEMPLATES / "phi3.jinja").read_text(), "text": TEXT},
]
_SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
_USER = {"role": "user", "content": "What is 2 + 2?"}
CONVERSATIONS = [
    {"messages": [_USER], "add_generation_prompt": True},
    {"messages": [_SYSTEM, _USER], "add_generation_prompt": True},
    {"messages": [_SYSTEM, _USER, {"role": "assistant", "content": "4."},
                  {"role": "user", "content": "And 3 + 3?"}], "add_generation_prompt": True},
    # The last assistant turn carries its reasoning, which Qwen3's template splits off.
    {"messages": [_USER, {"role": "assistant",
                          "content": "<think>\nadd them\n</think>\n\nIt is 4."}],
     "add_generation_prompt": False},
]
STRINGS = ["Hello! How are you today?", "<|im_start|>user\nhi<|im_end|>", "<think>x</think>",
           "<|user|>\nhi<|end|>\n<|assistant|>\n"]
STOPS = {"qwen3": "<|im_end|>", "phi3": "<|end|>"}


@pytest.fixture(scope="module")
def reference():
    return run_reference("ref_family_tokenizers", {
        "families": FAMILIES, "conversations": CONVERSATIONS, "strings": STRINGS})


@pytest.mark.parametrize("family", [f["name"] for f in FAMILIES])
def test_chat_template_renders_like_hf(reference, family):
    tok = Tokenizer.from_hf_dir(reference["workdir"] / family)
    want = reference["json"][family]
    for conv, text, ids in zip(CONVERSATIONS, want["chats"], want["chat_ids"]):
        got = tok.apply_chat_template(conv["messages"],
                                      add_generation_prompt=conv["add_generation_prompt"])
        assert got == text
        assert tok.encode(got) == ids


@pytest.mark.parametrize("family", [f["name"] for f in FAMILIES])
def test_tokenizer_loads_like_hf(reference, family):
    tok = Tokenizer.from_hf_dir(reference["workdir"] / family)
    want = reference["json"][family]
    assert [tok.encode(s) for s in STRINGS] == want["ids"]
    assert (tok.eos_token_id, tok.bos_token_id) == (want["eos_id"], want["bos_id"])
    # Chat models end a reply with their end-of-turn marker, not only the vocabulary's eos.
    assert tok.token_to_id(STOPS[family]) in tok.stop_token_ids
