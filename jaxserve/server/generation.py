"""One HTTP request's generation: one engine request per prompt (its n branches share the
prompt's KV blocks), its completions spread over the response's choices.

Runs in the handler thread. It submits the sub-requests to the engine loop, turns the engine's
events into per-choice deltas, records latency metrics, and aborts whatever is unfinished when
it is closed (the client went away, or an error) so KV blocks go back to the pool.
"""

from __future__ import annotations

import dataclasses
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
        self._queue = loop.submit(self._subs, capacity, max_queued_tokens)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.req.prompts)

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    def _next(self) -> Event | Accepted:
        while True:
            try:
                return self._queue.get(timeout=self._poll_s)
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
        """Yields what each choice gained, as the engine produces it, until all finish."""
        while self._open:
            event = self._next()
            if event.error is not None:
                self._open.clear()  # the engine loop dropped them all
                raise event.error
            yield from self._apply(event)

    def collect(self) -> list[Choice]:
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


__all__ = ["ApiError", "ClientGone", "Delta", "Generation"]
