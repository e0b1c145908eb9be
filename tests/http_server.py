"""A waitress server on an ephemeral 127.0.0.1 port in a thread, for the server tests."""

from __future__ import annotations

import contextlib
import threading
import types

from jaxserve.server import ServerConfig, create_app, make_server


@contextlib.contextmanager
def serving(loop, config: ServerConfig):
    """Serves `loop` with `config` while the block runs; yields `.url` and `.app`."""
    app = create_app(loop, config)
    server = make_server(app, "127.0.0.1", 0, config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        yield types.SimpleNamespace(url=f"http://127.0.0.1:{server.effective_port}", app=app)
    finally:
        server.close()
        server.task_dispatcher.shutdown(timeout=1)
