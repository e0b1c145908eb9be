"""LoRA adapters in the engine loop: which adapters exist, which are loaded in host memory,
which sit in the device's slots, and the requests waiting for one to load.

- Registry: `lora_name` <-> `lora_int_id` <-> path, one-to-one (a second adapter under a
  name or id in use is refused). `add` registers and loads at once, so bad files are refused
  there, naming the problem; `remove` refuses an adapter that requests still use (nothing is
  drained behind the caller's back).
- Host cache: up to `max_cpu_loras` adapters' weights (models/lora_weights.py), least recently
  used dropped first, but never one a live request uses. A request whose adapter was dropped
  waits here, holding no batch slot, while a loader thread reads it again; the engine moves
  it on when `admit` finds it ready.
- Device slots: the scheduler admits at most `max_loras` distinct adapters among running
  sequences (core/scheduler.py); `assign` gives each adapter of a step's rows a slot, taking a
  free one or the least recently used one no running sequence needs, and returns the loads
  the runner makes before the step.

Thread-safe: the server adds and removes adapters from its request threads while the engine
thread steps.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from jaxserve.core.lora import AdapterInUse, LoRAError, LoRARequest, UnknownAdapter
from jaxserve.core.scheduler import SchedulerOutput
from jaxserve.core.sequence import Sequence

log = logging.getLogger("jaxserve")

# (LoRARequest) -> the adapter's weights (AdapterWeights); raises LoRAError on bad files.
Loader = Callable[[LoRARequest], Any]


class Waiting(NamedTuple):
    """A request whose adapter is loading into host memory."""

    state: Any
    seq: Sequence
    weights: concurrent.futures.Future


class LoRAAdapters:
    def __init__(self, *, max_loras: int, max_cpu_loras: int, load: Loader):
        self.max_loras, self.max_cpu_loras = max_loras, max_cpu_loras
        self._load = load
        self._lock = threading.RLock()
        self._by_name: dict[str, LoRARequest] = {}
        self._by_id: dict[int, LoRARequest] = {}
        self._cpu: collections.OrderedDict[int, Any] = collections.OrderedDict()  # LRU first
        self._users: collections.Counter[int] = collections.Counter()  # live requests
        self._request_lora: dict[str, int] = {}
        # Ids removed since: a request naming one is refused, not silently re-registered
        # (an unload racing the server's accepted request); `add` takes one back.
        self._removed: set[int] = set()
        self._waiting: dict[str, Waiting] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxserve-lora")
        self._slot_adapter: list[int | None] = [None] * max_loras  # slot -> lora_int_id
        self._slot_used: list[int] = [0] * max_loras  # the step that last used each slot
        self._clock = 0
        self.num_device_loads = 0  # adapters written into device slots
        self.num_host_loads = 0    # adapters read from files

    # ---- the registry (any thread) ----------------------------------------------------------

    def add(self, request: LoRARequest) -> LoRARequest:
        """Registers `request` and loads its files (raises LoRAError, registering nothing, when
        they cannot be served). The same request again is a no-op."""
        self.check(request)
        with self._lock:
            known = self._check_new(request)
            if known:
                return request
        weights = self._load(request)  # outside the lock: file reads take a while
        with self._lock:
            if self._check_new(request):  # another thread added it meanwhile
                return request
            self._by_name[request.lora_name] = request
            self._by_id[request.lora_int_id] = request
            self._removed.discard(request.lora_int_id)
            self._cache(request.lora_int_id, weights)
            self.num_host_loads += 1
        log.info("LoRA adapter %r (id %d) loaded from %s", request.lora_name,
                 request.lora_int_id, request.lora_path)
        return request

    @staticmethod
    def check(request) -> None:
        """Raises LoRAError unless `request` is a LoRARequest."""
        if not isinstance(request, LoRARequest):
            raise LoRAError(f"lora_request must be a LoRARequest, got "
                            f"{type(request).__name__}")

    def _check_new(self, request: LoRARequest) -> bool:
        """True when exactly this adapter is registered; raises when its name or id is another
        adapter's."""
        by_name, by_id = self._by_name.get(request.lora_name), self._by_id.get(request.lora_int_id)
        if by_name == request:
            return True
        if by_name is not None:
            raise LoRAError(f"an adapter named {request.lora_name!r} is already loaded (id "
                            f"{by_name.lora_int_id}, {by_name.lora_path}); unload it first")
        if by_id is not None:
            raise LoRAError(f"lora_int_id {request.lora_int_id} is already adapter "
                            f"{by_id.lora_name!r}; pick another id")
        return False

    def remove(self, name: str) -> LoRARequest:
        """Unregisters adapter `name`: UnknownAdapter if there is none, AdapterInUse (nothing
        changed) while requests use it."""
        with self._lock:
            request = self._by_name.get(name)
            if request is None:
                raise UnknownAdapter(f"no LoRA adapter named {name!r} is loaded")
            users = self._users[request.lora_int_id]
            if users:
                raise AdapterInUse(f"LoRA adapter {name!r} is in use by {users} unfinished "
                                   "request(s); unload it when they have finished")
            del self._by_name[name], self._by_id[request.lora_int_id]
            self._removed.add(request.lora_int_id)
            self._cpu.pop(request.lora_int_id, None)
            for slot, held in enumerate(self._slot_adapter):
                if held == request.lora_int_id:
                    self._slot_adapter[slot] = None
        return request

    def get(self, name: str) -> LoRARequest | None:
        with self._lock:
            return self._by_name.get(name)

    def adapters(self) -> list[LoRARequest]:
        with self._lock:
            return sorted(self._by_name.values(), key=lambda r: r.lora_int_id)

    def name_of(self, lora_id: int) -> str | None:
        with self._lock:
            request = self._by_id.get(lora_id)
            return request.lora_name if request is not None else None

    # ---- requests (the engine thread) -------------------------------------------------------

    def use(self, request_id: str, request: LoRARequest) -> bool:
        """A new request `request_id` runs with `request` (registered and loaded here if new:
        raises LoRAError, counting nothing, on bad files). Returns whether the adapter's
        weights are in host memory; if not, `wait` the request until they are. An adapter
        removed since is refused (UnknownAdapter) until `add`ed again."""
        with self._lock:
            if request.lora_int_id in self._removed and self._by_id.get(
                    request.lora_int_id) is None:
                raise UnknownAdapter(f"LoRA adapter {request.lora_name!r} was unloaded; load "
                                     "it again to use it")
        self.add(request)
        with self._lock:
            self._users[request.lora_int_id] += 1
            self._request_lora[request_id] = request.lora_int_id
            return request.lora_int_id in self._cpu

    def wait(self, state, seq: Sequence) -> None:
        """Holds a request (its adapter not in host memory) until its weights are read."""
        lora_id = seq.lora_id
        with self._lock:
            request = self._by_id[lora_id]
        self._waiting[state.request_id] = Waiting(state, seq,
                                                  self._pool.submit(self._load, request))

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def admit(self) -> tuple[list[Waiting], list[tuple[Waiting, str]]]:
        """(requests whose adapter is loaded: go on; requests whose load failed, with why)."""
        ready, failed = [], []
        for rid, waiting in list(self._waiting.items()):
            future = waiting.weights
            if not future.done():
                continue
            del self._waiting[rid]
            error = future.exception()
            if error is not None:
                failed.append((waiting, f"LoRA adapter could not be loaded: {error}"))
                continue
            with self._lock:
                if waiting.seq.lora_id not in self._cpu:
                    self._cache(waiting.seq.lora_id, future.result())
                    self.num_host_loads += 1
            ready.append(waiting)
        return ready, failed

    def forget(self, request_id: str) -> None:
        """The request ended (or was aborted, also while its adapter loaded)."""
        self._waiting.pop(request_id, None)
        with self._lock:
            lora_id = self._request_lora.pop(request_id, None)
            if lora_id is not None:
                self._users[lora_id] -= 1
                if self._users[lora_id] <= 0:
                    del self._users[lora_id]
                    self._trim()  # its weights may now leave host memory

    def assign(self, out: SchedulerOutput, running: Iterable[Sequence]):
        """Device slots for every adapter of `out`'s rows: (lora_int_id -> slot, loads), loads
        being (slot, weights) pairs to write before the step. An adapter without a slot takes
        a free one or the least recently used one that no running sequence needs (the
        scheduler keeps distinct running adapters within max_loras, so one always exists)."""
        ids = {item.seq.lora_id for item in out.scheduled if item.seq.lora_id}
        if not ids:
            return {}, ()
        self._clock += 1
        with self._lock:
            slot_of = {a: s for s, a in enumerate(self._slot_adapter) if a is not None}
            needed = {seq.lora_id for seq in running if seq.lora_id} | ids
            loads = []
            for lora_id in sorted(ids - slot_of.keys()):
                free = [s for s, a in enumerate(self._slot_adapter) if a not in needed]
                if not free:
                    raise RuntimeError(f"no LoRA slot free for adapter {lora_id}: "
                                       f"{len(needed)} adapters needed, max_loras "
                                       f"{self.max_loras}")
                slot = min(free, key=lambda s: (self._slot_adapter[s] is not None,
                                                self._slot_used[s]))
                weights = self._cpu.get(lora_id)
                if weights is None:
                    raise RuntimeError(f"LoRA adapter {lora_id} is not in host memory")
                self._cpu.move_to_end(lora_id)
                self._slot_adapter[slot] = lora_id
                slot_of[lora_id] = slot
                loads.append((slot, weights))
                self.num_device_loads += 1
            for lora_id in ids:
                self._slot_used[slot_of[lora_id]] = self._clock
            return {a: slot_of[a] for a in ids}, tuple(loads)

    def stats(self, running: Iterable[Sequence], waiting: Iterable[Sequence]) -> dict:
        """vLLM's lora_requests_info: adapter names of running and waiting requests."""
        def names(seqs):
            return sorted({self.name_of(s.lora_id) or str(s.lora_id) for s in seqs
                           if s.lora_id})
        waiting = list(waiting) + [w.seq for w in self._waiting.values()]
        return {"max_lora": self.max_loras, "running_lora_adapters": names(running),
                "waiting_lora_adapters": names(waiting), "loaded": len(self._by_name),
                "in_host_memory": len(self._cpu), "device_loads": self.num_device_loads,
                "host_loads": self.num_host_loads}

    def _cache(self, lora_id: int, weights) -> None:
        """Keeps `weights` in host memory, dropping the least recently used adapters that no
        request uses beyond max_cpu_loras."""
        self._cpu[lora_id] = weights
        self._cpu.move_to_end(lora_id)
        self._trim(keep=lora_id)

    def _trim(self, keep: int | None = None) -> None:
        """Drops least recently used weights past max_cpu_loras (none a request uses)."""
        for old in list(self._cpu):
            if len(self._cpu) <= self.max_cpu_loras:
                break
            if old != keep and not self._users[old]:
                del self._cpu[old]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
