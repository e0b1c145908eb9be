"""Turns a running Generation into OpenAI responses: one JSON body, or a stream of SSE chunks."""

from __future__ import annotations

import logging
import time
from typing import Iterator

from jaxserve.server import formatting as fmt
from jaxserve.server import reasoning, tool_parser
from jaxserve.server.errors import ApiError
from jaxserve.server.generation import PENDING, ClientGone, Delta, Generation

log = logging.getLogger("jaxserve.server")


class Responder:
    """Formats one request's choices; `chat` picks the chat or the legacy completions shape."""

    def __init__(self, gen: Generation, model: str, decode):
        self.gen, self.req, self.model, self.decode = gen, gen.req, model, decode
        self.chat = self.req.chat
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + gen.id
        self.created = int(time.time())
        tools = self.req.tools if self.chat else None
        self.tool_names = tools.names if tools is not None else None
        self._parsers: dict[int, tool_parser.ToolCallParser] = {}  # stream: per choice
        self._thinking: dict[int, reasoning.ReasoningParser] = {}  # the same, for reasoning

    def _usage(self) -> dict:
        return fmt.usage(self.gen.prompt_tokens, self.gen.completion_tokens)

    def _prompt_text(self, index: int) -> str:
        return self.req.prompt_texts[index // self.req.n]

    @property
    def _echoes_logprobs(self) -> bool:
        return self.req.echo and self.req.top_logprobs is not None and not self.chat

    def _prompt_logprobs(self, index: int) -> tuple[dict, int]:
        """The echoed prompt's logprobs for choice `index`, and its decoded length."""
        ids, entries = self.gen.prompt_logprobs[index // self.req.n]
        return fmt.echoed_prompt_logprobs(self.decode, ids, entries, self.req.top_logprobs)

    def _logprobs(self, token_ids, entries, offset: int = 0) -> dict | None:
        k = self.req.top_logprobs
        if k is None:
            return None
        if self.chat:
            return fmt.chat_logprobs(self.decode, token_ids, entries, k)
        return fmt.completion_logprobs(self.decode, token_ids, entries, k, offset)

    def _body(self, choices: list[dict], usage: dict | None, chunk: bool) -> dict:
        build = fmt.chat_body if self.chat else fmt.completion_body
        return build(self.id, self.created, self.model, choices, usage, chunk)

    # ---- whole response -------------------------------------------------------------------

    def full(self) -> dict:
        choices = []
        for c in self.gen.collect():
            if self.chat:
                message, finish = self._message(c.text, c.finish_reason)
                choices.append({"index": c.index, "finish_reason": finish, "message": message,
                                "logprobs": self._logprobs(c.token_ids, c.logprobs)})
            else:
                prefix = self._prompt_text(c.index) if self.req.echo else ""
                if self._echoes_logprobs:
                    prompt, end = self._prompt_logprobs(c.index)
                    lps = fmt.join_logprobs(prompt, self._logprobs(c.token_ids, c.logprobs, end))
                else:
                    lps = self._logprobs(c.token_ids, c.logprobs)
                choices.append({"index": c.index, "text": prefix + c.text,
                                "finish_reason": c.finish_reason, "logprobs": lps})
        return self._body(choices, self._usage(), chunk=False)

    def _message(self, text: str, finish: str | None) -> tuple[dict, str | None]:
        thinking = {}
        if self.req.reasoning is not None:  # tool calls are read from the answer alone
            reasoning_text, text = reasoning.split(text, self.req.reasoning)
            thinking = {"reasoning_content": reasoning_text}
        calls = []
        if self.tool_names is not None and text:
            content, calls = tool_parser.parse_tool_calls(text, self.tool_names)
        if not calls:
            return {"role": "assistant", "content": text, **thinking}, finish
        return ({"role": "assistant", "content": content, **thinking, "tool_calls": calls},
                "tool_calls" if finish == "stop" else finish)

    # ---- stream ---------------------------------------------------------------------------

    def _first_chunks(self) -> Iterator[bytes]:
        for c in self.gen.choices:
            if self.chat:
                choice = {"index": c.index, "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None}
            elif self.req.echo and not self._echoes_logprobs:  # else with its first tokens
                choice = {"index": c.index, "text": self._prompt_text(c.index),
                          "logprobs": None, "finish_reason": None}
            else:
                continue
            yield fmt.sse(self._body([choice], None, chunk=True))

    def _reasoning_delta(self, d: Delta) -> tuple[str, str]:
        """(reasoning, answer) parts of a delta's text (all answer without a reasoning parser)."""
        if self.req.reasoning is None:
            return "", d.text
        parser = self._thinking.setdefault(d.index, reasoning.ReasoningParser(self.req.reasoning))
        thought, text = parser.feed(d.text)
        if d.finish_reason is not None:
            more_thought, more_text = parser.finish()
            thought, text = thought + more_thought, text + more_text
        return thought, text

    def _tool_delta(self, index: int, text: str, finish: str | None) -> tuple[dict, str | None]:
        """A chat delta with tool calls parsed out of the text: a call's name as soon as it is
        known, then its argument fragments as they are generated."""
        parser = self._parsers.setdefault(index, tool_parser.ToolCallParser(self.tool_names))
        text, calls = parser.feed(text)
        if finish is not None:
            more_text, more_calls = parser.finish()
            text, calls = text + more_text, calls + more_calls
            if parser.num_calls and finish == "stop":
                finish = "tool_calls"
        delta = {"content": text} if text else {}
        if calls:
            delta["tool_calls"] = calls
        return delta, finish

    def _chunk(self, d: Delta, offset: int) -> bytes | None:
        if not d.text and d.finish_reason is None and not d.logprobs:
            return None  # text held back (it may become a stop string): nothing to say yet
        lps = self._logprobs(d.token_ids, d.logprobs, offset) if d.token_ids else None
        if self.chat:
            thought, text = self._reasoning_delta(d)
            if self.tool_names is not None:
                delta, finish = self._tool_delta(d.index, text, d.finish_reason)
            else:
                delta, finish = ({"content": text} if text else {}), d.finish_reason
            if thought:
                delta = {"reasoning_content": thought, **delta}
            if not delta and finish is None and not lps:
                return None
            choice = {"index": d.index, "delta": delta, "logprobs": lps,
                      "finish_reason": finish}
        else:
            choice = {"index": d.index, "text": d.text, "logprobs": lps,
                      "finish_reason": d.finish_reason}
        return fmt.sse(self._body([choice], None, chunk=True))

    def stream(self) -> Iterator[bytes]:
        """SSE chunks ending in `data: [DONE]` (and PENDING where the generation does not
        block); closing it early aborts what is unfinished."""
        try:
            yield from self._first_chunks()
            # Echo with logprobs: the prompt's chunk waits for its logprobs, which come with
            # the choice's first tokens; the completion's offsets go on from its end.
            echo_end = {} if self._echoes_logprobs else None
            for d in self.gen.deltas():
                if d is PENDING:  # non-blocking (Generation.wake_with): nothing new yet
                    yield PENDING
                    continue
                c = self.gen.choices[d.index]
                offset = len(c.text) - len(d.text)
                if echo_end is not None:
                    if d.index not in echo_end:
                        prompt, echo_end[d.index] = self._prompt_logprobs(d.index)
                        yield fmt.sse(self._body([{
                            "index": d.index, "text": self._prompt_text(d.index),
                            "logprobs": prompt, "finish_reason": None}], None, chunk=True))
                    offset += echo_end[d.index]
                chunk = self._chunk(d, offset)
                if chunk is not None:
                    yield chunk
            if self.req.include_usage:
                yield fmt.sse(self._body([], self._usage(), chunk=True))
            yield fmt.sse("[DONE]")
        except ClientGone:
            log.info("client gone: aborting %s", self.id)
        except ApiError as e:  # headers are sent: report inside the stream, as OpenAI does
            yield fmt.sse(e.body())
        finally:
            self.gen.close()
