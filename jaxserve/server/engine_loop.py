"""EngineLoop: the one thread that owns and steps the (not thread-safe) LLMEngine.

HTTP handler threads never touch the engine. They hand commands over through a thread-safe
inbox (submit a group of sub-requests, abort some) and read what the engine produced from the
group's own queue. Admission (queue bounds by requests and by prompt tokens not yet
prefilled, draining, engine dead) is decided under a lock at submit time so that a burst of
handlers cannot overshoot the bound; the engine's own bounds (core/admission.py) have the last
word. A watchdog (optional) fails the loop when it has work and makes no progress.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import queue
import threading
import time

from jaxserve.core.admission import EngineOverloaded
from jaxserve.core.lora import LoRAError, LoRARequest, UnknownAdapter
from jaxserve.core.outputs import RequestOutput
from jaxserve.core.pooling import PoolingParams
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.server.backend import Accepted, ServedModel
from jaxserve.server.engine_state import StateSampler
from jaxserve.faults import EngineThreadDeath
from jaxserve.server.errors import ApiError, invalid, lora_error, overloaded, unavailable

log = logging.getLogger("jaxserve.server")


@dataclasses.dataclass(frozen=True)
class SubRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams  # PoolingParams: an embedding (server/embeddings.py)
    index: int  # the choice (or embedding) index this sub-request fills in the response
    priority: int = 0  # lower runs first (the request's `priority` field)
    lora_request: LoRARequest | None = None  # the adapter `model` named (None: the base)


@dataclasses.dataclass(frozen=True)
class Event:
    """One item on a group's queue: an engine output, or an error that ends the group."""

    index: int
    output: RequestOutput | None
    time: float  # monotonic, taken on the engine thread when the output was produced
    error: Exception | None = None



def _optional_kwargs(sub: SubRequest) -> dict:
    """add_request's optional arguments, only where set (test engines take the plain call)."""
    kw = {"priority": sub.priority} if sub.priority else {}
    if sub.lora_request is not None:
        kw["lora_request"] = sub.lora_request
    return kw


class WatchdogTimeout(RuntimeError):
    """The engine had unfinished work and made no progress for the watchdog's timeout."""


