"""The Flask (WSGI) app as an ASGI app, so that an open stream holds no thread.

Under a WSGI server every response holds a worker thread until its last byte, and an SSE
stream lasts as long as its generation: a thousand clients streaming need a thousand threads
(each with its stack), and past the pool's size streams wait for a thread. Here the app is
unchanged (every route, validation and error is Flask's): its call, which returns quickly for
a stream (parsing, validation, submission, the engine's accept), runs in a bounded thread
pool; a jaxserve stream body (app.py `_Stream`, the `NonBlockingBody` below) is then driven by
the event loop: switched to non-blocking (`wake_with`), polled, and woken across threads
(loop.call_soon_threadsafe) when the engine queues one of its events. Any other body (JSON, a
static file, a non-streamed completion, which waits for its whole output) is produced in the
pool as under a WSGI server, so those still hold a pool thread while they generate.

Client disconnects: a task per request waits for ASGI's `http.disconnect`; a stream is then
closed (its request aborted, its blocks freed), and a handler still in the pool sees it through
the environ's `CLIENT_DISCONNECTED_KEY` check, as it sees waitress's.
"""

from __future__ import annotations

import asyncio
import io
import logging
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Protocol, runtime_checkable

from jaxserve.server.generation import PENDING

log = logging.getLogger("jaxserve.server")
CLIENT_DISCONNECTED_KEY = "jaxserve.client_disconnected"
_END = object()


def client_disconnected(environ) -> Callable[[], bool]:
    """The HTTP server's "has the client hung up?" check (waitress's, or this adapter's);
    under a server that has none: never."""
    return (environ.get("waitress.client_disconnected")
            or environ.get(CLIENT_DISCONNECTED_KEY) or (lambda: False))


@runtime_checkable
class NonBlockingBody(Protocol):
    """A response body an event loop can drive: after `wake_with(wake)`, next() returns
    PENDING instead of blocking, and `wake()` is called from another thread when there may
    be more."""

    def __next__(self): ...
    def wake_with(self, wake: Callable[[], None]) -> None: ...
    def close(self) -> None: ...


def _environ(scope: dict, body: bytes, gone: Callable[[], bool]) -> dict:
    """A PEP 3333 environ for an ASGI HTTP scope whose body has been read."""
    server = scope.get("server") or ("localhost", 80)
    client = scope.get("client") or ("", 0)
    env = {
        "REQUEST_METHOD": scope["method"],
        # WSGI strings are the raw bytes as latin-1 (PEP 3333); ASGI's path is UTF-8 decoded.
        "SCRIPT_NAME": scope.get("root_path", "").encode().decode("latin-1"),
        "PATH_INFO": scope["path"].encode().decode("latin-1"),
        "QUERY_STRING": scope.get("query_string", b"").decode("latin-1"),
        "SERVER_NAME": str(server[0]), "SERVER_PORT": str(server[1]),
        "SERVER_PROTOCOL": f"HTTP/{scope.get('http_version', '1.1')}",
        "REMOTE_ADDR": str(client[0]), "REMOTE_PORT": str(client[1]),
        "wsgi.version": (1, 0), "wsgi.url_scheme": scope.get("scheme", "http"),
        "wsgi.input": io.BytesIO(body), "wsgi.errors": sys.stderr,
        "wsgi.multithread": True, "wsgi.multiprocess": False, "wsgi.run_once": False,
        CLIENT_DISCONNECTED_KEY: gone,
    }
    for raw_name, raw_value in scope.get("headers", []):
        name = raw_name.decode("latin-1")
        if "_" in name:  # as waitress: HTTP_X_A would be ambiguous between X-A and X_A
            continue
        key = name.upper().replace("-", "_")
        if key not in ("CONTENT_TYPE", "CONTENT_LENGTH"):
            key = "HTTP_" + key
        value = raw_value.decode("latin-1")
        env[key] = f"{env[key]},{value}" if key in env else value
    env.setdefault("CONTENT_LENGTH", str(len(body)))
    return env


