"""One engine replica: an LLMEngine and its EngineLoop inside a Ray Serve replica actor.

The replica speaks the engine loop's protocol (sub-requests in; `Accepted`, then `Event`s out)
over Ray: `generate` is an async generator streaming the group's items in batches (everything
the engine thread produced since the last yield goes in one Ray message). What crosses the
process boundary is the engine's own dataclasses; errors travel as their JSON body and status
(`wire_error` / `api_error`), never as exception objects. Ray Serve calls `check_health`
periodically and replaces a replica whose engine thread died.
"""

from __future__ import annotations

import asyncio
import os

from jaxserve.server.backend import Accepted
from jaxserve.server.engine_loop import EngineLoop, Event, SubRequest
from jaxserve.server.errors import ApiError


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


class _Forward:
    """A `put` the engine thread calls, landing on an asyncio queue of the replica's loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, q: asyncio.Queue):
        self._loop, self._q = loop, q

    def put(self, item) -> None:
        self._loop.call_soon_threadsafe(self._q.put_nowait, item)


class EngineReplica:
    """The Ray Serve deployment class (pool.py wraps it with `serve.deployment`)."""

    def __init__(self, name: str, engine_kwargs: dict):
        # Imported here: the replica process builds the engine (jax starts in this process).
        from jaxserve.config import EngineConfig
        from jaxserve.engine import LLMEngine
        self.name = name
        self.engine = LLMEngine(EngineConfig(**engine_kwargs))
        self.loop = EngineLoop(self.engine).start()

    def describe(self) -> dict:
        """The model facts the HTTP layer needs, as plain data (tokenizer files as text)."""
        e = self.engine
        tok = e.model.tokenizer
        files = None
        if tok is not None:
            import tempfile
            with tempfile.TemporaryDirectory() as d:
                tok.save(d)
                files = {n: open(os.path.join(d, n), encoding="utf-8").read()
                         for n in os.listdir(d)}
        return {"replica": self.name, "pid": os.getpid(), "tokenizer_files": files,
                "vocab_size": e.model.config.vocab_size, "max_model_len": e.max_model_len,
                "max_num_seqs": e.config.max_num_seqs, "block_size": e.config.block_size,
                "eos_ids": sorted(e.eos_ids), "structured_outputs": e.grammar is not None}

    async def generate(self, subs: list[SubRequest], capacity: int,
                       max_queued_tokens: int | None):
        """Streams lists of queue items for one group until every sub-request finished, the
        group failed, or the caller cancelled (then what is unfinished is aborted)."""
        q: asyncio.Queue = asyncio.Queue()
        try:
            self.loop.submit(subs, capacity, max_queued_tokens,
                             out=_Forward(asyncio.get_running_loop(), q))
        except ApiError as e:  # refused before anything was queued
            yield [Event(-1, None, 0.0, error=wire_error(e))]
            return
        open_ids = {s.request_id for s in subs}
        try:
            while open_ids:
                batch = [await q.get()]
                while not q.empty():
                    batch.append(q.get_nowait())
                failed = False
                for item in batch:
                    if isinstance(item, Event):
                        if item.error is not None:
                            failed = True
                            open_ids.clear()  # the engine loop dropped the whole group
                        elif item.output.finished:
                            open_ids.discard(item.output.request_id)
                yield [to_wire(item) for item in batch]
                if failed:
                    return
        finally:
            if open_ids:  # cancelled: the client went away or the pool gave up
                self.loop.abort(sorted(open_ids))

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


# `Accepted` crosses the boundary as is; re-exported for the pool's isinstance checks.
__all__ = ["Accepted", "EngineReplica", "api_error", "to_wire", "wire_error"]
