"""Reasoning output (`--reasoning-parser`): the thinking of a `<think>...</think>` model (Qwen3,
DeepSeek-R1) apart from its answer, as vLLM's `qwen3` and `deepseek_r1` parsers split it.

Everything before `</think>` is reasoning and everything after it is the answer (the content);
an output that opens with `<think>` (after whitespace) drops the tag. An output that does not
open with it starts where the prompt left off: inside thinking unless the prompt's last think
tag is `</think>` (a template that closed thinking for the model, as Qwen3's does with
`enable_thinking=False`), because the Qwen3.5 / Qwen3-Thinking / DeepSeek-R1 templates write
`<think>` into the prompt and the model begins with its thoughts. An output that ends before
`</think>` (cut by max_tokens) is all reasoning, with no content. A constrained output
(a grammar, a schema, a forced tool call) is content unless it opens with `<think>`: the
constraint holds from its first token, so no free-form thinking comes before it. One
exception: a regex, choice or grammar after a prompt that opened thinking may spell the
thinking out itself (`[^<]*</think>\n\n(yes|no)`), so such an output is reasoning up to its
`</think>` if it writes one and all content if it does not; the parser holds its text until
it knows which (a stream of it gives nothing before `</think>` or the end).

The parser works on text, not token ids, so a tag split across tokens or deltas is found all
the same: text that may be the start of `</think>` (or of the opening `<think>`) is held back
until what follows shows what it is. `split` runs the same parser over a whole text, so a
stream and a whole response always agree.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"
WHITESPACE = " \t\r\n"
# vLLM's names for the <think>...</think> format; every one reads the text the same way here.
PARSER_NAMES = ("qwen3", "deepseek_r1")
CHOICES = ("none",) + PARSER_NAMES


def check_parser_name(name) -> None:
    if name not in CHOICES:
        raise ValueError(f"reasoning_parser must be one of {', '.join(CHOICES)}, got {name!r}")


def output_start(prompt: str, constraint: str | None) -> str:
    """Where an output that does not open with `<think>` starts: "reasoning", "content", or
    "either" (reasoning if it writes `</think>`, else all content).

    constraint: None (free text), "json" (a schema, a JSON object or forced tool calls: always
    the answer) or "text" (a regex, choice or grammar, which may write the thinking out)."""
    if constraint is None:  # inside thinking also when the prompt has neither tag
        return "reasoning" if prompt.rfind(CLOSE) <= prompt.rfind(OPEN) else "content"
    opened = prompt.rfind(OPEN) > prompt.rfind(CLOSE)  # the prompt's last tag is <think>
    return "either" if constraint == "text" and opened else "content"


class ReasoningParser:
    """Splits one output, fed as text deltas, into (reasoning, content) deltas."""

    def __init__(self, start: str):
        """start: output_start's answer for the output's prompt."""
        if start not in ("reasoning", "content", "either"):
            raise ValueError(f"start must be reasoning, content or either, got {start!r}")
        self._default = start
        # start -> reasoning -> content, start -> content, or start -> either -> content
        self.state = "start"
        self.saw_reasoning = False
        self._held = ""           # text not yet given out: a possible tag, or leading space

    @property
    def in_reasoning(self) -> bool:
        return self.state == "reasoning"

    def feed(self, text: str) -> tuple[str, str]:
        self._held += text
        if self.state == "start":
            lead = self._held.lstrip(WHITESPACE)
            if lead.startswith(OPEN):
                self._enter("reasoning")
                self._held = lead[len(OPEN):]
            elif OPEN.startswith(lead):
                return "", ""  # whitespace, or a prefix of <think>: wait for more
            else:
                self._enter(self._default)
        if self.state == "content":
            content, self._held = self._held, ""
            return "", content
        end = self._held.find(CLOSE)
        if end >= 0:
            reasoning, content = self._held[:end], self._held[end + len(CLOSE):]
            # (from "either": what came before </think> was thinking after all)
            self._held, self.state, self.saw_reasoning = "", "content", True
            return reasoning, content
        if self.state == "either":
            return "", ""  # all held until </think> or the end shows what it is
        cut = len(self._held) - _partial_tag(self._held, CLOSE)
        reasoning, self._held = self._held[:cut], self._held[cut:]
        return reasoning, ""

    def finish(self) -> tuple[str, str]:
        """Ends the output: what was held goes where the parser stands."""
        held, self._held = self._held, ""
        if self.state == "start":
            self._enter(self._default)
        return (held, "") if self.state == "reasoning" else ("", held)  # either: no </think>

    def _enter(self, state: str) -> None:
        self.state = state
        self.saw_reasoning = self.saw_reasoning or state == "reasoning"


def split(text: str, start: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole output: reasoning None when the output had no thinking,
    content None when nothing follows it (vLLM's shape)."""
    parser = ReasoningParser(start)
    reasoning, content = parser.feed(text)
    more_reasoning, more_content = parser.finish()
    reasoning, content = reasoning + more_reasoning, content + more_content
    return (reasoning if parser.saw_reasoning else None), (content or None)


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
