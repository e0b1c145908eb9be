"""ReplicaPool: the HTTP layer's backend (server/backend.py) over N engine replicas on Ray Serve.

Each request group goes to the replica the router picks (router.py); a forwarding thread
iterates that replica's stream and puts its items on the group's queue, exactly as the local
engine loop would, restamping times on arrival (replicas' clocks are not ours). A replica that
fails mid-stream ends its open groups with a 503 (`replica_unavailable`) and is taken out of
routing; one poller thread per replica reads its stats, and puts it back (its prefix index
cleared when the process changed: Ray Serve started a new one) once it answers again.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time

from jaxserve.distributed.replica import Accepted, api_error
from jaxserve.distributed.router import ReplicaRouter
from jaxserve.server.backend import ServedModel
from jaxserve.server.engine_loop import Event, SubRequest
from jaxserve.server.errors import ApiError, unavailable

log = logging.getLogger("jaxserve.distributed")

# Stats that are the same on every replica (the others are summed over the pool).
SHARED_STATS = frozenset({"block_size", "max_model_len", "prefix_caching", "profiling"})


def pool_stats(per_replica: dict[str, dict]) -> dict:
    """The pool's stats in engine.stats()'s shape: counters and gauges summed over replicas
    (numbers only: per-step histograms stay per replica), plus `replicas`: each one's own."""
    out: dict = {}
    for stats in per_replica.values():
        for key, value in stats.items():
            if key in SHARED_STATS:
                out.setdefault(key, value)
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                out[key] = out.get(key, 0) + value
    for key in ("kv_blocks_total", "kv_blocks_free", "running", "waiting",
                "num_preemptions", "num_compiles_after_warmup"):
        out.setdefault(key, 0)
    out["replicas"] = per_replica
    return out


class _Group:
    def __init__(self, replica: str, subs: list[SubRequest], out: queue.SimpleQueue):
        self.replica, self.subs, self.out = replica, subs, out
        self.stream = None      # the Ray response generator, once called
        self.cancelled = False  # aborted by the HTTP side: its stream's end is expected


