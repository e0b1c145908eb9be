"""One HTTP request's generation: one engine request per prompt (its n branches share the
prompt's KV blocks), its completions spread over the response's choices.

Runs in the handler thread. It submits the sub-requests to the engine loop, turns the engine's
events into per-choice deltas, records latency metrics, and aborts whatever is unfinished when
it is closed (the client went away, or an error) so KV blocks go back to the pool.

Waiting for events blocks the calling thread (a WSGI worker that owns the request) unless
`wake_with` switched it to non-blocking: then `deltas()` yields `PENDING` when nothing is
queued, and the given callback is called from the engine's thread whenever an event arrives,
so an event loop can drive thousands of streams without a thread each (server/asgi.py).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import time
import uuid
from typing import Callable, Iterator

from jaxserve.core.lora import LoRARequest
from jaxserve.core.sampling_params import RequestOutputKind
from jaxserve.server.backend import Accepted, Backend
from jaxserve.server.engine_loop import Event, SubRequest
from jaxserve.server.errors import ApiError, unavailable
from jaxserve.server.formatting import Choice
from jaxserve.server.metrics import ServerMetrics
from jaxserve.server.protocol import GenerationRequest

log = logging.getLogger("jaxserve.server")
# What a non-blocking deltas() (and the streams built on it) yields when no event is queued.
PENDING = object()


class ClientGone(Exception):
    """The client disconnected while we waited for tokens."""


@dataclasses.dataclass(frozen=True)
class Delta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]]
    finish_reason: str | None


def _sub_requests(req: GenerationRequest, base: str,
                  lora_request: LoRARequest | None) -> list[SubRequest]:
    """One per prompt, with n branches: choice p * n + i is branch i of prompt p.

    DELTA outputs: each step hands over only what is new (streamed or not, every step's tokens
    are timed), not a copy of everything generated so far, which grows with the output."""
    params = dataclasses.replace(req.params, n=req.n, output_kind=RequestOutputKind.DELTA)
    return [SubRequest(f"{base}-{p}", ids, params, p * req.n, priority=req.priority,
                       lora_request=lora_request)
            for p, ids in enumerate(req.prompts)]


class _Events:
    """The group's event queue (the engine loop's `out`): after each put it calls `wake`, once
    one is set, on the putting thread (the engine's, or a replica pool's pump)."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.wake: Callable[[], None] | None = None

    def put(self, item) -> None:
        self._queue.put(item)
        wake = self.wake
        if wake is not None:
            try:
                wake()
            except Exception:  # noqa: BLE001 - a waiter's failure must not end the engine thread
                log.exception("waking a stream failed")

    def get(self, timeout: float):
        return self._queue.get(timeout=timeout)

    def get_nowait(self):
        return self._queue.get_nowait()


