"""models/tokenizer.py against HF transformers' tokenizer built from the same GGUF, plus
facts that need no reference (UTF-8 boundaries, regex splits, error messages)."""

import re

import pytest

from hf_reference import run_reference
from models.tokenizer import IncrementalDetokenizer, Tokenizer

EMOJI = "emoji 😀🎉 family 👨‍👩‍👧‍👦 thumbs 👍🏽 flags 🇫🇷🇯🇵 rainbow 🏳️‍🌈"
CHAT_LINE = "<|im_start|>user\nhi<|im_end|>"
CORPUS = [
    "",
    "Hello, world!",
    "12345 apples",
    "In 2024, pi ~ 3.14159, e=2.71828; 1,000,000 > -0.5e10 and v1.2.3",
    "café naïve résumé Ångström façade Œuvre",
    "你好，世界！这是一个测试。",
    "こんにちは世界、カタカナ",
    "مرحبا بالعالم",
    "Привет, мир",
    EMOJI,
    "def f(x):\n\tif x:\n\t\treturn x  # comment\n    else:\n        pass\n",
    "a    b     c\n\n\n d\r\n e\t\tf",
    "   leading and trailing   ",
    "\n\nnewlines first",
    "trailing newline\n",
    " ",
    "\n",
    "\t ",
    CHAT_LINE,
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text<repo_name>x<file_sep>y",
    "<not_special> <|im_start <|im_end|",
    "don't won't I'm we've they'll she'd it's DON'T I'M",
    "math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢, combining e\u0301 and zero\u200bwidth",
    'JSON {"key": [1, 2.5, null, true]} URL https://example.com/a?b=1&c=2',
]

# Whitespace runs before digits: where transformers' GGUF loader and SmolLM2's own tokenizer.json
# disagree (see tests/reference/ref_tokenizer.py). We follow llama.cpp's 'smollm' split, which is
# the original one.
DIGIT_STRINGS = ["a  1", "x   42 y", "Total:  100", "1  2", "a\n 1", "   7 days",
                 "costs $ 5.00\n\n  3"]

CONVERSATIONS = [
    {"messages": [{"role": "user", "content": "Hi there"}], "add_generation_prompt": True},
    {"messages": [{"role": "user", "content": "Hi there"}], "add_generation_prompt": False},
    {"messages": [{"role": "system", "content": "You are a pirate."},
                  {"role": "user", "content": "Where is the treasure?"}],
     "add_generation_prompt": True},
    {"messages": [{"role": "user", "content": "What is 2+2?"},
                  {"role": "assistant", "content": "4"},
                  {"role": "user", "content": "And 3+3?\nExplain. 😀"}],
     "add_generation_prompt": True},
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "héllo"},
                  {"role": "assistant", "content": "  bonjour  "}],
     "add_generation_prompt": False},
    # A prefilled reply the model continues: the text ends inside the last message.
    {"messages": [{"role": "user", "content": "What is 2+2?"},
                  {"role": "assistant", "content": "The answer is"}],
     "add_generation_prompt": False, "continue_final_message": True},
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "héllo"},
                  {"role": "assistant", "content": "  bonjour  "}],
     "add_generation_prompt": False, "continue_final_message": True},
]

# Templates exercising what HF's renderer adds to plain Jinja: trim_blocks/lstrip_blocks, its
# tojson, loop controls, namespace, raise_exception and strftime_now.
CUSTOM_TEMPLATES = [
    "{% for m in messages %}\n  {% if m['role'] == 'user' %}\n    U: {{ m['content'] }}\n"
    "  {% else %}\n    {{ m['role'] | upper }}: {{ m['content'] }}\n  {% endif %}\n"
    "{% endfor %}\n{% if add_generation_prompt %}\n  A:\n{% endif %}",
    "{{ bos_token }}{% for m in messages %}{% if loop.index0 > 1 %}{% break %}{% endif %}"
    "{{ m | tojson }}|{{ m['content'] | tojson(indent=2) }}\n{% endfor %}{{ eos_token }}",
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role, please') }}"
    "{% endif %}{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
    "{% endfor %}{{ ns.n }} turns {{ strftime_now('x') }}",
]

def chat_args(conv: dict) -> tuple:
    return (conv["messages"], conv["add_generation_prompt"],
            conv.get("continue_final_message", False))


