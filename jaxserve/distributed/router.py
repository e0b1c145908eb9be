"""Which engine replica takes a request: prefix-cache affinity balanced against load, or
round-robin / least-loaded for comparison. Plain Python (no Ray, no jax), thread-safe.

Prefix affinity keeps, per replica, an approximate index of the KV blocks it holds: the
content hashes of every full prompt block routed to it (`core/prefix_cache.hash_block`, the
hashes the replica's own prefix cache computes), bounded by the replica's block count and
forgotten least recently used first, as its cache evicts. This is SGLang's approximate tree
and Ray Serve LLM's prefix-affinity idea: the router guesses what a replica caches from what
it sent there, with no round trip. A request goes to the replica holding the longest prefix
of its prompt among those whose load is within `slack` of the least loaded one; so a hot
prefix spills over to a second replica instead of queueing behind one.
"""

from __future__ import annotations

import collections
import itertools
import threading

from jaxserve.core.prefix_cache import hash_block

POLICIES = ("prefix", "round_robin", "least_loaded")
DEFAULT_INDEX_BLOCKS = 1 << 16  # per replica, until its real block count is known


def prompt_hashes(token_ids, block_size: int, salt: str | None = None) -> list[bytes]:
    """Hashes of the prompt's full blocks, chained as the replica's prefix cache chains them."""
    extra = salt.encode("utf-8") if salt else b""
    hashes, parent = [], b""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start:start + block_size], extra)
        hashes.append(parent)
    return hashes


class _Replica:
    def __init__(self, name: str):
        self.name = name
        self.load = 0           # requests routed here and not yet finished
        self.healthy = True
        self.blocks: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self.capacity = DEFAULT_INDEX_BLOCKS

    def matched(self, hashes: list[bytes]) -> int:
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        return n

    def remember(self, hashes: list[bytes]) -> None:
        for h in hashes:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)


class ReplicaRouter:
    def __init__(self, names: list[str], policy: str = "prefix", block_size: int = 16,
                 slack: int = 2):
        if policy not in POLICIES:
            raise ValueError(f"router must be one of {', '.join(POLICIES)}, got {policy!r}")
        if not names:
            raise ValueError("a router needs at least one replica")
        if slack < 0:
            raise ValueError(f"the router's load slack must be >= 0, got {slack}")
        self.policy, self.block_size, self.slack = policy, block_size, slack
        self._replicas = {n: _Replica(n) for n in names}
        self._order = list(names)
        self._turn = itertools.count()
        self._lock = threading.Lock()

    @property
    def names(self) -> list[str]:
        return list(self._order)

    def choose(self, prompts: list[list[int]], salt: str | None = None) -> str | None:
        """The replica for a request with these prompts (its load counts it until `done`);
        None when no replica is healthy."""
        hashes = [h for p in prompts for h in prompt_hashes(p, self.block_size, salt)] \
            if self.policy == "prefix" else []
        with self._lock:
            up = [r for r in (self._replicas[n] for n in self._order) if r.healthy]
            if not up:
                return None
            turn = next(self._turn)
            # Rotating the ties' order spreads equal candidates instead of always the first.
            up = up[turn % len(up):] + up[:turn % len(up)]
            if self.policy == "round_robin":
                chosen = up[0]
            else:
                least = min(r.load for r in up)
                near = [r for r in up if r.load <= least + self.slack] \
                    if self.policy == "prefix" else [r for r in up if r.load == least]
                chosen = max(near, key=lambda r: (self._score(r, prompts, hashes), -r.load))
            chosen.load += 1
            if hashes:
                chosen.remember(hashes)
            return chosen.name

    def _score(self, replica: _Replica, prompts, hashes) -> int:
        if not hashes:
            return 0
        # Blocks of each prompt's longest cached prefix (prompts hash independently).
        total, start = 0, 0
        for p in prompts:
            n = len(p) // self.block_size
            total += replica.matched(hashes[start:start + n])
            start += n
        return total

    def done(self, name: str) -> None:
        """A request routed to `name` finished (or failed)."""
        with self._lock:
            r = self._replicas[name]
            r.load = max(0, r.load - 1)

    def mark_down(self, name: str) -> None:
        """No more requests to `name` until `mark_up`."""
        with self._lock:
            self._replicas[name].healthy = False

    def mark_up(self, name: str, fresh: bool = False) -> None:
        """`name` serves again; `fresh`: it restarted, so its cache (and our index) is empty."""
        with self._lock:
            r = self._replicas[name]
            r.healthy = True
            if fresh:
                r.blocks.clear()

    def set_capacity(self, name: str, num_blocks: int) -> None:
        """The replica's KV block count: the index forgets past it, as the cache evicts."""
        with self._lock:
            r = self._replicas[name]
            r.capacity = max(1, num_blocks)
            r.remember([])

    def snapshot(self) -> dict[str, dict]:
        with self._lock:
            return {n: {"healthy": r.healthy, "load": r.load, "indexed_blocks": len(r.blocks)}
                    for n, r in self._replicas.items()}
