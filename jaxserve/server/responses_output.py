"""Turns a running Generation into a Responses API answer: one Response object, or its typed
event stream (server-sent events with `event:` lines and sequence numbers, no `[DONE]`).

The stream goes response.created, response.in_progress, then each output item's events
(server/responses_items.py), then response.completed, or response.incomplete when the token
limit cut the output (`incomplete_details.reason: max_output_tokens`). An error after the
headers are sent is an `error` event, as OpenAI sends it. `on_done` gets the finished body and
its output items (to store them).
"""

from __future__ import annotations

import copy
import json
import logging
import time
from typing import Callable, Iterator

from jaxserve.server.errors import ApiError
from jaxserve.server.generation import PENDING, ClientGone, Generation
from jaxserve.server.responses_items import OutputItems
from jaxserve.server.responses_request import ResponsesRequest

log = logging.getLogger("jaxserve.server")


def sse_event(event: dict) -> bytes:
    data = json.dumps(event, ensure_ascii=False)
    return f"event: {event['type']}\ndata: {data}\n\n".encode("utf-8")


class ResponseFormatter:
    def __init__(self, gen: Generation, model: str, req: ResponsesRequest,
                 on_done: Callable[[dict, list[dict]], None]):
        self.gen, self.req, self.model, self._on_done = gen, req, model, on_done
        self.id = "resp_" + gen.id
        self.created = int(time.time())
        tools = req.gen.tools
        self._items = OutputItems(req.gen.reasoning, tools.names if tools is not None else None)
        self._seq = 0

    @property
    def _incomplete(self) -> bool:
        return self.gen.choices[0].finish_reason == "length"

    def _usage(self) -> dict:
        prompt, output = self.gen.prompt_tokens, self.gen.completion_tokens
        return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": output,
                "output_tokens_details": {"reasoning_tokens": self._items.reasoning_tokens},
                "total_tokens": prompt + output}

    def _body(self, status: str) -> dict:
        done = status in ("completed", "incomplete")
        e = self.req.echo
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "background": False, "completed_at": int(time.time()) if done else None,
            "error": None,
            "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete"
                                   else None),
            "instructions": e["instructions"], "max_output_tokens": e["max_output_tokens"],
            "model": self.model, "output": copy.deepcopy(self._items.items) if done else [],
            "parallel_tool_calls": e["parallel_tool_calls"],
            "previous_response_id": e["previous_response_id"], "reasoning": e["reasoning"],
            "store": e["store"], "temperature": e["temperature"], "text": e["text"],
            "tool_choice": e["tool_choice"], "tools": e["tools"], "top_p": e["top_p"],
            "truncation": e["truncation"], "usage": self._usage() if done else None,
            "user": e["user"], "metadata": e["metadata"]}

    def _finish(self) -> tuple[dict, list[dict]]:
        events = self._items.finish(self._incomplete)
        body = self._body("incomplete" if self._incomplete else "completed")
        self._on_done(body, self._items.items)
        return body, events

    def full(self) -> dict:
        for d in self.gen.deltas():
            self._items.feed(d.text, len(d.token_ids))
        return self._finish()[0]

    def _sse(self, event: dict) -> bytes:
        event = {**event, "sequence_number": self._seq}
        self._seq += 1
        return sse_event(event)

    def stream(self) -> Iterator[bytes]:
        """The event stream (and PENDING where the generation does not block); closing it
        early aborts what is unfinished."""
        try:
            yield self._sse({"type": "response.created", "response": self._body("in_progress")})
            yield self._sse({"type": "response.in_progress",
                             "response": self._body("in_progress")})
            for d in self.gen.deltas():
                if d is PENDING:  # non-blocking (Generation.wake_with): nothing new yet
                    yield PENDING
                    continue
                for event in self._items.feed(d.text, len(d.token_ids)):
                    yield self._sse(event)
            body, events = self._finish()
            for event in events:
                yield self._sse(event)
            yield self._sse({"type": f"response.{body['status']}", "response": body})
        except ClientGone:
            log.info("client gone: aborting %s", self.id)
        except ApiError as e:  # headers are sent: report inside the stream, as OpenAI does
            yield self._sse({"type": "error", "code": e.code, "message": e.message,
                             "param": e.param})
        finally:
            self.gen.close()