@pytest.fixture(scope="module")
def hf(smollm2_path):
    request = {"gguf": str(smollm2_path), "strings": CORPUS, "conversations": CONVERSATIONS,
               "digit_strings": DIGIT_STRINGS, "custom_templates": CUSTOM_TEMPLATES}
    result = run_reference("ref_tokenizer", request, [smollm2_path])
    return dict(result["json"], save_dir=result["workdir"] / "saved")


@pytest.fixture(scope="module")
def gguf_tok(smollm2_path):
    return Tokenizer.from_gguf(smollm2_path)


@pytest.fixture(scope="module")
def dir_tok(hf):
    return Tokenizer.from_hf_dir(hf["save_dir"])


@pytest.fixture(params=["gguf", "hf_dir"])
def tok(request, gguf_tok, dir_tok):
    return gguf_tok if request.param == "gguf" else dir_tok


@pytest.mark.hf_ref
def test_ids_match_hf(tok, hf):
    mismatches = [(s, tok.encode(s), ref) for s, ref in zip(CORPUS, hf["ids"])
                  if tok.encode(s) != ref]
    assert not mismatches


@pytest.mark.hf_ref
def test_gguf_ids_match_original_smollm2_pipeline(gguf_tok, hf):
    # The GGUF says pre='smollm': the model was trained with individual-digit splitting.
    strings = CORPUS + DIGIT_STRINGS
    assert [gguf_tok.encode(s) for s in strings] == hf["original_ids"]
    # Facts of that split: "a  1" -> 'a', 'ĠĠ' (two spaces, one token), '1'.
    assert [gguf_tok.id_to_token(i) for i in gguf_tok.encode("a  1")] == ["a", "ĠĠ", "1"]


@pytest.mark.hf_ref
def test_hf_dir_follows_its_tokenizer_json(dir_tok, hf):
    # transformers saved its own (GPT-2 split) pipeline; loading that file must reproduce it.
    assert [dir_tok.encode(s) for s in DIGIT_STRINGS] == hf["digit_ids"]


@pytest.mark.hf_ref
def test_special_token_text_is_one_id(tok, hf):
    # Facts of this vocabulary: <|im_start|> is id 1, <|im_end|> id 2 (HF agrees above).
    assert tok.encode("<|im_start|>user") == hf["ids"][CORPUS.index(CHAT_LINE)][:2] == [1, 4093]
    assert tok.encode("<|im_end|>") == [hf["im_end_id"]] == [2]


@pytest.mark.hf_ref
def test_decode_matches_hf_and_round_trips(tok, hf):
    for s, ids, ref, ref_skip in zip(CORPUS, hf["ids"], hf["decoded"], hf["decoded_skip"]):
        assert tok.decode(ids) == ref == s
        assert tok.decode(ids, skip_special_tokens=True) == ref_skip
        assert tok.decode(tok.encode(s)) == s


@pytest.mark.hf_ref
def test_token_ids_and_stops_match_hf(tok, hf):
    assert tok.vocab_size == hf["vocab_size"]
    assert tok.bos_token_id == hf["bos_token_id"]
    assert tok.eos_token_id == hf["eos_token_id"]
    assert tok.pad_token_id == hf["pad_token_id"]
    assert tok.add_bos is False  # tokenizer.ggml.add_bos_token=False in this file
    assert hf["eos_token_id"] in tok.stop_token_ids and hf["im_end_id"] in tok.stop_token_ids
    assert tok.encode("<|endoftext|>")[0] in tok.special_token_ids
    assert not tok.stop_token_ids & set(tok.encode("Hello world, the end."))


@pytest.mark.hf_ref
def test_chat_template_matches_hf(tok, hf):
    for conv, ref in zip(CONVERSATIONS, hf["chats"]):
        assert tok.apply_chat_template(*chat_args(conv)) == ref
    assert hf["chats"][-2].endswith("<|im_start|>assistant\nThe answer is")  # no <|im_end|>
    # Independent facts of SmolLM2's template: a default system prompt when none is given.
    assert hf["chats"][0].startswith("<|im_start|>system\nYou are a helpful AI assistant")
    assert hf["chats"][0].endswith("<|im_start|>assistant\n")
    assert not hf["chats"][1].endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("index", range(len(CUSTOM_TEMPLATES)))