class ReplicaPool:
    def __init__(self, handles: dict, model: ServedModel, router: ReplicaRouter,
                 poll_s: float = 0.5, call_timeout_s: float = 5.0):
        self.model = model
        self._handles, self._router = handles, router
        self._poll_s, self._timeout = poll_s, call_timeout_s
        self._lock = threading.Lock()
        self._groups: dict[str, _Group] = {}  # sub-request id -> its group
        self._in_flight = 0
        self._draining = False
        self._stopped = threading.Event()
        self._stats: dict[str, dict] = {}     # replica -> its engine's latest stats
        self._pids: dict[str, int] = {}
        self._snapshot_error: Exception | None = None  # the last failed engine_state fetch
        self._pollers = [threading.Thread(target=self._poll, args=(name,), daemon=True,
                                          name=f"poll-{name}") for name in handles]

    def start(self, timeout: float = 60.0) -> "ReplicaPool":
        """Starts the pollers and waits (up to `timeout`) until every replica answered one."""
        for t in self._pollers:
            t.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and len(self._pids) < len(self._handles):
            time.sleep(0.05)
        return self

    # ---- the Backend surface ---------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return not self._stopped.is_set()

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def error(self) -> BaseException | None:
        return None  # a replica's failure is Ray Serve's to repair, not the pool's end

    def begin_drain(self) -> None:
        with self._lock:
            self._draining = True

    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    def stats(self) -> dict:
        """Summed over the replicas (pool_stats), with `replicas_up`: which ones are routed to."""
        with self._lock:
            per_replica = {n: s for n, s in self._stats.items()}
        out = pool_stats(per_replica)
        out.setdefault("block_size", self.model.block_size)  # before the first poll
        out["replicas_up"] = {n: r["healthy"] for n, r in self._router.snapshot().items()}
        return out

    def replicas(self) -> dict[str, dict]:
        """Per replica: healthy, load (requests routed and unfinished), indexed blocks, and
        the pid of its process (None before its first answer)."""
        snap = self._router.snapshot()
        for name, r in snap.items():
            r["pid"] = self._pids.get(name)
        return snap

    def health(self) -> dict:
        replicas = self._router.snapshot()
        if not any(r["healthy"] for r in replicas.values()):
            raise unavailable("no engine replica is healthy", "replica_unavailable")
        return {"status": "ok", "replicas": {n: "healthy" if r["healthy"] else "unhealthy"
                                             for n, r in replicas.items()}}

    def engine_state(self) -> dict | None:
        """The engine view of the first healthy replica (fetched now), with its name."""
        for name, r in self._router.snapshot().items():
            if r["healthy"]:
                try:
                    snap = self._handles[name].engine_state.remote().result(
                        timeout_s=self._timeout)
                except Exception as e:  # noqa: BLE001 - a view, never a request's error
                    self._snapshot_error = e
                    return None
                return None if snap is None else {**snap, "replica": name}
        self._snapshot_error = RuntimeError("no engine replica is healthy")
        return None

    @property
    def snapshot_error(self) -> Exception | None:
        return self._snapshot_error

    def submit(self, subs: list[SubRequest], capacity: int,
               max_queued_tokens: int | None = None) -> queue.SimpleQueue:
        """Routes the group to a replica and streams its items; raises ApiError (503) at once
        when draining or no replica is healthy. `capacity` bounds each replica (its own loop
        refuses past it, with the same 503 a single engine gives)."""
        with self._lock:
            if self._stopped.is_set():
                raise unavailable("the server is stopping", "engine_unavailable")
            if self._draining:
                raise unavailable("the server is shutting down", "server_draining")
        name = self._router.choose([s.prompt_token_ids for s in subs])
        if name is None:
            raise unavailable("no engine replica is healthy; retry later",
                              "replica_unavailable")
        out: queue.SimpleQueue = queue.SimpleQueue()
        group = _Group(name, subs, out)
        with self._lock:
            self._in_flight += len(subs)
            for s in subs:
                self._groups[s.request_id] = group
        threading.Thread(target=self._forward, args=(group, capacity, max_queued_tokens),
                         daemon=True, name=f"stream-{subs[0].request_id}").start()
        return out

    def abort(self, request_ids: list[str]) -> None:
        """Cancels the groups of these sub-requests: the replica aborts what is unfinished."""
        with self._lock:
            groups = {id(g): g for g in (self._groups.get(r) for r in request_ids) if g}
        for group in groups.values():
            group.cancelled = True
            if group.stream is not None:
                group.stream.cancel()

    def fail_pending(self, message: str) -> None:
        pass  # every group's own forwarding thread ends it

    def stop(self, timeout: float = 10.0) -> None:
        self._stopped.set()
        with self._lock:
            groups = list({id(g): g for g in self._groups.values()}.values())
        for group in groups:
            group.cancelled = True
            if group.stream is not None:
                group.stream.cancel()
        for t in self._pollers:
            t.join(timeout / max(1, len(self._pollers)))

    # ---- forwarding ------------------------------------------------------------------------

    def _forward(self, group: _Group, capacity: int, max_queued_tokens: int | None) -> None:
        name, out = group.replica, group.out
        open_ids = {s.request_id for s in group.subs}
        try:
            group.stream = self._handles[name].options(stream=True).generate.remote(
                group.subs, capacity, max_queued_tokens)
            if group.cancelled:
                group.stream.cancel()
            for batch in group.stream:
                for item in batch:
                    self._put(name, item, out, open_ids)
            if open_ids and not group.cancelled:
                raise RuntimeError("the replica's stream ended before its requests finished")
        except Exception as e:  # noqa: BLE001 - whatever broke the stream, the client hears
            if not group.cancelled and open_ids:
                log.warning("replica %s failed a request: %r", name, e)
                self._router.mark_down(name)  # the poller puts it back once it answers
                out.put(Event(-1, None, time.monotonic(), error=unavailable(
                    f"engine replica {name} failed while serving this request; retry",
                    "replica_unavailable")))
        finally:
            self._router.done(name)
            with self._lock:
                self._in_flight -= len(group.subs)
                for s in group.subs:
                    self._groups.pop(s.request_id, None)

    @staticmethod
    def _put(name: str, item, out: queue.SimpleQueue, open_ids: set[str]) -> None:
        if isinstance(item, Accepted):
            out.put(Accepted(name))
            return
        now = time.monotonic()
        if item.error is not None:
            open_ids.clear()
            err = item.error if isinstance(item.error, ApiError) else api_error(item.error)
            out.put(Event(item.index, None, now, error=err))
            return
        if item.output.finished:
            open_ids.discard(item.output.request_id)
        out.put(dataclasses.replace(item, time=now))

    # ---- health ----------------------------------------------------------------------------

    def _poll(self, name: str) -> None:
        handle = self._handles[name]
        while not self._stopped.wait(self._poll_s):
            try:
                info = handle.stats.remote().result(timeout_s=self._timeout)
            except Exception as e:  # noqa: BLE001 - dead, restarting or unreachable
                if self._router.snapshot()[name]["healthy"]:
                    log.warning("replica %s does not answer (%r); routing around it", name, e)
                self._router.mark_down(name)
                continue
            if not info["alive"]:
                self._router.mark_down(name)
                continue
            fresh = self._pids.get(name) not in (None, info["pid"])
            if fresh:
                log.info("replica %s restarted (pid %s); its cache starts empty", name,
                         info["pid"])
            self._pids[name] = info["pid"]
            with self._lock:
                self._stats[name] = info["stats"]
            self._router.set_capacity(name, info["stats"]["kv_blocks_total"])
            self._router.mark_up(name, fresh=fresh)
