"""Runs the app on its HTTP server (server/http_server.py: uvicorn, or waitress) with one
engine thread; SIGTERM/SIGINT drain, then exit.

Drain: new requests get 503 at once, in-flight requests run to completion (bounded by
`drain_timeout_s`), then the listener closes and the process exits.
"""

from __future__ import annotations

import logging
import signal
import threading
import time

from jaxserve.server.app import create_app
from jaxserve.server.backend import Backend
from jaxserve.server.config import ServerConfig
from jaxserve.server.engine_loop import EngineLoop
from jaxserve.server.http_server import make_server

log = logging.getLogger("jaxserve.server")
# After the last response body is handed to the HTTP server, it still has to send it.
FLUSH_GRACE_S = 0.5
FAILED_STOP_TIMEOUT_S = 1.0  # how long a dead loop's thread gets to end before the exit


def page_url(server) -> str:
    """The built-in page's URL; a wildcard bind is shown as localhost (what a browser opens)."""
    host = server.effective_host
    host = "localhost" if host in ("0.0.0.0", "::", "") else host
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{server.effective_port}/"


def drain(loop: Backend, state, timeout: float) -> bool:
    """Refuses new requests and waits for in-flight ones; True if all finished in time."""
    loop.begin_drain()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if loop.in_flight() == 0 and state.active == 0:
            time.sleep(FLUSH_GRACE_S)
            return True
        time.sleep(0.05)
    return False


def serve(engine, host: str = "127.0.0.1", port: int = 8000,
          config: ServerConfig | None = None) -> int:
    """Serves `engine` until SIGTERM or SIGINT, then drains. Returns an exit code."""
    config = config or ServerConfig()
    loop = EngineLoop(engine, watchdog_timeout_s=config.watchdog_timeout_s).start()
    try:
        return serve_backend(loop, host, port, config)
    finally:
        engine.close()  # the KV-event publisher's socket and thread


def serve_backend(loop: Backend, host: str, port: int, config: ServerConfig) -> int:
    """Serves a started backend (an engine loop, a pool of replicas) until SIGTERM or SIGINT,
    then drains and stops it. Returns an exit code."""
    app = create_app(loop, config)
    server = make_server(app, host, port, config)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    threading.Thread(target=server.run, name="http-server", daemon=True).start()
    log.info("serving %s on http://%s:%s/v1", config.served_model_name, server.effective_host,
             server.effective_port)
    print(f"jaxserve: listening on http://{server.effective_host}:{server.effective_port}",
          flush=True)
    print(f"jaxserve: web page (chat playground, engine view) at {page_url(server)}", flush=True)
    failed = False
    while not stop.wait(0.5):
        if not loop.alive:
            log.error("engine loop died: %r", loop.error)
            failed = True
            break
    if failed:  # nothing will finish: fail what is left, let the responses go out, exit 1
        loop.fail_pending("the engine thread died")
        drain(loop, app.extensions["jaxserve"], min(config.drain_timeout_s, 5.0))
        drained = False
    else:
        log.info("draining: %d requests in flight", loop.in_flight())
        drained = drain(loop, app.extensions["jaxserve"], config.drain_timeout_s)
        log.info("drain %s; shutting down", "complete" if drained else "timed out")
    server.close()
    # A loop that died is not waited for: its requests have their errors already, and after
    # the watchdog its thread may be stuck in a step for good (the full join timeout would
    # only hold back the exit, and the supervisor's restart, by 10 s).
    loop.stop(timeout=FAILED_STOP_TIMEOUT_S if failed else 10.0)
    # A supervisor restarts on a non-zero status (Restart=on-failure): never 0 after a failure.
    return 0 if drained and not failed and loop.error is None else 1
