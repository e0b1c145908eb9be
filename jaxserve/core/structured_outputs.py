"""What a constrained request asks for: a JSON schema, a regex, a choice or a grammar.

`StructuredOutputs` is vLLM's shape (`SamplingParams(structured_outputs=StructuredOutputs(
json=...))`): exactly one of `json`, `json_object`, `regex`, `choice`, `grammar`. It is plain
data, checked here for its form; whether the schema, regex or grammar compiles is decided by
the grammar engine (core/grammar.py), off the engine thread. `grammar_text` turns it into the
grammar engine's (llguidance's) input, and `key` names it for the compile cache.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from jaxserve.core.sampling_params import SamplingParamError

MAX_SPEC_CHARS = 1 << 20  # a schema / grammar longer than this is refused before compiling
MAX_CHOICES = 1024
# JSON as models write it (", " and ": "), without free whitespace: free whitespace lets a
# model at temperature > 0 pad an object with newlines until max_tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclasses.dataclass(frozen=True, kw_only=True)
class StructuredOutputs:
    """Constrain the output to one of:

    json: a JSON schema (a dict, or its JSON text); the output is a JSON value valid under it.
    json_object: True for any JSON object (OpenAI's `response_format: json_object`).
    regex: a regular expression the whole output matches (Rust `regex` syntax).
    choice: a list of strings; the output is exactly one of them.
    grammar: a Lark grammar (llguidance's dialect, `start:` rule), or GBNF (`root ::= ...`).
    """

    json: Any = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self):
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise _error(f"give exactly one of {', '.join(KINDS)}; got "
                         f"{', '.join(given) or 'none'}")
        if self.json is not None:
            object.__setattr__(self, "json", _schema_text(self.json))
        if not isinstance(self.json_object, bool):
            raise _error(f"json_object must be a bool, got {self.json_object!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()
                                      or len(value) > MAX_SPEC_CHARS):
                raise _error(f"{name} must be a non-empty string of at most {MAX_SPEC_CHARS} "
                             f"characters, got {_short(value)}")
        if self.choice is not None:
            object.__setattr__(self, "choice", _choices(self.choice))

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """(kind, canonical text): equal for specs that compile to the same grammar."""
        kind = self.kind
        if kind == "choice":
            return kind, json.dumps(self.choice)
        return kind, "" if kind == "json_object" else getattr(self, kind)

    def grammar_text(self) -> str:
        """The llguidance grammar (JSON text) for this spec; raises ValueError on a malformed
        schema document. Whether it compiles is checked by the grammar engine."""
        from llguidance import LLMatcher  # the grammar engine, imported only when used
        kind = self.kind
        if kind in ("json", "json_object"):
            schema = self.json if kind == "json" else '{"type": "object"}'
            return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if kind == "regex":
            return LLMatcher.grammar_from_regex(self.regex)
        if kind == "choice":  # Lark string literals are JSON strings: no regex escaping
            return LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in self.choice))
        text = self.grammar
        if "::=" in text and "start:" not in text:  # GBNF (llama.cpp, xgrammar's EBNF)
            from llguidance.gbnf_to_lark import gbnf_to_lark
            text = gbnf_to_lark(text)
        return LLMatcher.grammar_from_lark(text)


def _schema_text(schema) -> str:
    if isinstance(schema, str):
        if len(schema) > MAX_SPEC_CHARS:
            raise _error(f"json schema longer than {MAX_SPEC_CHARS} characters")
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise _error(f"json schema is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise _error(f"json schema must be an object (or true/false), got "
                     f"{type(schema).__name__}")
    try:
        text = json.dumps(_canonical(schema), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise _error(f"json schema is not JSON-serialisable: {e}") from None
    if len(text) > MAX_SPEC_CHARS:
        raise _error(f"json schema longer than {MAX_SPEC_CHARS} characters")
    return text


def _canonical(node):
    """The schema with its keys sorted, so equal schemas share a compile, except inside
    `properties`: the grammar engine writes properties in the order the schema lists them,
    as OpenAI's strict mode does, so that order is part of what the schema asks for."""
    if isinstance(node, list):
        return [_canonical(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key in sorted(node, key=str):
        value = node[key]
        if key == "properties" and isinstance(value, dict):
            out[key] = {k: _canonical(v) for k, v in value.items()}
        else:
            out[key] = _canonical(value)
    return out


def _choices(choice) -> tuple[str, ...]:
    if isinstance(choice, str) or not hasattr(choice, "__iter__"):
        raise _error(f"choice must be a list of strings, got {_short(choice)}")
    out = tuple(choice)
    if not out or len(out) > MAX_CHOICES:
        raise _error(f"choice must hold 1 to {MAX_CHOICES} strings, got {len(out)}")
    for c in out:
        if not isinstance(c, str) or not c:
            raise _error(f"choice entries must be non-empty strings, got {_short(c)}")
    return out


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _error(message: str) -> SamplingParamError:
    return SamplingParamError("structured_outputs", message)
