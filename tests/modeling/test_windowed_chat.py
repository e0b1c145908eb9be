"""Gemma 2, Gemma 3 and Mistral tokenizers and chat templates: tiny tokenizers carrying the real
templates (tests/windowed_chat_templates.py), saved by transformers, load from their files and
render (text and ids) like HF's apply_chat_template, refusals included."""

import re

import pytest

from hf_reference import run_reference
from models.tokenizer import Tokenizer
from windowed_chat_templates import CONVERSATIONS, FAMILIES, TRAINING_TEXT

pytestmark = pytest.mark.hf_ref


@pytest.fixture(scope="module")
def hf():
    return run_reference("ref_windowed_chat", {"families": FAMILIES,
                                               "conversations": CONVERSATIONS,
                                               "training_text": TRAINING_TEXT})


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_chat_template_renders_like_hf(hf, name):
    tok = Tokenizer.from_hf_dir(hf["workdir"] / name)
    assert tok.chat_template == FAMILIES[name]["template"]
    assert tok.bos_token_id == tok.encode(FAMILIES[name]["bos"])[0]
    assert tok.eos_token_id in tok.stop_token_ids
    for conv, ref in zip(CONVERSATIONS, hf["json"][name]):
        args = conv["messages"], conv["add_generation_prompt"]
        if "error" in ref:
            with pytest.raises(Exception, match=re.escape(ref["error"])):
                tok.apply_chat_template(*args)
            continue
        text = tok.apply_chat_template(*args)
        assert text == ref["text"]
        assert tok.encode(text) == ref["ids"]  # special tokens in the text are one id each


def test_family_facts(hf):
    # Independent facts of the templates: Gemma's assistant is "model"; Gemma 2 refuses a
    # system turn that Gemma 3 folds into the first user turn; Mistral wraps turns in [INST].
    g2, g3, mi = (hf["json"][n] for n in ("gemma2", "gemma3", "mistral"))
    assert g2[1]["text"].startswith("<bos><start_of_turn>user\nWhat is 7")
    assert "<start_of_turn>model\n56.<end_of_turn>" in g2[1]["text"]
    assert "System role not supported" in g2[2]["error"]
    assert g3[2]["text"].startswith("<bos><start_of_turn>user\nAnswer briefly.\n\nName a colour.")
    assert mi[1]["text"] == "<s>[INST] What is 7 times 8? [/INST]56.</s> [INST] And 9 times 9? [/INST]"
    assert all("alternate" in family[4]["error"] for family in (g2, g3, mi))