class Generation:
    def __init__(self, loop: Backend, metrics: ServerMetrics, req: GenerationRequest,
                 capacity: int, poll_s: float, disconnected: Callable[[], bool],
                 max_queued_tokens: int | None = None,
                 lora_request: LoRARequest | None = None):
        self.t0 = time.monotonic()
        self.req, self._loop, self._metrics = req, loop, metrics
        self._poll_s, self._disconnected = poll_s, disconnected
        self.id = uuid.uuid4().hex
        self.replica: str | None = None  # the engine replica serving it, once accepted
        self._subs = _sub_requests(req, self.id, lora_request)
        self.choices = [Choice(i) for i in range(len(req.prompts) * req.n)]
        self._last_token_time: dict[int, float] = {}
        self._open = set(range(len(self.choices)))
        # prompt index -> (its ids, its prompt logprobs), once the engine has scored it
        # (completions with echo and logprobs).
        self.prompt_logprobs: dict[int, tuple[list[int], list]] = {}
        # Raises 503 before anything is queued.
        self._events = _Events()
        self._blocking = True
        loop.submit(self._subs, capacity, max_queued_tokens, out=self._events)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.req.prompts)

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    def wake_with(self, wake: Callable[[], None]) -> None:
        """Non-blocking from now on: deltas() yields PENDING instead of waiting for an event,
        and `wake()` is called (from another thread; it must be thread-safe and quick) after
        each event is queued. An event queued before this call is there at the next poll."""
        self._blocking = False
        self._events.wake = wake

    def _next(self) -> Event | Accepted:
        if not self._blocking:
            try:
                return self._events.get_nowait()
            except queue.Empty:
                if not self._loop.alive:  # a dead loop may never queue the error event
                    raise unavailable("the engine is not running", "engine_unavailable") \
                        from None
                return PENDING
        while True:
            try:
                return self._events.get(timeout=self._poll_s)
            except queue.Empty:
                if self._disconnected():
                    raise ClientGone() from None
                if not self._loop.alive:
                    raise unavailable("the engine is not running", "engine_unavailable") \
                        from None

    def wait_accepted(self) -> None:
        """Returns once the engine queued every sub-request; raises the engine's refusal."""
        item = self._next()
        if isinstance(item, Event):
            self._open.clear()  # the loop already took back whatever it had queued
            raise item.error
        assert isinstance(item, Accepted), item
        self.replica = item.replica

    def deltas(self) -> Iterator[Delta]:
        """Yields what each choice gained, as the engine produces it, until all finish (and
        PENDING when non-blocking and nothing is queued)."""
        while self._open:
            event = self._next()
            if event is PENDING:
                yield PENDING
                continue
            if event.error is not None:
                self._open.clear()  # the engine loop dropped them all
                raise event.error
            yield from self._apply(event)

    def collect(self) -> list[Choice]:
        assert self._blocking, "collect() waits for the whole output: blocking mode only"
        for _ in self.deltas():
            pass
        return self.choices

    def _apply(self, event: Event) -> list[Delta]:
        out = event.output
        if out.prompt_logprobs is not None:
            self.prompt_logprobs.setdefault(event.index // self.req.n,
                                            (out.prompt_token_ids, out.prompt_logprobs))
        return [self._apply_one(event, event.index + out.index, out)
                for out in event.output.outputs if event.index + out.index in self._open]

    def _apply_one(self, event: Event, index: int, out) -> Delta:
        choice = self.choices[index]
        new_ids = out.token_ids  # DELTA outputs (_sub_requests): this step's part alone
        new_lps = list(out.logprobs) if out.logprobs is not None else []
        choice.token_ids.extend(new_ids)
        choice.logprobs.extend(new_lps)
        choice.text += out.delta_text
        if new_ids:
            self._observe_token(index, event.time, len(new_ids))
        if out.finish_reason is not None:
            choice.finish_reason = out.finish_reason
            self._open.discard(index)
            self._observe_finish(event, choice)
        return Delta(index, out.delta_text, new_ids, new_lps, choice.finish_reason)

    def _observe_token(self, index: int, now: float, count: int) -> None:
        last = self._last_token_time.get(index)
        if last is None:
            self._metrics.ttft.observe(now - self.t0)
        else:
            for _ in range(count):
                self._metrics.itl.observe((now - last) / count)
        self._last_token_time[index] = now

    def _observe_finish(self, event: Event, choice: Choice) -> None:
        m = self._metrics
        m.e2e.observe(event.time - self.t0)
        m.prompt_tokens.inc(len(event.output.prompt_token_ids))
        m.generation_tokens.inc(len(choice.token_ids))
        m.requests.labels(finish_reason=choice.finish_reason or "none").inc()

    def close(self) -> None:
        """Aborts unfinished sub-requests (their KV blocks return to the pool)."""
        if self._open:
            n = self.req.n
            self._loop.abort([s.request_id for s in self._subs
                              if self._open & set(range(s.index, s.index + n))])
            self._open.clear()


__all__ = ["ApiError", "ClientGone", "Delta", "Generation", "PENDING"]
