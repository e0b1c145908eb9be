"""Hermes tool calls out of generated text, with a JSON scanner, whole or as a stream.

A call is `<tool_call>` JSON-object `</tool_call>` whose object names a known tool at its top
level (`"name"`) and holds its arguments (`"arguments"`, or `"parameters"`). The block's
extent comes from the JSON itself: a character-level scanner follows strings (and their
escapes) and nesting, so a `</tool_call>`, a brace or a quote inside a JSON string is part of
the string, never the end of the call. This is also exactly the language the `required` /
named tool-choice grammar produces, so a constrained output always comes back as its calls.

`ToolCallParser.feed(text)` takes text deltas and returns (content delta, tool-call deltas in
the shape of OpenAI's stream: a call's id, type and name first, with empty arguments, then
argument fragments as they are generated); `finish()` ends the output. `parse_tool_calls`
runs the same parser over a whole text and joins the deltas, so a whole response's content is
exactly what a stream of it sends, however the stream is cut. Whitespace just before a call,
or ending an output that has calls, is content of neither. A block that is not a call to a
known tool (another name, not a JSON object) stays in the content as written.
"""

from __future__ import annotations

import json
import uuid

OPEN, CLOSE = "<tool_call>", "</tool_call>"
ARGUMENT_KEYS = ("arguments", "parameters")
WHITESPACE = " \t\r\n"


class _Block:
    """One `<tool_call>` block's body, scanned character by character as it arrives."""

    def __init__(self):
        self.raw = ""          # the body after OPEN, as far as it arrived
        self.phase = "pre"     # pre -> json -> post -> done; "text" when not a JSON object
        self.depth = 0
        self.in_str = self.esc = False
        self.key_next = False  # at depth 1: the next string is a key
        self.key = None        # the depth-1 key whose value is being read
        self.tok_start = -1    # start of the depth-1 key or value being read
        self.literal = False   # that value is a number / true / false / null
        self.name = None       # the call's name, once its string has closed
        self.args = None       # (start, end or None while it grows, is-a-string)
        self.end = -1          # index in raw just after the object (post phase)

    def scan(self, text: str) -> str:
        """Consumes text; returns what follows the block ("" while the block is open)."""
        for i, c in enumerate(text):
            if self.phase == "post":
                tail = (self.raw[self.end:] + c).lstrip(WHITESPACE)
                if not CLOSE.startswith(tail):  # the object is whole; no closing tag follows
                    rest = self.raw[self.end:] + text[i:]
                    self.raw, self.phase = self.raw[:self.end], "done"
                    return rest
                self.raw += c
                if tail == CLOSE:
                    self.phase = "done"
                    return text[i + 1:]
                continue
            pos = len(self.raw)
            self.raw += c
            if self.phase == "text":
                if self.raw.endswith(CLOSE):
                    self.phase = "done"
                    return text[i + 1:]
            elif self.phase == "pre":
                if c == "{":
                    self.phase, self.depth, self.key_next = "json", 1, True
                elif c not in WHITESPACE:
                    self.phase = "text"
            else:
                self._json(c, pos)
        return ""

    def _json(self, c: str, pos: int) -> None:
        if self.in_str:
            if self.esc:
                self.esc = False
            elif c == "\\":
                self.esc = True
            elif c == '"':
                self.in_str = False
                if self.depth == 1:
                    self._token_end(pos + 1, string=True)
            return
        if self.depth == 1 and self.literal and (c in ",}" or c in WHITESPACE):
            self._token_end(pos, string=False)
        if c == '"':
            self.in_str = True
            if self.depth == 1:
                self.tok_start = pos
        elif c in "{[":
            if self.depth == 1 and self.key is not None and self.tok_start < 0:
                self.tok_start = pos
                self._value_start(pos, string=False)
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            if self.depth == 1 and self.key is not None and self.tok_start >= 0:
                self._token_end(pos + 1, string=False)
            elif self.depth == 0:
                self.phase, self.end = "post", pos + 1
        elif self.depth == 1:
            if c == ":":
                self.key_next = False
            elif c == ",":
                self.key_next, self.key = True, None
            elif c not in WHITESPACE and self.key is not None and self.tok_start < 0:
                self.tok_start, self.literal = pos, True
                self._value_start(pos, string=False)

    def _value_start(self, pos: int, string: bool) -> None:
        if self.key in ARGUMENT_KEYS and self.args is None:
            self.args = (pos, None, string)

    def _token_end(self, end: int, string: bool) -> None:
        start, self.tok_start, self.literal = self.tok_start, -1, False
        text = self.raw[start:end]
        if self.key_next:  # a key
            try:
                self.key = json.loads(text)
            except ValueError:
                self.key = None
            return
        if string and self.key == "name" and self.name is None:
            try:
                self.name = json.loads(text)
            except ValueError:
                pass
        if self.key in ARGUMENT_KEYS and (self.args is None or self.args[1] is None):
            self.args = (start, end, string)
        self.key = None

    def args_text(self) -> str:
        """The arguments as far as they arrived (a string value only once it is whole)."""
        if self.args is None:
            return "{}" if self.phase in ("post", "done") else ""
        start, end, string = self.args
        if not string:
            return self.raw[start:end if end is not None else len(self.raw)]
        if end is None:
            return ""
        try:  # "arguments": "<JSON text>": the string's content is the arguments
            return json.loads(self.raw[start:end])
        except ValueError:
            return self.raw[start:end]


