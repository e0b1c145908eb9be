"""ReplicaPool: the HTTP layer's backend (server/backend.py) over N engine replicas on Ray Serve.

Each request group goes to the replica the router picks (router.py): `submit` hands it over
under a key (its first sub-request's id), and one pump thread per replica reads that replica's
`events` stream, a batch of `(key, item)` per engine step, and puts each item on its group's
queue exactly as the local engine loop would, restamping times on arrival (replicas' clocks
are not ours). A replica whose stream breaks (its process died) ends its open groups with a
503 (`replica_unavailable`) and is taken out of routing; one poller thread per replica reads
its stats and puts it back (its prefix index cleared when the process changed: Ray Serve
started a new one) once it answers again, and the pump reconnects.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time

from jaxserve.distributed.replica import api_error
from jaxserve.distributed.router import ReplicaRouter
from jaxserve.server.backend import Accepted, ServedModel
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
        self.key = subs[0].request_id
        self.open = {s.request_id for s in subs}  # sub-requests not finished yet


class ReplicaPool:
    def __init__(self, handles: dict, model: ServedModel, router: ReplicaRouter,
                 poll_s: float = 0.5, call_timeout_s: float = 5.0):
        self.model = model
        self._handles, self._router = handles, router
        self._poll_s, self._timeout = poll_s, call_timeout_s
        self._lock = threading.Lock()
        self._groups: dict[str, _Group] = {}  # key -> an unfinished group
        self._owner: dict[str, str] = {}      # sub-request id -> its group's key
        self._in_flight = 0
        self._draining = False
        self._stopped = threading.Event()
        self._stats: dict[str, dict] = {}     # replica -> its engine's latest stats
        self._pids: dict[str, int] = {}
        self._snapshot_error: Exception | None = None  # the last failed engine_state fetch
        self._streams: dict[str, object] = {}  # replica -> its open `events` stream
        self._threads = [threading.Thread(target=target, args=(name,), daemon=True,
                                          name=f"{kind}-{name}")
                         for name in handles
                         for kind, target in (("poll", self._poll), ("pump", self._pump))]

    def start(self, timeout: float = 60.0) -> "ReplicaPool":
        """Starts the pollers and waits (up to `timeout`) until every replica answered one."""
        for t in self._threads:
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
               max_queued_tokens: int | None = None, out=None) -> queue.SimpleQueue:
        """Routes the group to a replica and queues it there; raises ApiError (503) at once
        when draining, when no replica is healthy, or when the replica refuses it. `capacity`
        bounds each replica (its own loop refuses past it, as a single engine does). Events go
        to `out` (anything with a thread-safe `put`) when given, else to a new queue."""
        with self._lock:
            if self._stopped.is_set():
                raise unavailable("the server is stopping", "engine_unavailable")
            if self._draining:
                raise unavailable("the server is shutting down", "server_draining")
        name = self._router.choose([s.prompt_token_ids for s in subs])
        if name is None:
            raise unavailable("no engine replica is healthy; retry later",
                              "replica_unavailable")
        group = _Group(name, subs, queue.SimpleQueue() if out is None else out)
        with self._lock:
            self._in_flight += len(subs)
            self._groups[group.key] = group
            self._owner.update((s.request_id, group.key) for s in subs)
        try:
            refused = self._handles[name].submit.remote(
                group.key, subs, capacity, max_queued_tokens).result(timeout_s=self._timeout)
        except Exception as e:  # noqa: BLE001 - dead, restarting or unreachable
            log.warning("replica %s did not take a request: %r", name, e)
            self._router.mark_down(name)
            self._end(group)
            raise unavailable(f"engine replica {name} is not answering; retry",
                              "replica_unavailable") from None
        if refused is not None:
            self._end(group)
            raise api_error(refused)
        return group.out

    def abort(self, request_ids: list[str]) -> None:
        """Aborts these sub-requests on their replica; their groups end here at once."""
        by_replica: dict[str, list[str]] = {}
        with self._lock:
            keys = {self._owner[r] for r in request_ids if r in self._owner}
            groups = [self._groups[k] for k in keys if k in self._groups]
        for group in groups:
            by_replica.setdefault(group.replica, []).extend(group.open)
            self._end(group)
        for name, ids in by_replica.items():
            try:
                self._handles[name].abort.remote(sorted(ids))  # no wait: best effort
            except Exception as e:  # noqa: BLE001 - a dead replica holds nothing any more
                log.info("abort on replica %s failed: %r", name, e)

    def fail_pending(self, message: str) -> None:
        pass  # a replica's own failure ends its groups (the pump's stream breaks)

    def stop(self, timeout: float = 10.0) -> None:
        self._stopped.set()
        with self._lock:
            groups = list(self._groups.values())
            streams = list(self._streams.values())
        for group in groups:
            self._fail(group, "the server is stopping")
        # An idle replica's `events` stream never yields again: left open, it keeps the pump
        # thread waiting (the join below times out) and counts as an ongoing request, so Ray
        # Serve waits out its whole graceful-shutdown period (20 s) before deleting the replica.
        for stream in streams:
            _cancel(stream)
        for t in self._threads:
            t.join(timeout / max(1, len(self._threads)))

    # ---- the groups' items ------------------------------------------------------------------

    def _end(self, group: _Group) -> None:
        """The group is done (finished, failed, aborted or refused): release what it held."""
        with self._lock:
            if self._groups.pop(group.key, None) is None:
                return
            self._in_flight -= len(group.subs)
            for s in group.subs:
                self._owner.pop(s.request_id, None)
        self._router.done(group.replica)

    def _fail(self, group: _Group, message: str) -> None:
        group.out.put(Event(-1, None, time.monotonic(),
                            error=unavailable(message, "replica_unavailable")))
        self._end(group)

    def _pump(self, name: str) -> None:
        """Reads the replica's event stream into its groups' queues; reconnects after a
        failure once the replica answers again."""
        handle = self._handles[name].options(stream=True)
        while not self._stopped.is_set():
            if not self._router.snapshot()[name]["healthy"]:
                self._stopped.wait(self._poll_s)
                continue
            try:
                for batch in self._open_stream(name, handle):
                    now = time.monotonic()
                    for key, item in batch:
                        self._deliver(name, key, item, now)
                    if self._stopped.is_set():
                        return
                continue  # ended without an error (another reader took over): reconnect
            except Exception as e:  # noqa: BLE001 - the replica died or Ray lost it
                if self._stopped.is_set():
                    return
                log.warning("replica %s: its event stream broke (%r); failing its requests "
                            "and routing around it", name, e)
                self._router.mark_down(name)
            with self._lock:
                lost = [g for g in self._groups.values() if g.replica == name]
            for group in lost:
                self._fail(group, f"engine replica {name} failed while serving this request; "
                                  "retry")
            if lost:  # the process may live on (a Ray hiccup): it must not keep their blocks
                try:
                    self._handles[name].abort.remote(sorted(r for g in lost for r in g.open))
                except Exception:  # noqa: BLE001 - it is dead: nothing to free
                    pass

    def _open_stream(self, name: str, handle):
        """A new `events` stream, registered for stop() to cancel (cancelled at once when
        stop() came first: it sets `_stopped` before it collects the streams)."""
        stream = handle.events.remote()
        with self._lock:
            self._streams[name] = stream
            stopped = self._stopped.is_set()
        if stopped:
            _cancel(stream)
        return stream

    def _deliver(self, name: str, key: str, item, now: float) -> None:
        with self._lock:
            group = self._groups.get(key)
        if group is None:
            return  # aborted here already
        if isinstance(item, Accepted):
            group.out.put(Accepted(name))
            return
        if item.error is not None:
            err = item.error if isinstance(item.error, ApiError) else api_error(item.error)
            group.out.put(Event(item.index, None, now, error=err))
            self._end(group)
            return
        group.out.put(dataclasses.replace(item, time=now))
        if item.output.finished:
            group.open.discard(item.output.request_id)
            if not group.open:
                self._end(group)

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


def _cancel(stream) -> None:
    """Ends an `events` stream: Ray cancels the call in the replica, and the pump reading it
    gets an error (which it ignores once the pool is stopped)."""
    try:
        stream.cancel()
    except Exception as e:  # noqa: BLE001 - best effort: a dead replica's stream is gone
        log.info("cancelling an event stream failed: %r", e)