async def _read_body(receive, limit: int) -> bytes | None:
    """The request body, cut at `limit` + 1 bytes (the app answers 413 past `limit`: the
    rest is never buffered); None when the client left first."""
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        parts.append(chunk[:limit + 1 - size])
        size += len(parts[-1])
        if not message.get("more_body", False) or size > limit:
            return b"".join(parts)


def _no_write(data: bytes) -> None:
    raise NotImplementedError("the WSGI write() callable is not supported")


def _call(app, environ: dict) -> tuple[str, list, object]:
    """Runs the WSGI app (in a pool thread): (status, headers, a NonBlockingBody or the
    whole body as a list of bytes)."""
    started: list = []

    def start_response(status, headers, exc_info=None):
        # Nothing is sent before the call returns, so an error may always replace the start.
        started[:] = [status, headers]
        return _no_write

    result = app(environ, start_response)
    if isinstance(result, NonBlockingBody):
        return started[0], started[1], result
    try:
        chunks = [bytes(c) for c in result]  # a WSGI app may start the response lazily
    finally:
        close = getattr(result, "close", None)
        if close is not None:
            close()
    return started[0], started[1], chunks


class WsgiOnAsgi:
    """An ASGI app serving `app` (WSGI) with `threads` pool threads for its calls.

    `max_body_bytes` bounds what is buffered of a request body; `poll_s` is how often a
    stream with nothing new looks again anyway (a dead engine loop may queue nothing)."""

    def __init__(self, app, threads: int, max_body_bytes: int, poll_s: float):
        self._app, self._max_body, self._poll_s = app, max_body_bytes, poll_s
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="jaxserve-http")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":  # the server is configured without lifespan, websockets
            return
        body = await _read_body(receive, self._max_body)
        if body is None:
            return
        gone = threading.Event()
        woken = asyncio.Event()
        watcher = asyncio.create_task(_watch_disconnect(receive, gone, woken))
        try:
            await self._respond(_environ(scope, body, gone.is_set), send, gone, woken)
        finally:
            watcher.cancel()

    async def _respond(self, environ, send, gone: threading.Event, woken: asyncio.Event):
        loop = asyncio.get_running_loop()
        call = loop.run_in_executor(self._pool, _call, self._app, environ)
        try:
            status, headers, body = await asyncio.shield(call)
        except asyncio.CancelledError:  # the server is stopping: close what the call returns
            call.add_done_callback(_close_result)
            raise
        await send({"type": "http.response.start", "status": int(status.split(" ", 1)[0]),
                    "headers": [(k.lower().encode("latin-1"), v.encode("latin-1"))
                                for k, v in headers]})
        if isinstance(body, NonBlockingBody):
            await self._drive(body, send, gone, woken)
        else:
            await send({"type": "http.response.body", "body": b"".join(body)})

    async def _drive(self, body: NonBlockingBody, send, gone: threading.Event,
                     woken: asyncio.Event) -> None:
        """Sends the stream's chunks as they come, on the event loop (next() never blocks
        here), until it ends or the client leaves; closing it aborts what is unfinished."""
        loop = asyncio.get_running_loop()

        def wake() -> None:  # on the engine's thread
            try:
                loop.call_soon_threadsafe(woken.set)
            except RuntimeError:  # the event loop is closed: the server is gone
                pass

        try:
            body.wake_with(wake)
            while not gone.is_set():
                woken.clear()  # before polling: a wake-up after the poll is not lost
                chunk = next(body, _END)
                if chunk is _END:
                    await send({"type": "http.response.body", "body": b""})
                    return
                if chunk is PENDING:
                    try:
                        async with asyncio.timeout(self._poll_s):
                            await woken.wait()
                    except TimeoutError:
                        pass
                    continue
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            log.info("client gone: closing its stream")
        finally:
            body.close()


async def _watch_disconnect(receive, gone: threading.Event, woken: asyncio.Event) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    gone.set()
    woken.set()


def _close_result(call) -> None:
    if not call.cancelled() and call.exception() is None:
        body = call.result()[2]
        if isinstance(body, NonBlockingBody):
            body.close()
