"""One engine replica: an LLMEngine and its EngineLoop inside a Ray Serve replica actor.

The replica speaks the engine loop's protocol (sub-requests in; `Accepted`, then `Event`s out)
over Ray, multiplexed: `submit` queues a group under a key the caller chose, and one long-lived
stream, `events`, carries every group's items as `(key, item)` pairs, in batches of whatever
the engine thread produced since the last yield. So a step costs one Ray message per replica,
not one per running request. What crosses the process boundary is the engine's own
dataclasses; errors travel as their JSON body and status (`wire_error` / `api_error`), never as
exception objects. Ray Serve calls `check_health` periodically and replaces a replica whose
engine thread died.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pathlib
import tempfile
import threading

from jaxserve.server.engine_loop import EngineLoop, Event, SubRequest
from jaxserve.server.errors import ApiError

log = logging.getLogger("jaxserve.distributed")


def wire_error(err: ApiError) -> dict:
    return {"status": err.status, **err.body()["error"], "headers": dict(err.headers)}


def api_error(wire: dict) -> ApiError:
    return ApiError(wire["status"], wire["message"], type=wire["type"], param=wire["param"],
                    code=wire["code"], headers=wire["headers"])


def to_wire(item):
    """An engine-loop queue item as sent over Ray (errors as plain dicts)."""
    if isinstance(item, Event) and item.error is not None:
        err = item.error if isinstance(item.error, ApiError) else \
            ApiError(500, f"the request failed: {item.error}", type="server_error")
        return Event(item.index, None, item.time, error=wire_error(err))
    return item


class _Outbox:
    """Items of every group, in order, from the engine thread to the `events` stream."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[str, object]] = []
        self._ready = asyncio.Event()
        self._reader = 0  # the id of the stream that reads; an older one stops

    def sink(self, key: str) -> "_Sink":
        return _Sink(self, key)

    def put(self, key: str, item) -> None:  # any thread
        with self._lock:
            first = not self._items
            self._items.append((key, item))
        if first:
            self._loop.call_soon_threadsafe(self._ready.set)

    def attach(self) -> int:
        """A new reader (the pool reconnected): the one before it stops at its next wait."""
        self._reader += 1
        self._ready.set()
        return self._reader

    async def take(self, reader: int) -> list[tuple[str, object]] | None:
        """Everything queued, once there is something; None once `reader` is not the current
        reader (the replica's event loop only)."""
        while True:
            await self._ready.wait()
            if reader != self._reader:
                return None
            self._ready.clear()
            with self._lock:
                items, self._items = self._items, []
            if items:
                return items


class _Sink:
    """What the engine loop puts a group's items on (anything with `put`)."""

    def __init__(self, outbox: _Outbox, key: str):
        self._outbox, self._key = outbox, key

    def put(self, item) -> None:
        self._outbox.put(self._key, item)


def _unnice() -> None:
    """Ray starts worker processes at niceness 15 so that its own daemons stay responsive; an
    engine replica is the workload itself, and at 15 every Ray daemon and the HTTP process
    preempt its steps (tokens ~10% slower on 2 CPUs). Back to 0 where the OS allows it."""
    try:
        if os.getpriority(os.PRIO_PROCESS, 0) > 0:
            os.setpriority(os.PRIO_PROCESS, 0, 0)
    except OSError as e:  # lowering niceness needs CAP_SYS_NICE
        log.info("replica keeps Ray's niceness %d (%s)", os.getpriority(os.PRIO_PROCESS, 0), e)


class EngineReplica:
    """The Ray Serve deployment class (pool.py wraps it with `serve.deployment`)."""

    def __init__(self, name: str, engine_kwargs: dict):
        # Imported here: the replica process builds the engine (jax starts in this process).
        from jaxserve.config import EngineConfig
        from jaxserve.engine import LLMEngine
        _unnice()
        self.name = name
        self.engine = LLMEngine(EngineConfig(**engine_kwargs))
        self.loop = EngineLoop(self.engine).start()
        self._outbox: _Outbox | None = None

    def describe(self) -> dict:
        """The model facts the HTTP layer needs, as plain data (tokenizer files as text)."""
        e = self.engine
        tok = e.model.tokenizer
        files = None
        if tok is not None:
            with tempfile.TemporaryDirectory() as d:
                tok.save(d)
                files = {f.name: f.read_text(encoding="utf-8")
                         for f in pathlib.Path(d).iterdir()}
        return {"replica": self.name, "pid": os.getpid(), "tokenizer_files": files,
                "vocab_size": e.model.config.vocab_size, "max_model_len": e.max_model_len,
                "max_num_seqs": e.config.max_num_seqs, "block_size": e.config.block_size,
                "eos_ids": sorted(e.eos_ids), "structured_outputs": e.grammar is not None}

    def _outbox_here(self) -> _Outbox:
        """The outbox, made on the first call (it needs the replica's running event loop)."""
        if self._outbox is None:
            self._outbox = _Outbox(asyncio.get_running_loop())
        return self._outbox

    async def submit(self, key: str, subs: list[SubRequest], capacity: int,
                     max_queued_tokens: int | None) -> dict | None:
        """Queues a group; its items come out of `events` under `key`. Returns None, or the
        wire form of the refusal (full, draining, dead) when nothing was queued."""
        try:
            self.loop.submit(subs, capacity, max_queued_tokens,
                             out=self._outbox_here().sink(key))
        except ApiError as e:
            return wire_error(e)
        return None

    async def events(self):
        """Streams lists of `(key, item)` for every group, forever. One consumer at a time: a
        new call (the pool reconnecting) ends the one before it."""
        outbox = self._outbox_here()
        reader = outbox.attach()
        while (items := await outbox.take(reader)) is not None:
            yield [(key, to_wire(item)) for key, item in items]

    def abort(self, request_ids: list[str]) -> None:
        self.loop.abort(request_ids)

    def stats(self) -> dict:
        """The engine's stats of its last step, plus this replica's liveness and identity."""
        return {"replica": self.name, "pid": os.getpid(), "alive": self.loop.alive,
                "in_flight": self.loop.in_flight(), "stats": self.loop.stats()}

    def engine_state(self) -> dict | None:
        return self.loop.engine_state()

    def begin_drain(self) -> None:
        self.loop.begin_drain()

    def check_health(self) -> None:
        """Ray Serve's health probe: raising marks the replica unhealthy and replaces it."""
        if not self.loop.alive:
            raise RuntimeError(f"replica {self.name}: the engine loop is not running "
                               f"({self.loop.error!r})")

    def __del__(self):
        """Ray Serve's shutdown of the replica: stop stepping, close the KV-event socket."""
        loop = getattr(self, "loop", None)  # absent when the engine failed to build
        if loop is not None:
            loop.stop(timeout=2.0)
            self.engine.close()

