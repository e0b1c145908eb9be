"""An HTTP server on an ephemeral 127.0.0.1 port in a thread, for the server tests.

JAXSERVE_TEST_HTTP_SERVER=waitress (or uvicorn) runs them on that server, whatever the test's
config says (ServerConfig.http_server)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import threading
import time
import types

from jaxserve import EngineConfig, LLMEngine
from jaxserve.server import EngineLoop, ServerConfig, create_app, make_server
from jaxserve.testing.tiny_chat import tiny_chat_model


@contextlib.contextmanager
def tiny_chat_loop(chat_template: str | None = None, **config):
    """A started engine loop over the tiny chat model (warm-up off, 4 sequences, contexts of
    1024 tokens unless `config` says otherwise; its ChatML template unless `chat_template`
    gives another), stopped after the block."""
    model = tiny_chat_model(seed=0)
    if chat_template is not None:
        model = dataclasses.replace(model, tokenizer=model.tokenizer.with_chat_template(
            chat_template))
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


def start_server_process(cmd: list[str], env: dict, timeout_s: float):
    """Starts `jaxserve serve` (`cmd`) and waits until it prints its address; returns (process,
    its base URL). Kills it and fails the test if it does not listen within `timeout_s`."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
                            text=True)
    deadline = time.monotonic() + timeout_s
    for line in proc.stdout:  # the server prints its address once it is listening
        if "listening on " in line:
            return proc, line.split("listening on ")[1].strip()
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise AssertionError(f"server did not start (rc={proc.poll()})")


def openai_client(server):
    """The official `openai` client on a `serving` server: no retries (a failure shows at once),
    a timeout long enough for a first-use compile."""
    import openai
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                         timeout=120)


def chat_stream(client, model: str, **kw):
    """A streamed chat completion through the `openai` client, gathered: (reasoning_content,
    content, tool calls as {index: [name, arguments]}, finish reason, the delta kinds in order)."""
    reasoning, content, calls, finish, order = "", "", {}, None, []
    for chunk in client.chat.completions.create(model=model, stream=True, **kw):
        for c in chunk.choices:
            extra = c.delta.model_extra or {}
            if extra.get("reasoning_content"):
                reasoning += extra["reasoning_content"]
                order.append("reasoning")
            if c.delta.content:
                content += c.delta.content
                order.append("content")
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, ["", ""])
                entry[0] += d.function.name or ""
                entry[1] += d.function.arguments or ""
                order.append("tool_call")
            finish = c.finish_reason or finish
    return reasoning, content, calls, finish, order
