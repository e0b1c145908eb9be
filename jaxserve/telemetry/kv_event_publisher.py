"""Publishes the engine's KV-cache events on a ZMQ PUB socket, in vLLM's wire format.

One message per engine step that changed the prefix cache: the multipart frames
[topic, 8-byte big-endian sequence number from 0, msgpack KVEventBatch] (kv_event_wire.py), as
vLLM's ZmqEventPublisher sends them, so llm-d's KV-cache indexer and Dynamo's router subscribe
unchanged. The engine thread only puts the step's events on a queue: one background thread owns
the socket and does the encoding and the sending, so a slow network never stalls a step. PUB
drops what no subscriber is connected for; vLLM's replay socket is not offered.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time

from jaxserve.core.kv_events import KVEvent

log = logging.getLogger("jaxserve")

_TCP = re.compile(r"tcp://(?P<host>[^/]+):(?P<port>\d+)")
CLOSE_TIMEOUT_S = 2.0
LINGER_MS = 500


def kv_event_endpoint(endpoint: str, data_parallel_rank: int = 0) -> str:
    """The endpoint a replica of `data_parallel_rank` uses: a tcp port moves up by the rank,
    an ipc path gets a `_dp{rank}` suffix (vLLM's offsets). Raises ValueError on anything but
    tcp://HOST:PORT or ipc://PATH."""
    if not isinstance(endpoint, str):
        raise ValueError(f"kv_events_endpoint must be a string, got {endpoint!r}")
    m = _TCP.fullmatch(endpoint)
    if m:
        port = int(m["port"]) + data_parallel_rank
        if not 0 < int(m["port"]) <= port <= 65535:
            raise ValueError(f"kv_events_endpoint {endpoint!r}: port + data_parallel_rank "
                             f"({port}) must be in 1..65535")
        return f"tcp://{m['host']}:{port}"
    if endpoint.startswith("ipc://") and len(endpoint) > len("ipc://"):
        return endpoint if data_parallel_rank == 0 else f"{endpoint}_dp{data_parallel_rank}"
    raise ValueError(f"kv_events_endpoint must look like tcp://*:5557 (bind), "
                     f"tcp://HOST:PORT (connect) or ipc://PATH, got {endpoint!r}")


def _binds(endpoint: str) -> bool:
    # vLLM's convention: a wildcard host or a path is the stable side and binds; a named host
    # is a collector somewhere else, which the publisher connects to.
    return endpoint.startswith("ipc://") or "*" in endpoint or "::" in endpoint


class ZmqKVEventPublisher:
    """The engine's KV-event sink: `publish(events)` from the engine thread, `close()` once."""

    def __init__(self, endpoint: str, data_parallel_rank: int = 0, topic: str = "",
                 hwm: int = 100_000):
        import zmq  # only an engine that publishes needs it

        self.endpoint = kv_event_endpoint(endpoint, data_parallel_rank)
        self.data_parallel_rank = data_parallel_rank
        self._topic = topic.encode("utf-8")  # vLLM's default topic: "" (every subscriber)
        self._ctx = zmq.Context()
        self._socket = self._ctx.socket(zmq.PUB)
        self._socket.set_hwm(hwm)
        try:  # here, on the caller's thread, so that a busy port fails the engine's start
            if _binds(self.endpoint):
                self._socket.bind(self.endpoint)
            else:
                self._socket.connect(self.endpoint)
        except zmq.ZMQError as e:
            self._socket.close(linger=0)
            self._ctx.term()
            raise ValueError(f"kv_events_endpoint {self.endpoint}: {e}") from e
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        # From here on the socket belongs to the thread (ZMQ sockets are not thread-safe).
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher",
                                        daemon=True)
        self._thread.start()

    def publish(self, events: list[KVEvent]) -> None:
        """Queues one batch (stamped now); never blocks on the network."""
        if events and not self._closed:
            self._queue.put((time.time(), events))

    def close(self) -> None:
        """Sends what is queued, then closes the socket (at most CLOSE_TIMEOUT_S)."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(CLOSE_TIMEOUT_S)

    def _run(self) -> None:
        import msgspec

        from jaxserve.telemetry.kv_event_wire import encode_batch

        encoder, seq = msgspec.msgpack.Encoder(), 0
        try:
            while (item := self._queue.get()) is not None:
                ts, events = item
                # Taken even if the batch fails: the gap tells a subscriber it missed one.
                number, seq = seq, seq + 1
                try:
                    payload = encode_batch(encoder, ts, events, self.data_parallel_rank)
                    self._socket.send_multipart((self._topic, number.to_bytes(8, "big"),
                                                 payload))
                except Exception:  # noqa: BLE001 - a lost batch must not end the publisher
                    log.exception("KV-event batch %d not published", number)
        finally:
            # A short linger lets the last batches reach connected subscribers.
            self._socket.close(linger=LINGER_MS)
            self._ctx.term()


def sink(config, process_index: int = 0) -> ZmqKVEventPublisher | None:
    """The engine's KV-event sink for `config` (an EngineConfig): None without
    kv_events_endpoint, and on every process but the first of a multi-host engine (that one
    schedules; the others only follow its steps)."""
    if config.kv_events_endpoint is None or process_index != 0:
        return None
    return ZmqKVEventPublisher(config.kv_events_endpoint, config.data_parallel_rank)
