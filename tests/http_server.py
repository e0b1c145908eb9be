"""An HTTP server on an ephemeral 127.0.0.1 port in a thread, for the server tests.

JAXSERVE_TEST_HTTP_SERVER=waitress (or uvicorn) runs them on that server, whatever the test's
config says (ServerConfig.http_server)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import types

from jaxserve import EngineConfig, LLMEngine
from jaxserve.server import EngineLoop, ServerConfig, create_app, make_server
from jaxserve.testing.tiny_chat import tiny_chat_model


@contextlib.contextmanager
def tiny_chat_loop(**config):
    """A started engine loop over the tiny chat model (warm-up off, 4 sequences, contexts of
    1024 tokens unless `config` says otherwise), stopped after the block."""
    model = tiny_chat_model(seed=0)
    config = dict(dict(warmup=False, max_num_seqs=4, max_model_len=1024,
                       max_num_batched_tokens=256), **config)
    loop = EngineLoop(LLMEngine(EngineConfig(model=model.source, **config), model=model)).start()
    try:
        yield loop
    finally:
        loop.stop()


@contextlib.contextmanager
def serving(loop, config: ServerConfig):
    """Serves `loop` with `config` while the block runs; yields `.url` and `.app`."""
    chosen = os.environ.get("JAXSERVE_TEST_HTTP_SERVER")
    if chosen:
        config = dataclasses.replace(config, http_server=chosen)
    app = create_app(loop, config)
    server = make_server(app, "127.0.0.1", 0, config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        yield types.SimpleNamespace(url=f"http://127.0.0.1:{server.effective_port}", app=app)
    finally:
        server.close()
