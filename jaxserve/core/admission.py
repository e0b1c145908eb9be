"""Admission control: how many requests, and how many prompt tokens, may wait for a slot.

Beyond `max_waiting_requests` waiting requests or `max_waiting_tokens` queued prompt tokens
(EngineConfig; None is unbounded) `LLMEngine.add_request` refuses a request with
EngineOverloaded, nothing queued, so that a burst cannot grow the queue (and every client's
wait) without limit. The HTTP server keeps its own bound at submit time (server/engine_loop.py)
and answers 503 with Retry-After. Plain Python: no jax.
"""

from __future__ import annotations


class EngineOverloaded(RuntimeError):
    """The waiting queue is full: retry later (HTTP: 503). Nothing was queued."""

    def __init__(self, message: str, limit: str):
        super().__init__(message)
        self.limit = limit  # the config field that refused it


def check_priority(priority) -> int:
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority must be an integer (lower runs first), got "
                         f"{type(priority).__name__}")
    return priority


def check_admission(config, scheduler, num_compiling: int, prompt_len: int,
                    priority) -> None:
    """Raises EngineOverloaded when one more request (of `prompt_len` prompt tokens) would
    exceed the config's waiting limits; `num_compiling`: requests waiting for a grammar."""
    check_priority(priority)
    max_requests, max_tokens = config.max_waiting_requests, config.max_waiting_tokens
    if max_requests is not None:
        waiting = scheduler.num_waiting + num_compiling
        if waiting + 1 > max_requests:
            raise EngineOverloaded(f"{waiting} requests are waiting (max_waiting_requests="
                                   f"{max_requests}); retry later", "max_waiting_requests")
    if max_tokens is not None:
        queued = sum(seq.num_tokens for seq in scheduler.waiting)
        if queued + prompt_len > max_tokens:
            raise EngineOverloaded(f"{queued} prompt tokens are waiting and this request adds "
                                   f"{prompt_len} (max_waiting_tokens={max_tokens}); retry "
                                   "later", "max_waiting_tokens")