class ToolCallParser:
    """Incremental parser of one output: feed text deltas, get content and call deltas.

    Text that may be the start of a `<tool_call>` tag, and whitespace with nothing else
    after it yet, are held until what follows shows what they are: whitespace before a call
    is dropped, before other text sent with it."""

    def __init__(self, names: set[str]):
        self.names = names
        self.buf = ""              # text outside blocks not yet emitted
        self.block: _Block | None = None
        self.num_calls = 0
        self._sent = 0             # characters of the current call's arguments emitted
        self._header = False       # the current call's name delta went out
        self._lead = ""            # whitespace before the open block: dropped if it is a call

    def feed(self, text: str) -> tuple[str, list[dict]]:
        content, deltas = [], []
        while True:
            if self.block is not None:
                text = self.block.scan(text)
                self._emit(deltas)
                if self.block.phase != "done":
                    break
                self._close(content)
            self.buf += text
            text = ""
            start = self.buf.find(OPEN)
            if start < 0:
                # Trailing whitespace (and a partial tag) wait for what follows them.
                cut = len(self.buf[:len(self.buf) - _partial_tag(self.buf)].rstrip(WHITESPACE))
                content.append(self.buf[:cut])
                self.buf = self.buf[cut:]
                break
            before = self.buf[:start]
            cut = len(before.rstrip(WHITESPACE))
            content.append(before[:cut])
            # Whitespace just before a block: dropped if it is a call, else sent with it.
            self._lead = before[cut:]
            text, self.buf = self.buf[start + len(OPEN):], ""
            self.block, self._sent, self._header = _Block(), 0, False
        return "".join(content), deltas

    def finish(self) -> tuple[str, list[dict]]:
        """Ends the output: an unclosed last block is a call if its name arrived."""
        content, deltas = [], []
        if self.block is not None:
            self._emit(deltas)
            self._close(content)
        elif self.buf.strip() or not self.num_calls:
            content.append(self.buf)
        self.buf = ""
        return "".join(content), deltas

    def _known(self) -> bool:
        return self.block.name in self.names if isinstance(self.block.name, str) else False

    def _emit(self, deltas: list[dict]) -> None:
        if not self._known():
            return
        if not self._header:
            self._header, self._lead = True, ""
            deltas.append({"index": self.num_calls, "id": f"call_{uuid.uuid4().hex[:24]}",
                           "type": "function",
                           "function": {"name": self.block.name, "arguments": ""}})
        args = self.block.args_text()
        if len(args) > self._sent:
            deltas.append({"index": self.num_calls,
                           "function": {"arguments": args[self._sent:]}})
            self._sent = len(args)

    def _close(self, content: list[str]) -> None:
        block, self.block = self.block, None
        if self._header:
            self.num_calls += 1
        else:  # not a call: the text as it was written
            content.append(self._lead + OPEN + block.raw)
        self._lead = ""


def parse_tool_calls(text: str, names: set[str]) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a whole output, in OpenAI's message shape: content is what a
    stream of the output sends (None if that is nothing), and the text as it is when there
    are no calls."""
    parser = ToolCallParser(names)
    content, deltas = parser.feed(text)
    more, more_deltas = parser.finish()
    calls = join_deltas(deltas + more_deltas)
    if not calls:
        return text, []
    return content + more or None, calls


def join_deltas(deltas: list[dict]) -> list[dict]:
    """Stream deltas accumulated into whole calls, as a client's accumulator does."""
    calls: dict[int, dict] = {}
    for d in deltas:
        call = calls.get(d["index"])
        if call is None:
            calls[d["index"]] = {"id": d["id"], "type": d["type"],
                                 "function": dict(d["function"])}
        else:
            call["function"]["arguments"] += d["function"]["arguments"]
    return [calls[i] for i in sorted(calls)]


def _partial_tag(text: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of OPEN."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0
