"""The HTTP servers the app runs on, behind one small interface: `run()` (blocks; a thread of
its own), `close()` (any thread: stop listening, end open connections, return when done) and
`effective_host` / `effective_port` (port 0 picks a free one).

"uvicorn" (the default): an asyncio server; the Flask app is wrapped by server/asgi.py, so an
open stream holds a socket and a little state but no thread. "waitress": the WSGI server the
app ran on before; every open response holds one of its `threads` worker threads.
"""

from __future__ import annotations

import logging
import socket
import threading

import uvicorn
import waitress

from jaxserve.server.asgi import WsgiOnAsgi
from jaxserve.server.config import ServerConfig

# Connections beyond the admitted requests (capacity): probes, /metrics, requests the app
# will answer 503; past capacity + threads + this, uvicorn itself answers 503 (plain text).
SPARE_CONNECTIONS = 64
# After a drain nothing should be left to wait for: open streams get this long, then end.
CLOSE_GRACE_S = 1


class WaitressServer:
    def __init__(self, app, host: str, port: int, config: ServerConfig):
        self._server = waitress.create_server(
            app, host=host, port=port, threads=config.threads,
            connection_limit=config.threads + SPARE_CONNECTIONS,
            channel_request_lookahead=1,  # lets handlers notice a client that hung up
            ident="jaxserve")
        self._running = False

    @property
    def effective_host(self) -> str:
        return self._server.effective_host

    @property
    def effective_port(self) -> int:
        return self._server.effective_port

    def run(self) -> None:
        self._running = True
        self._server.run()

    def close(self, timeout: float = 30.0) -> None:
        # Closed by the server's own thread: closing its sockets from another one races the
        # select() that thread is blocked in (an EBADF there).
        closed = threading.Event()
        done = False
        if self._running:
            try:
                self._server.trigger.pull_trigger(lambda: (self._server.close(), closed.set()))
                done = closed.wait(timeout)  # a loaded machine can take seconds
            except OSError:  # the trigger is closed already: the loop thread has ended
                pass
        if not done:
            self._server.close()  # not running, gone or stuck: close from here after all
        self._server.task_dispatcher.shutdown(timeout=1)


class UvicornServer:
    def __init__(self, app, host: str, port: int, config: ServerConfig, capacity: int):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.create_server((host, port), family=family, backlog=2048)
        self.asgi = WsgiOnAsgi(app, config.threads, config.max_body_bytes,
                               config.disconnect_poll_s)
        self._server = uvicorn.Server(uvicorn.Config(
            self.asgi, lifespan="off", ws="none", log_config=None, access_log=False,
            log_level=logging.WARNING, server_header=False, headers=[("server", "jaxserve")],
            limit_concurrency=capacity + config.threads + SPARE_CONNECTIONS,
            timeout_graceful_shutdown=CLOSE_GRACE_S, backlog=2048))
        self._done = threading.Event()
        self._started = False

    @property
    def effective_host(self) -> str:
        return self._socket.getsockname()[0]

    @property
    def effective_port(self) -> int:
        return self._socket.getsockname()[1]

    def run(self) -> None:
        self._started = True
        try:
            self._server.run(sockets=[self._socket])
        finally:
            self.asgi.close()
            self._done.set()

    def close(self, timeout: float = 30.0) -> None:
        self._server.should_exit = True  # its loop looks every 0.1 s
        if self._started:
            self._done.wait(timeout)
        self._socket.close()
        self.asgi.close()


def make_server(app, host: str, port: int, config: ServerConfig):
    """The HTTP server `config.http_server` names, serving `app` (not yet running)."""
    if config.http_server == "waitress":
        return WaitressServer(app, host, port, config)
    return UvicornServer(app, host, port, config, app.extensions["jaxserve"].capacity)