@pytest.mark.hf_ref
def test_custom_templates_match_hf(tok, hf, index):
    custom = tok.with_chat_template(CUSTOM_TEMPLATES[index])
    for conv, ref in zip(CONVERSATIONS, hf["custom"][index]):
        args = chat_args(conv)
        if isinstance(ref, dict):
            with pytest.raises(Exception, match=re.escape(ref["error"])):
                custom.apply_chat_template(*args)
        else:
            assert custom.apply_chat_template(*args) == ref
    assert tok.chat_template != CUSTOM_TEMPLATES[index]  # the original is left alone


@pytest.mark.model
def test_chat_template_extra_kwargs_and_sandbox(gguf_tok):
    tok = gguf_tok.with_chat_template("{{ bos_token }}{{ greeting }}{{ messages | tojson }}"
                                      "{% if tools is not none %}T{% endif %}")
    out = tok.apply_chat_template([{"role": "user", "content": "é<b>"}], greeting="hey")
    # HF's tojson: no HTML escaping, no ASCII escaping; `tools` is defined (None) as in HF.
    assert out == '<|im_start|>hey[{"role": "user", "content": "é<b>"}]'
    assert tok.apply_chat_template([], tools=[]) == "<|im_start|>[]T"
    # Templates come from model files: the immutable sandbox refuses to mutate inputs.
    evil = gguf_tok.with_chat_template("{% set _ = messages.append(1) %}")
    with pytest.raises(Exception, match="unsafe|immutable|not safely callable"):
        evil.apply_chat_template([])


# -- incremental detokenizer ------------------------------------------------------------------

def _stream(tok, ids, **kw):
    detok = IncrementalDetokenizer(tok, **kw)
    deltas, texts = [], []
    for i in ids:
        deltas.append(detok.add(i))
        texts.append("".join(deltas))
    deltas.append(detok.flush())
    return deltas, texts


@pytest.mark.hf_ref
def test_detokenizer_matches_full_decode(tok, hf):
    # Ids come from HF, and the expected text is HF's decode: nothing here trusts our encode.
    for ids, full in zip(hf["ids"], hf["decoded"]):
        deltas, texts = _stream(tok, ids)
        assert "".join(deltas) == full
        assert all(full.startswith(t) for t in texts)
        if "\ufffd" not in full:
            assert not any("\ufffd" in d for d in deltas)


@pytest.mark.hf_ref
def test_detokenizer_emits_emoji_only_whole(gguf_tok, hf):
    ids = hf["ids"][CORPUS.index(EMOJI)]
    deltas, _ = _stream(gguf_tok, ids)
    # Byte-level BPE on this vocab spells many emoji in several tokens, so holding back matters.
    assert sum(d == "" for d in deltas[:-1]) > 5
    assert "".join(deltas) == EMOJI
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.model
def test_detokenizer_single_emoji_split_over_bytes(gguf_tok):
    # U+1F600 is F0 9F 98 80 in UTF-8; feed the byte tokens one by one.
    byte_tokens = [gguf_tok.token_to_id(_byte_char(b)) for b in "😀".encode()]
    assert None not in byte_tokens
    detok = IncrementalDetokenizer(gguf_tok)
    assert [detok.add(t) for t in byte_tokens] == ["", "", "", "😀"]
    assert detok.flush() == ""


