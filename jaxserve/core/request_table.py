"""The engine's live requests: one table, with the questions the step loop asks of it.

A request is one state (request_state.RequestState, or beam_search.BeamRequestState for a beam
group) and one or more sequences (its branches or beams), each with its own id. The table maps
request ids to states and every live sequence id to its request; it also keeps the requests
that may need a step's sampled ids before the next step is scheduled (forks not yet made,
beams, grammars), so that the asynchronous loop's usual question costs nothing when there are
none. Plain Python: no jax.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from jaxserve.core.decision import RequestStateProtocol
from jaxserve.core.scheduler import ScheduledSeq


class RequestTable:
    def __init__(self) -> None:
        self._states: dict[str, RequestStateProtocol] = {}
        # Every live sequence id (a request's own, its branches' and beams') -> its request.
        # Public for the step loop's per-row lookups, which a method call per row would slow.
        self.owner: dict[str, RequestStateProtocol] = {}
        # Requests that may wait for ids, pruned as they stop (see may_wait_for_ids).
        self._may_wait: dict[str, RequestStateProtocol] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def __iter__(self) -> Iterator[str]:
        return iter(self._states)

    def __len__(self) -> int:
        return len(self._states)

    def in_use(self, seq_or_request_id: str) -> bool:
        """Whether a live request or sequence has this id."""
        return seq_or_request_id in self.owner or seq_or_request_id in self._states

    def add(self, state: RequestStateProtocol) -> None:
        """A new request, whose first sequence has the request's id."""
        rid = state.request_id
        self._states[rid] = self.owner[rid] = state
        if state.waits_for_ids:
            self._may_wait[rid] = state

    def add_sequence(self, seq_id: str, of: str) -> None:
        """A sequence started for the request that owns sequence `of` (a fork)."""
        self.owner[seq_id] = self.owner[of]

    def drop_sequence(self, seq_id: str) -> None:
        self.owner.pop(seq_id, None)

    def sequences_of(self, state: RequestStateProtocol) -> list[str]:
        return [sid for sid, owner in self.owner.items() if owner is state]

    def forget(self, request_id: str) -> RequestStateProtocol | None:
        """Drops an ended request; returns its state. Its sequences are dropped as the engine
        ends them (drop_sequence)."""
        self._may_wait.pop(request_id, None)
        return self._states.pop(request_id, None)

    def may_wait_for_ids(self) -> bool:
        """Whether a live request may need a step's ids before the next is scheduled; drops
        those that no longer do (forked, unconstrained). Ended requests leave in forget."""
        if self._may_wait:
            self._may_wait = {rid: state for rid, state in self._may_wait.items()
                              if state.waits_for_ids}
        return bool(self._may_wait)

    def waiting_for_ids(self) -> frozenset[str]:
        """The requests may_wait_for_ids holds now (for inspection and tests)."""
        return frozenset(self._may_wait)

    def waits_for_ids(self, rows: Iterable[ScheduledSeq]) -> bool:
        """Whether a request with a row among `rows` needs their ids before the next step is
        scheduled (it forks branches or searches beams on them, or a grammar follows them)."""
        if not self.may_wait_for_ids():
            return False
        owner = self.owner
        for item in rows:
            state = owner.get(item.seq.request_id)
            if state is not None and state.waits_for_ids:
                return True
        return False
