"""POST /v1/embeddings: one engine request per input (PoolingParams), run in the same engine
loop and batches as generation; the response is OpenAI's `{"object": "list", "data": [...],
"model", "usage"}` (with vLLM's `id` and `created`).

Runs in the handler thread, as a generation does (server/generation.py): submit the inputs,
wait for each one's final output, abort whatever is unfinished when the client goes away or an
error ends the request.
"""

from __future__ import annotations

import base64
import queue
import time
import uuid

import numpy as np
from flask import Flask, jsonify, request

from jaxserve.core.pooling import EmbeddingRequestOutput
from jaxserve.server.asgi import client_disconnected
from jaxserve.server.backend import Accepted
from jaxserve.server.embedding_protocol import MAX_INPUTS, EmbeddingRequest, parse_embedding
from jaxserve.server.engine_loop import Event, SubRequest
from jaxserve.server.errors import unavailable
from jaxserve.server.fields import parse_json
from jaxserve.server.generation import ClientGone


def register_embedding_routes(app: Flask, state) -> None:
    @app.post("/v1/embeddings")
    def embeddings():
        body = parse_json(request.get_data(cache=False))
        adapter = state.models.resolve(body.get("model") if isinstance(body, dict) else None)
        req = parse_embedding(body, state.info, state.loop.model.embedding_size,
                              min(MAX_INPUTS, state.capacity))
        t0 = time.monotonic()
        outputs = _run(state, req, adapter)
        state.metrics.e2e.observe(time.monotonic() - t0)
        state.metrics.prompt_tokens.inc(sum(len(ids) for ids in req.inputs))
        name = adapter.lora_name if adapter is not None else state.config.served_model_name
        return jsonify(_response(req, outputs, name))


def _run(state, req: EmbeddingRequest, adapter) -> list[EmbeddingRequestOutput]:
    """Each input's final output, in input order; raises the engine's refusal or failure."""
    base = f"embd-{uuid.uuid4().hex}"
    subs = [SubRequest(f"{base}-{i}", ids, req.params, i, lora_request=adapter)
            for i, ids in enumerate(req.inputs)]
    disconnected = client_disconnected(request.environ)
    events = state.loop.submit(subs, state.capacity, state.config.max_waiting_tokens)  # or 503
    results: list[EmbeddingRequestOutput | None] = [None] * len(subs)
    open_ = set(range(len(subs)))
    state.enter()
    try:
        item = _next(state, events, disconnected)
        while open_:
            if isinstance(item, Event):
                if item.error is not None:
                    open_.clear()  # the engine loop took back or ended them all
                    raise item.error
                if item.output.finished:
                    results[item.index] = item.output
                    open_.discard(item.index)
            if open_:
                item = _next(state, events, disconnected)
        return results
    finally:
        if open_:
            state.loop.abort([subs[i].request_id for i in sorted(open_)])
        state.leave()


def _next(state, events: queue.SimpleQueue, disconnected) -> Event | Accepted:
    while True:
        try:
            return events.get(timeout=state.config.disconnect_poll_s)
        except queue.Empty:
            if disconnected():
                raise ClientGone() from None
            if not state.loop.alive:
                raise unavailable("the engine is not running", "engine_unavailable") from None


def _encode(embedding: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # OpenAI's: the float32 values' little-endian bytes
        return base64.b64encode(np.asarray(embedding, "<f4").tobytes()).decode("ascii")
    return embedding


def _response(req: EmbeddingRequest, outputs: list[EmbeddingRequestOutput],
              model: str) -> dict:
    tokens = sum(len(ids) for ids in req.inputs)
    return {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": model,
            "data": [{"object": "embedding", "index": i,
                      "embedding": _encode(out.outputs.embedding, req.encoding_format)}
                     for i, out in enumerate(outputs)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
