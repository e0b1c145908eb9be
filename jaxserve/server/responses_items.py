"""A Responses output, built as the text arrives: its items, and the stream events that grow them.

The generated text goes through the reasoning parser (server/reasoning.py, when the server has
one) and the answer through the tool-call parser (server/tool_parser.py, when the request has
tools), as the chat route does. What comes out becomes output items in the order it was
written: a `reasoning` item for the thinking, `message` items for the answer's text and
`function_call` items for the tool calls (text on both sides of a call gives a message item on
each side). Each item is opened (output_item.added, and content_part.added for its text part),
grows (output_text / reasoning_text / function_call_arguments deltas) and is closed (the
matching done events) when the next one starts or the output ends. A whole response is the
same items with the events dropped, so a stream and a whole response always agree.

Whitespace between the thinking and a tool call (or before any call) makes no message of its
own; an output with no item at all still gets one (empty) message, so `output_text` is there.
"""

from __future__ import annotations

import copy
import uuid

from jaxserve.server.reasoning import ReasoningParser
from jaxserve.server.tool_parser import ToolCallParser

WHITESPACE = " \t\r\n"


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    def __init__(self, reasoning: str | None, tool_names: set[str] | None):
        """reasoning: GenerationRequest.reasoning (None: no reasoning parser); tool_names: the
        request's tools (None: its output is not parsed for calls)."""
        self.items: list[dict] = []
        self.reasoning_tokens = 0
        self._held_tokens = 0  # tokens of text the parser holds as either thinking or answer
        self._open: dict | None = None  # the last item while it is being written
        self._thinking = ReasoningParser(reasoning) if reasoning is not None else None
        self._tools = ToolCallParser(tool_names) if tool_names else None
        self._space = ""  # whitespace not yet in a message: it may only precede a tool call
        self._events: list[dict] = []

    def feed(self, text: str, num_tokens: int) -> list[dict]:
        """Takes one step's text (num_tokens tokens); returns the events it makes."""
        if self._thinking is not None:
            was_thinking = self._thinking.in_reasoning
            thought, text = self._thinking.feed(text)
            if self._thinking.state == "either":
                self._held_tokens += num_tokens
            elif was_thinking or thought or self._thinking.in_reasoning or self._held_tokens:
                # the step's tokens, </think> included (the held ones end only at </think>)
                self.reasoning_tokens += num_tokens + self._held_tokens
                self._held_tokens = 0
            self._thought(thought)
        self._answer(text, final=False)
        return self._take()

    def finish(self, incomplete: bool) -> list[dict]:
        """Ends the output (incomplete: cut by the token limit); returns the last events."""
        text = ""
        if self._thinking is not None:
            thought, text = self._thinking.finish()
            self._thought(thought)
        self._answer(text, final=True)
        has_answer = any(item["type"] != "reasoning" for item in self.items)
        if (self._space and not has_answer) or not self.items:
            self._start("message")
            self._text(self._space)
        self._close("incomplete" if incomplete else "completed")
        return self._take()

    def _take(self) -> list[dict]:
        events, self._events = self._events, []
        return events

    def _emit(self, kind: str, **fields) -> None:
        self._events.append({"type": kind, **fields})

    # ---- what the parsers give ----------------------------------------------------------------

    def _thought(self, text: str) -> None:
        if not text:
            return
        if self._open is None or self._open["type"] != "reasoning":
            self._start("reasoning")
        self._open["content"][0]["text"] += text
        self._emit("response.reasoning_text.delta", **self._where(), content_index=0,
                   delta=text)

    def _answer(self, text: str, final: bool) -> None:
        if self._tools is None:
            self._content(text)
            return
        for kind, value in self._tool_pieces(text, final):
            if kind == "content":
                self._content(value)
            elif kind == "call":
                self._space = ""  # the gap before a call is no message
                self._start("function_call", call_id=value["id"],
                            name=value["function"]["name"])
            else:
                self._open["arguments"] += value
                self._emit("response.function_call_arguments.delta", **self._where(),
                           delta=value)

    def _tool_pieces(self, text: str, final: bool) -> list[tuple[str, object]]:
        """The tool parser's output in the order it was written: fed one character at a time
        (one delta can hold text, a call's end and more text), joined back into runs."""
        pieces: list[list] = []

        def add(content: str, calls: list[dict]) -> None:
            if content:
                if pieces and pieces[-1][0] == "content":
                    pieces[-1][1] += content
                else:
                    pieces.append(["content", content])
            for d in calls:
                if "id" in d:
                    pieces.append(["call", d])
                elif pieces and pieces[-1][0] == "arguments":
                    pieces[-1][1] += d["function"]["arguments"]
                else:
                    pieces.append(["arguments", d["function"]["arguments"]])

        for c in text:
            add(*self._tools.feed(c))
        if final:
            add(*self._tools.finish())
        return [(kind, value) for kind, value in pieces]

    def _content(self, text: str) -> None:
        if not text:
            return
        if self._open is None or self._open["type"] != "message":
            if not text.strip(WHITESPACE):
                self._space += text
                return
            text, self._space = self._space + text, ""
            self._start("message")
        self._text(text)

    def _text(self, text: str) -> None:
        if not text:
            return
        self._open["content"][0]["text"] += text
        self._emit("response.output_text.delta", **self._where(), content_index=0, delta=text,
                   logprobs=[])

    # ---- items ------------------------------------------------------------------------------

    def _where(self) -> dict:
        """The open item's place: always the last item (items are written one after another)."""
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def _start(self, kind: str, **fields) -> None:
        self._close("completed")
        if kind == "message":
            item = {"id": _new_id("msg"), "type": "message", "role": "assistant",
                    "status": "in_progress", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        elif kind == "reasoning":
            item = {"id": _new_id("rs"), "type": "reasoning", "summary": [], "content": [],
                    "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {"id": _new_id("fc"), "type": "function_call", "status": "in_progress",
                    "arguments": "", **fields}
            part = None
        self.items.append(item)
        self._open = item
        self._emit("response.output_item.added", output_index=len(self.items) - 1,
                   item=copy.deepcopy(item))
        if part is not None:
            item["content"].append(part)
            self._emit("response.content_part.added", **self._where(), content_index=0,
                       part=copy.deepcopy(part))

    def _close(self, status: str) -> None:
        item, self._open = self._open, None
        if item is None:
            return
        where = self._where()
        item["status"] = status
        if item["type"] == "function_call":
            self._emit("response.function_call_arguments.done", **where,
                       name=item["name"], arguments=item["arguments"])
        else:
            part = item["content"][0]
            done = ("response.output_text.done" if item["type"] == "message" else
                    "response.reasoning_text.done")
            extra = {"logprobs": []} if item["type"] == "message" else {}
            self._emit(done, **where, content_index=0, text=part["text"], **extra)
            self._emit("response.content_part.done", **where, content_index=0,
                       part=copy.deepcopy(part))
        self._emit("response.output_item.done", output_index=where["output_index"],
                   item=copy.deepcopy(item))
