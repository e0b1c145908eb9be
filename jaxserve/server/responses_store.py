"""Responses kept for `previous_response_id` and GET /v1/responses/{id}: in memory, at most
`capacity` of them, the least recently used dropped first (0: none kept).

Each entry is a finished Response body and the conversation that led to it as Responses input
items (the request's input after its own previous response's, then its output), which is what
a follow-up's input continues. It lives as long as the process: a restart forgets them all.
"""

from __future__ import annotations

import collections
import dataclasses
import threading


@dataclasses.dataclass(frozen=True)
class Stored:
    response: dict        # the Response body as it was returned
    items: list[dict]     # the conversation: input items, then the output items


class ResponseStore:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self._entries: collections.OrderedDict[str, Stored] = collections.OrderedDict()
        self._lock = threading.Lock()  # handlers run in many threads

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def put(self, response: dict, items: list[dict]) -> None:
        if not self.enabled:
            return
        with self._lock:
            self._entries[response["id"]] = Stored(response, items)
            self._entries.move_to_end(response["id"])
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def get(self, response_id: str) -> Stored | None:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is not None:
                self._entries.move_to_end(response_id)
            return entry

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
