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
constraint holds from its first token, so no free-form thinking comes before it.

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


def starts_in_reasoning(prompt: str, constrained: bool) -> bool:
    """Whether an output that does not open with `<think>` starts inside thinking."""
    if constrained:
        return False
    return prompt.rfind(CLOSE) <= prompt.rfind(OPEN)  # also when the prompt has neither tag


class ReasoningParser:
    """Splits one output, fed as text deltas, into (reasoning, content) deltas."""

    def __init__(self, in_reasoning: bool):
        self._default = "reasoning" if in_reasoning else "content"
        self.state = "start"      # start -> reasoning -> content, or start -> content
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
            self._held, self.state = "", "content"
            return reasoning, content
        cut = len(self._held) - _partial_tag(self._held, CLOSE)
        reasoning, self._held = self._held[:cut], self._held[cut:]
        return reasoning, ""

    def finish(self) -> tuple[str, str]:
        """Ends the output: what was held goes where the parser stands."""
        held, self._held = self._held, ""
        if self.state == "start":
            self._enter(self._default)
        return (held, "") if self.state == "reasoning" else ("", held)

    def _enter(self, state: str) -> None:
        self.state = state
        self.saw_reasoning = self.saw_reasoning or state == "reasoning"


def split(text: str, in_reasoning: bool) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole output: reasoning None when the output had no thinking,
    content None when nothing follows it (vLLM's shape)."""
    parser = ReasoningParser(in_reasoning)
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