class EngineLoop:
    def __init__(self, engine, idle_poll_s: float = 0.05, state_interval_s: float = 0.2,
                 watchdog_timeout_s: float | None = None):
        self.engine = engine
        self._watchdog_s = watchdog_timeout_s
        self._beat = time.monotonic()  # the engine thread's last progress (or idleness)
        self._queued_tokens = 0  # prompt tokens of accepted sub-requests not yet prefilled
        self._unprefilled: dict[str, int] = {}  # their ids -> prompt tokens (under _lock)
        self._idle_poll_s = idle_poll_s
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._in_flight = 0  # sub-requests accepted and not yet finished or aborted
        self._draining = False
        self._stopped = threading.Event()
        self._error: BaseException | None = None
        self._routes: dict[str, tuple[queue.SimpleQueue, int]] = {}  # engine thread only
        self._stats = engine.stats()
        # The engine view's snapshot (engine_state.py), rebuilt by the engine thread at most
        # every state_interval_s; the first one is built here, before that thread exists.
        self.state = StateSampler(state_interval_s)
        self._iterations = 0
        self.state.maybe_refresh(engine, self._stats, 0, force=True)
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    # ---- any thread ------------------------------------------------------------------------

    @functools.cached_property
    def model(self) -> ServedModel:
        """The served model's facts (read once, when an app is built over this loop)."""
        return ServedModel.of(self.engine)

    def start(self) -> "EngineLoop":
        self._thread.start()
        if self._watchdog_s is not None:
            threading.Thread(target=self._watch, name="engine-watchdog", daemon=True).start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stopped.set()
        self._inbox.put(None)  # wakes an idle loop
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._error is None and not self._stopped.is_set()

    @property
    def error(self) -> BaseException | None:
        return self._error

    @property
    def draining(self) -> bool:
        return self._draining

    def begin_drain(self) -> None:
        """From now on new requests are refused; those in flight run to completion."""
        with self._lock:
            self._draining = True

    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    def health(self) -> dict:
        """What GET /health reports (the caller turns a dead or draining loop into a 503)."""
        return {"status": "ok"}

    def stats(self) -> dict:
        """The engine's stats as of the end of its last step (a copy)."""
        return dict(self._stats)

    def engine_state(self) -> dict | None:
        """The latest engine snapshot (a dict nobody mutates; see engine_state.py)."""
        return self.state.latest()

    @property
    def snapshot_error(self) -> Exception | None:
        """Why there is no snapshot (the first failure to build one), if one failed."""
        return self.state.error

    def submit(self, subs: list[SubRequest], capacity: int,
               max_queued_tokens: int | None = None, out=None) -> queue.SimpleQueue:
        """Queues a group of sub-requests; their events arrive on the returned queue (or on
        `out`, anything with a thread-safe `put`: a replica forwards them to its caller).

        `capacity` bounds accepted, unfinished sub-requests (running + waiting);
        `max_queued_tokens` the prompt tokens of accepted ones not yet prefilled. Raises
        ApiError (503) when draining, dead or full; nothing is queued then (all or nothing).
        """
        tokens = sum(len(s.prompt_token_ids) for s in subs)
        with self._lock:
            if not self.alive:
                raise unavailable("the engine is not running", "engine_unavailable")
            if self._draining:
                raise unavailable("the server is shutting down", "server_draining")
            if self._in_flight + len(subs) > capacity:
                raise overloaded(f"too many requests in flight ({self._in_flight}); retry "
                                 "later", "queue_full")
            if max_queued_tokens is not None and self._queued_tokens and \
                    self._queued_tokens + tokens > max_queued_tokens:
                raise overloaded(f"too many prompt tokens queued ({self._queued_tokens}); "
                                 "retry later", "queue_full")
            self._in_flight += len(subs)
            self._queued_tokens += tokens
            for s in subs:
                self._unprefilled[s.request_id] = len(s.prompt_token_ids)
        out = queue.SimpleQueue() if out is None else out
        self._inbox.put(("submit", subs, out))
        return out

    def abort(self, request_ids: list[str]) -> None:
        """Aborts sub-requests that have not finished (a no-op for finished ones)."""
        self._inbox.put(("abort", list(request_ids), None))

    # ---- the engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                busy = self.engine.has_unfinished_requests()
                self._handle_inbox(block=not busy)
                outputs = []
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    self._dispatch(outputs)
                computed = self._stats.get("tokens_computed")
                self._stats = self.engine.stats()
                if outputs or not self.engine.has_unfinished_requests() or \
                        self._stats.get("tokens_computed") != computed:
                    self._beat = time.monotonic()
                self._iterations += 1
                self.state.maybe_refresh(self.engine, self._stats, self._iterations)
        except EngineThreadDeath:
            raise  # injected (jaxserve/faults.py): the thread ends as if killed, no cleanup
        except BaseException as e:  # noqa: BLE001 - any failure kills serving; report it
            log.exception("engine loop died")
            self._error = e
            self._fail_all(f"the engine failed: {type(e).__name__}")
            return
        self._fail_all("the engine was stopped")  # nobody may wait forever on a dead loop

    def _watch(self) -> None:
        """The watchdog thread: fails the loop once it has work and no progress for too long
        (a hung device call, a livelock); /health then answers 503 and `serve` exits 1."""
        timeout = self._watchdog_s
        while not self._stopped.wait(min(1.0, timeout / 4)):
            if not self._thread.is_alive() and self._error is None:
                self._error = RuntimeError("the engine thread died")
                self._fail_all("the engine thread died")
                return
            stalled = time.monotonic() - self._beat
            if self.in_flight() and stalled > timeout:
                log.error("watchdog: no engine progress for %.1fs with %d requests in flight",
                          stalled, self.in_flight())
                self._error = WatchdogTimeout(f"no progress for {stalled:.1f}s")
                self._stopped.set()  # a step that returns late ends the engine thread
                self._fail_all(f"the engine made no progress for {timeout}s")
                return

    def fail_pending(self, message: str) -> None:
        """Ends every accepted request with a 503 (the engine thread is gone)."""
        if not self._thread.is_alive():
            self._fail_all(message)

    def _handle_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=self._idle_poll_s) if block else \
                self._inbox.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            kind, payload, out = item
            if kind == "submit":
                self._add_group(payload, out)
            else:
                self._abort(payload)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                item = None

    def _add_group(self, subs: list[SubRequest], out: queue.SimpleQueue) -> None:
        added = []
        try:
            for sub in subs:
                self._check_adapter(sub.lora_request)
                self.engine.add_request(sub.request_id, sub.prompt_token_ids, sub.params,
                                        **_optional_kwargs(sub))
                added.append(sub)
                self._routes[sub.request_id] = (out, sub.index)
        except (ValueError, TypeError, EngineOverloaded) as e:
            # The handler validated already; this is the engine's last word. All or nothing.
            self._abort([s.request_id for s in added])
            for sub in subs[len(added):]:
                self._prefilled(sub.request_id)
            self._release(len(subs) - len(added))
            if isinstance(e, EngineOverloaded):
                err = overloaded(f"{e}", "queue_full")
            elif isinstance(e, LoRAError):
                err = lora_error(e, "model")
            else:
                err = invalid(str(e), getattr(e, "param", "prompt"))  # names its field
            out.put(Event(-1, None, time.monotonic(), error=err))
            return
        out.put(Accepted())

    def _check_adapter(self, lora_request: LoRARequest | None) -> None:
        """The adapter the handler resolved must still be registered: add_request would
        register (and read) it again, undoing an unload that came in between."""
        if lora_request is not None and self.engine.lora.get(
                lora_request.lora_name) != lora_request:
            raise UnknownAdapter(f"LoRA adapter {lora_request.lora_name!r} was unloaded")

    def _prefilled(self, request_id: str) -> None:
        """The sub-request's prompt is no longer queued (it produced output or ended)."""
        with self._lock:
            self._queued_tokens -= self._unprefilled.pop(request_id, 0)

    def _abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            if self._routes.pop(rid, None) is not None:
                self.engine.abort(rid)
                self._prefilled(rid)
                self._release(1)

    def _release(self, count: int) -> None:
        with self._lock:
            self._in_flight -= count

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for out in outputs:
            route = self._routes.get(out.request_id)
            if route is None:
                continue
            if self._unprefilled:
                self._prefilled(out.request_id)
            if out.error is not None:
                self._fail_group(route[0], out)
                continue
            route[0].put(Event(route[1], out, now))
            if out.finished:
                self._routes.pop(out.request_id, None)
                self._release(1)

    def _fail_group(self, group: queue.SimpleQueue, out: RequestOutput) -> None:
        """A sub-request failed inside a step (the engine went on without it): its response
        fails with a 500, so its siblings are aborted too."""
        self._routes.pop(out.request_id, None)
        self._release(1)
        self._abort([rid for rid, (q, _) in self._routes.items() if q is group])
        err = ApiError(500, f"the request failed while generating: {out.error}",
                       type="server_error", code="request_failed")
        group.put(Event(-1, None, time.monotonic(), error=err))

    def _fail_all(self, message: str) -> None:
        """Every accepted group gets a 503. Also called from the watchdog thread while the
        engine thread may be stuck: the routes are swapped out under the lock."""
        err = unavailable(message, "engine_unavailable")
        with self._lock:
            routes, self._routes = self._routes, {}
            self._in_flight -= len(routes)
            self._queued_tokens, self._unprefilled = 0, {}
        for out, index in routes.values():
            out.put(Event(index, None, time.monotonic(), error=err))
