"""Tokenizer: byte-level BPE from a GGUF file or an HF tokenizer.json, chat templates, and
incremental detokenization for streaming.

A GGUF carries no tokenizer.json, only llama.cpp's metadata (vocab, merges, token types and the
name of a pre-tokenizer), so we rebuild the `tokenizers` pipeline llama.cpp would run for it.
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import pathlib
from typing import Iterable, Sequence

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

# llama.cpp's token types (gguf.TokenType); only these two must be matched whole in text.
_CONTROL, _USER_DEFINED = 3, 4

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
                 r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                 r"|\s+(?!\S)|\s+")
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")

# tokenizer.ggml.pre -> the regexes llama.cpp (llama-vocab.cpp) splits with, applied in order.
# "default" is mapped to GPT-2's regex, as HF does; llama.cpp's legacy default set is a heuristic
# no released vocabulary was trained with.
_PRE_SPLITS = {
    **dict.fromkeys(("default", "gpt-2", "gpt2", "mpt", "olmo", "jais", "trillion"),
                    [_GPT2_SPLIT]),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone",
                     "minerva-7b"), [r"\p{N}", _GPT2_SPLIT]),
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "falcon3", "falcon-h1", "pixtral",
                     "dbrx", "smaug-bpe"), [_LLAMA3_SPLIT]),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"), [_QWEN2_SPLIT]),
}
# llama.cpp takes a word whole when it is in the vocab before merging, for the Llama 3 family
# only (its tokenizer.json sets ignore_merges); other vocabularies can differ on rare words.
_IGNORE_MERGES = {"llama-bpe", "llama3", "llama-v3", "falcon3", "falcon-h1", "pixtral", "dbrx",
                  "smaug-bpe"}

# A serving engine must stop on end-of-turn markers too: chat models end a reply with these
# rather than with the vocabulary's eos.
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|endoftext|>",
                "<|end|>", "<end_of_turn>")


def _gguf_fields(source) -> tuple[dict, str]:
    """The tokenizer.* metadata of a GGUF, and the file's name for error messages."""
    import gguf
    # Parsing a GGUF's header takes seconds; a caller that already has a reader can share it.
    if isinstance(source, gguf.GGUFReader):
        reader, path = source, str(getattr(source.data, "filename", "<gguf>"))
    else:
        reader, path = gguf.GGUFReader(str(source)), str(source)
    return {name: field.contents() for name, field in reader.fields.items()
            if name.startswith("tokenizer.")}, path