def _byte_char(b: int) -> str:
    """GPT-2's byte -> printable-char map (public definition from its encoder.py)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    if b in printable:
        return chr(b)
    return chr(256 + sorted(set(range(256)) - set(printable)).index(b))


@pytest.mark.model
def test_detokenizer_flush_and_invalid_bytes(gguf_tok):
    head = [gguf_tok.token_to_id(_byte_char(b)) for b in "😀".encode()[:2]]
    detok = IncrementalDetokenizer(gguf_tok)
    assert [detok.add(t) for t in head] == ["", ""]
    assert detok.flush() == "\ufffd"  # what a full decode of a truncated char gives
    # A stray continuation byte followed by text is invalid, not pending: emitted with the text.
    detok = IncrementalDetokenizer(gguf_tok)
    got = detok.add(gguf_tok.token_to_id(_byte_char(0x80))) + detok.add(gguf_tok.encode("a")[0])
    assert got == "\ufffda"


@pytest.mark.hf_ref
def test_detokenizer_with_prompt_and_skip_special(gguf_tok, hf):
    prompt = hf["ids"][CORPUS.index("<|im_start|>system\nYou are helpful.<|im_end|>\n"
                                    "<|im_start|>assistant\n")]
    gen = hf["ids"][CORPUS.index(CHAT_LINE)]
    deltas, _ = _stream(gguf_tok, gen, prompt_ids=prompt, skip_special_tokens=True)
    assert "".join(deltas) == hf["decoded_skip"][CORPUS.index(CHAT_LINE)]


@pytest.mark.hf_ref
def test_detokenizer_cost_independent_of_length(gguf_tok, hf):
    lengths = []

    class Spy:
        def decode(self, ids, skip_special_tokens=False):
            lengths.append(len(ids))
            return gguf_tok.decode(ids, skip_special_tokens)

    ids = [i for seq in hf["ids"] for i in seq] * 4
    detok = IncrementalDetokenizer(Spy(), prompt_ids=list(range(100)))
    text = "".join(detok.add(i) for i in ids) + detok.flush()
    assert text == "".join(hf["decoded"]) * 4
    assert len(ids) > 1000 and max(lengths) <= 40


# -- error cases ------------------------------------------------------------------------------

def _write_gguf(path, *, model="gpt2", pre="gpt-2", template=None):
    import gguf
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    tokens = ["<s>", "a", "b", "ab", "1", "2", "3", "4", "5", "Ġ", "Ġa", "<think>"]
    w.add_token_list(tokens)
    w.add_token_types([3] + [1] * (len(tokens) - 2) + [4])
    w.add_token_merges(["a b", "Ġ a"])
    w.add_eos_token_id(0)
    if template is not None:
        w.add_chat_template(template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_tokenizer_model(tmp_path):
    import gguf
    path = _write_gguf(tmp_path / "sp.gguf", model="llama")
    with pytest.raises(ValueError, match=r"sp\.gguf.*'llama'"):
        Tokenizer.from_gguf(path)
    with pytest.raises(ValueError, match=r"sp\.gguf.*'llama'"):
        Tokenizer.from_gguf(gguf.GGUFReader(str(path)))


def test_unknown_pre_tokenizer(tmp_path):
    path = _write_gguf(tmp_path / "pre.gguf", pre="no-such-pre")
    with pytest.raises(ValueError, match=r"pre\.gguf.*'no-such-pre'"):
        Tokenizer.from_gguf(path)


def test_missing_chat_template(tmp_path):
    tok = Tokenizer.from_gguf(_write_gguf(tmp_path / "tiny.gguf"))
    assert tok.chat_template is None
    assert tok.encode("ab a<s>") == [3, 10, 0]
    # A USER_DEFINED token is matched whole but, unlike a CONTROL one, survives skip_special.
    assert tok.encode("<think>a") == [11, 1]
    assert tok.decode([0, 11, 1], skip_special_tokens=True) == "<think>a"
    assert tok.stop_token_ids == {0} and tok.special_token_ids == {0}
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("pre,expected", [
    # The splits each family's regex makes (llama.cpp llama-vocab.cpp / the models' tokenizer.json).
    ("gpt-2", ["12345", "Ġab", "Ġ", "Ġ'", "s", "Ċ", "Ċ", "x"]),
    ("default", ["12345", "Ġab", "Ġ", "Ġ'", "s", "Ċ", "Ċ", "x"]),
    ("smollm", ["1", "2", "3", "4", "5", "Ġab", "Ġ", "Ġ'", "s", "Ċ", "Ċ", "x"]),
    ("llama-bpe", ["123", "45", "Ġab", "Ġ", "Ġ'", "s", "ĊĊ", "x"]),
    ("qwen2", ["1", "2", "3", "4", "5", "Ġab", "Ġ", "Ġ'", "s", "ĊĊ", "x"]),
])
def test_pre_tokenizer_table(tmp_path, pre, expected):
    tok = Tokenizer.from_gguf(_write_gguf(tmp_path / "t.gguf", pre=pre))
    pieces = [p for p, _ in tok._tok.pre_tokenizer.pre_tokenize_str("12345 ab  's\n\nx")]
    assert pieces == expected
