"""A waitress server on an ephemeral 127.0.0.1 port in a thread, for the server tests."""

from __future__ import annotations

import contextlib
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
    app = create_app(loop, config)
    server = make_server(app, "127.0.0.1", 0, config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        yield types.SimpleNamespace(url=f"http://127.0.0.1:{server.effective_port}", app=app)
    finally:
        # Closed by the server's own thread: closing its sockets from this one races the
        # select() that thread is blocked in (an EBADF there, a warning in the test run).
        closed = threading.Event()
        try:
            server.trigger.pull_trigger(lambda: (server.close(), closed.set()))
            done = closed.wait(30)  # a loaded machine (tests beside CI) can take seconds
        except OSError:  # the trigger is closed already: the loop thread has ended
            done = False
        if not done:
            server.close()  # the loop thread is gone or stuck: close from here after all
        server.task_dispatcher.shutdown(timeout=1)