def _byte_level_pre_tokenizer(pre: str, path) -> pre_tokenizers.PreTokenizer:
    splits = _PRE_SPLITS.get(pre)
    if splits is None:
        raise ValueError(f"{path}: unsupported pre-tokenizer tokenizer.ggml.pre={pre!r} "
                         f"(supported: {sorted(_PRE_SPLITS)})")
    steps = [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
    # The regexes already split words; ByteLevel only maps bytes to its printable alphabet.
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(steps)


def _compile_template(source: str) -> jinja2.Template:
    """Compiles a chat template the way HF transformers does, so renders match it."""
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson HTML-escapes; HF templates expect plain JSON.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


# Appended to the last message's content for continue_final_message: where it shows in the
# rendered text, that message's content ends (HF transformers' way, so both cut alike).
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _tag_final_message(messages: list[dict], template: str) -> tuple[list[dict], str]:
    """A copy of `messages` whose last content ends in _CONTINUE_TAG, and that content."""
    if not messages:
        raise ValueError("continue_final_message is set but the conversation is empty!")
    final = messages[-1].get("content")
    if final is None:
        raise ValueError('continue_final_message is set but the final message has no '
                         '"content" to continue!')
    if "content" not in template:
        raise ValueError('continue_final_message is set to "content" but this is not an '
                         'accepted field in the chat_template')
    last = dict(messages[-1])
    if isinstance(final, (list, tuple)):  # content parts: the last text part is continued
        parts = [dict(p) for p in final]
        texts = [p for p in parts if "text" in p]
        if not texts:
            raise ValueError("continue_final_message is set but we could not find any text "
                             "to continue in the final message!")
        final = texts[-1]["text"]
        texts[-1]["text"] = final + _CONTINUE_TAG
        last["content"] = parts
    else:
        last["content"] = final + _CONTINUE_TAG
    return [*messages[:-1], last], final


def _cut_at_tag(text: str, final: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ValueError(
            "continue_final_message is set but the final message does not appear in the chat "
            "after applying the chat template! This can happen if the chat template deletes "
            "portions of the final message. Please verify the chat template and final message "
            f"in your chat to ensure they are compatible.Final message to continue: "
            f"{final.strip()}\nRendered chat:\n{text}")
    at = text.rindex(tag)
    # A template that keeps the content's spacing keeps the tag's space too; one that trims
    # the content trimmed whatever followed the continued text.
    return text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else \
        text[:at].rstrip()


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template and stop tokens."""

    def __init__(self, tok: HFTokenizer, *, vocab_size: int, bos_token_id: int | None,
                 eos_token_id: int | None, pad_token_id: int | None = None,
                 add_bos: bool = False, chat_template: str | None = None,
                 special_token_ids: Iterable[int] = (), source: str = "<memory>"):
        self._tok = tok
        self.vocab_size = vocab_size
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.special_token_ids = set(special_token_ids)
        self.source = source
        self._template = None  # compiled on first use, then reused
        stops = {eos_token_id} if eos_token_id is not None else set()
        for text in _END_OF_TURN:
            tid = tok.token_to_id(text)
            if tid is not None and tid in self.special_token_ids:
                stops.add(tid)
        self.stop_token_ids = frozenset(stops)

    # -- construction -----------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, source) -> "Tokenizer":
        """From a .gguf path or an open gguf.GGUFReader."""
        meta, path = _gguf_fields(source)
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"{path}: unsupported tokenizer model tokenizer.ggml.model={kind!r}; "
                             "only 'gpt2' (byte-level BPE) is supported")
        tokens = list(meta["tokenizer.ggml.tokens"])
        types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
        # Older files predate the key; llama.cpp reads that as its default pre-tokenizer.
        pre = meta.get("tokenizer.ggml.pre", "default")
        vocab = {}
        for i, t in enumerate(tokens):
            vocab.setdefault(t, i)  # a duplicated string keeps its first id, like llama.cpp
        bpe = models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in _IGNORE_MERGES)
        tok = HFTokenizer(bpe)
        tok.pre_tokenizer = _byte_level_pre_tokenizer(pre, path)
        tok.decoder = decoders.ByteLevel()
        control = [i for i, ty in enumerate(types) if ty == _CONTROL]
        user = [i for i, ty in enumerate(types) if ty == _USER_DEFINED]
        # Control tokens are special (skipped by skip_special_tokens); user-defined ones such as
        # <think> are plain added tokens: matched whole but kept in decoded text, as in HF.
        tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i in control])
        tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user])

        def token_id(key):
            v = meta.get(f"tokenizer.ggml.{key}")
            return int(v) if v is not None else None

        return cls(tok, vocab_size=len(tokens), bos_token_id=token_id("bos_token_id"),
                   eos_token_id=token_id("eos_token_id"), pad_token_id=token_id("padding_token_id"),
                   add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
                   chat_template=meta.get("tokenizer.chat_template"),
                   special_token_ids=control, source=path)

    @classmethod
    def from_hf_dir(cls, directory: str | os.PathLike) -> "Tokenizer":
        d = pathlib.Path(directory)
        tok = HFTokenizer.from_file(str(d / "tokenizer.json"))
        cfg_path = d / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            template = {t["name"]: t["template"] for t in template}.get("default")
        # Newer transformers save the template beside the config instead of inside it.
        if template is None and (d / "chat_template.jinja").exists():
            template = (d / "chat_template.jinja").read_text()

        def token_id(key):
            v = cfg.get(key)
            v = v.get("content") if isinstance(v, dict) else v
            return tok.token_to_id(v) if v is not None else None

        added = tok.get_added_tokens_decoder()
        special = [i for i, t in added.items() if t.special]
        bos = token_id("bos_token")
        add_bos = cfg.get("add_bos_token")
        if add_bos is None:
            # Llama-3-style files add BOS in the post-processor without saying so in the config.
            add_bos = bos is not None and tok.encode("", add_special_tokens=True).ids[:1] == [bos]
        return cls(tok, vocab_size=tok.get_vocab_size(with_added_tokens=True), bos_token_id=bos,
                   eos_token_id=token_id("eos_token"), pad_token_id=token_id("pad_token"),
                   add_bos=bool(add_bos), chat_template=template, special_token_ids=special,
                   source=str(d))

    def save(self, directory: str | os.PathLike) -> None:
        """Writes tokenizer.json + tokenizer_config.json that `from_hf_dir` (and HF) read back."""
        d = pathlib.Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(d / "tokenizer.json"))
        cfg = {"add_bos_token": self.add_bos, "chat_template": self.chat_template,
               "bos_token": self._token_text(self.bos_token_id),
               "eos_token": self._token_text(self.eos_token_id),
               "pad_token": self._token_text(self.pad_token_id)}
        (d / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False))

    # -- text <-> ids -----------------------------------------------------------------------

    def to_json(self) -> str:
        """The tokenizer as HF `tokenizer.json` text (what a grammar engine builds its trie from)."""
        return self._tok.to_str()

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without BOS or any other special token added."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def _token_text(self, token_id: int | None) -> str | None:
        return self._tok.id_to_token(token_id) if token_id is not None else None

    def with_chat_template(self, chat_template: str) -> "Tokenizer":
        """A copy of this tokenizer using another template (e.g. one given on the command line)."""
        other = copy.copy(self)
        other.chat_template, other._template = chat_template, None
        return other

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, **extra) -> str:
        """Renders `messages` into the prompt text the model was trained on.

        `continue_final_message` (HF's): the text ends inside the last message, after its
        content, so the model continues that message (a prefilled reply) instead of starting
        a new one; it cannot be combined with `add_generation_prompt`.
        """
        if not self.chat_template:
            raise ValueError(f"{self.source}: the tokenizer has no chat template; "
                             "pass a raw prompt instead")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both "
                             "be set")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        variables = dict(tools=None, documents=None, bos_token=self._token_text(self.bos_token_id),
                         eos_token=self._token_text(self.eos_token_id),
                         pad_token=self._token_text(self.pad_token_id))
        variables.update(extra)
        final = None
        if continue_final_message:
            messages, final = _tag_final_message(messages, self.chat_template)
        text = self._template.render(messages=messages,
                                     add_generation_prompt=add_generation_prompt, **variables)
        return _cut_at_tag(text, final) if continue_final_message else text


class IncrementalDetokenizer:
    """Turns a stream of generated ids into text deltas.

    Decodes only the window ids[prefix_offset:] (vLLM's scheme): ids[prefix_offset:read_offset]
    decode to text already emitted, so each step costs a few tokens' decode, not the sequence's.
    A character split across tokens shows up as a trailing U+FFFD; that tail is held back until
    the bytes complete, while the text before it is emitted at once (`emitted` counts it).
    """

    # The window only grows over a run of tokens that each end mid-character. Text does not make
    # runs this long (invalid bytes followed by text end one), so past it the tail is emitted as
    # the U+FFFD a full decode shows now, which keeps the per-token cost bounded.
    _MAX_PENDING = 64

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # A few prompt tokens of context, for tokenizers whose decode depends on the neighbour.
        self.ids = [int(i) for i in list(prompt_ids)[-4:]]
        self.num_prompt = len(self.ids)
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.emitted = 0  # chars of the window past decode(ids[prefix_offset:read_offset]) sent

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _delta(self, force: bool) -> str:
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.ids[self.prefix_offset:])
        complete = (force or not text.endswith("\ufffd")
                    or len(self.ids) - self.read_offset >= self._MAX_PENDING)
        stable = text if complete else text.rstrip("\ufffd")
        delta = stable[len(prefix_text) + self.emitted:]
        if complete:
            # The window ends on a character boundary: later windows can start from here.
            self.prefix_offset, self.read_offset, self.emitted = (
                self.read_offset, len(self.ids), 0)
        else:
            self.emitted += len(delta)
        return delta

    def add(self, token_id: int) -> str:
        """Appends one generated id; returns the text it completes (possibly "")."""
        self.ids.append(int(token_id))
        return self._delta(force=False)

    def flush(self) -> str:
        """Emits whatever is held back (an incomplete character) at the end of generation."""
        return self._delta(force=True) if len(self.ids) > self.read_offset else ""

    @property
    def generated_ids(self) -> list[int]:
        return self.ids[self.num_prompt:]
