"""The Flask app factory: OpenAI-compatible routes over a backend (server/backend.py): the
engine thread of this process, or a pool of engine replicas.

`create_app(backend, config)` builds an app with its own state (no globals): the backend,
the config, a per-app Prometheus registry and a count of responses still being written (so a
drain can wait for them).
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
from typing import Callable

from flask import Flask, Response, jsonify, request
from werkzeug.exceptions import HTTPException

from jaxserve.server.asgi import client_disconnected
from jaxserve.server.config import ServerConfig
from jaxserve.server.embedding_routes import register_embedding_routes
from jaxserve.server.backend import Backend
from jaxserve.server.errors import ApiError, invalid, unavailable
from jaxserve.server.fields import parse_json
from jaxserve.server.generation import ClientGone, Generation
from jaxserve.server.lora_routes import register_lora_routes
from jaxserve.server.metrics import ServerMetrics
from jaxserve.server.openapi import register_openapi_routes
from jaxserve.server.profile_routes import register_profile_routes
from jaxserve.server.protocol import ModelInfo, parse_chat, parse_completion
from jaxserve.server.responses import Responder
from jaxserve.server.responses_routes import register_responses_routes
from jaxserve.server.served_models import ServedModels
from jaxserve.server.structured import check_compiles
from jaxserve.server.tokenize_routes import register_tokenize_routes
from jaxserve.server.ui_routes import register_ui_routes

log = logging.getLogger("jaxserve.server")
HTTP_ERROR_TYPES = {404: "not_found_error", 405: "invalid_request_error",
                    413: "invalid_request_error"}
# The only routes served without the API key when one is set: liveness for a supervisor and
# the web page's static files (which hold no data). Every other route, including any added
# later, needs the key: default deny (tests/server/test_server_security.py walks the url_map).
OPEN_ENDPOINTS = frozenset({"health", "index", "ui_file"})
# Names the engine replica that served a response (absent with one engine in this process).
REPLICA_HEADER = "x-jaxserve-replica"


class ServerState:
    def __init__(self, loop: Backend, config: ServerConfig):
        self.loop, self.config = loop, config
        self.metrics = ServerMetrics(loop)
        model = loop.model
        self.info = ModelInfo(model.tokenizer, model.vocab_size, model.max_model_len)
        self.models = ServedModels(config.served_model_name, model)  # base + LoRA adapters
        self.capacity = model.max_num_seqs + config.max_waiting_requests
        # Thread-safe: handlers compile constraints through it (None: no structured outputs).
        self.grammar = model.grammar
        self._lock = threading.Lock()
        self._active = 0  # responses being produced (a drain waits for them)

    def enter(self) -> None:
        with self._lock:
            self._active += 1

    def leave(self) -> None:
        with self._lock:
            self._active -= 1

    @property
    def active(self) -> int:
        with self._lock:
            return self._active

    def decode(self, token_id: int) -> str:
        tok = self.info.tokenizer
        return tok.decode([token_id]) if tok is not None else str(token_id)


def _error_response(err: ApiError, state: ServerState) -> Response:
    state.metrics.errors.labels(status=str(err.status)).inc()
    return Response(json.dumps(err.body()), status=err.status, mimetype="application/json",
                    headers=err.headers)


def _json_body():
    return parse_json(request.get_data(cache=False))


def _check_api_key(config: ServerConfig) -> None:
    if config.api_key is None or request.endpoint in OPEN_ENDPOINTS:
        return
    if request.url_rule is None and not request.path.startswith("/v1"):
        return  # no such route: a 404 follows (under /v1, the key is asked for first)
    header = request.headers.get("Authorization", "")
    given = header[7:] if header.startswith("Bearer ") else ""
    # Constant time: how long the comparison takes says nothing about the key.
    if not hmac.compare_digest(given.encode(), config.api_key.encode()):
        raise ApiError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                       type="authentication_error", code="invalid_api_key")


def _generate(state: ServerState, chat: bool) -> Response:
    body = _json_body()
    adapter = state.models.resolve(body.get("model") if isinstance(body, dict) else None)
    req = (parse_chat if chat else parse_completion)(body, state.config, state.info)
    return _serve(state, req, adapter, lambda gen, name: Responder(gen, name, state.decode))


def _serve(state: ServerState, req, adapter, make) -> Response:
    """Runs `req` and answers with `make(generation, model name)`'s full() as JSON, or with
    its stream() as server-sent events when the request streams."""
    slots = state.loop.model.max_num_seqs
    if req.n > slots:  # each branch holds a batch slot for the whole request
        raise invalid(f"'n' must be at most {slots} on this server (the sequences it runs at "
                      f"once), got {req.n}", "n")
    if req.params.structured_outputs is not None:  # a 400 now, not a failure in the engine
        check_compiles(state.grammar, req.params.structured_outputs, req.constraint_param)
    disconnected = client_disconnected(request.environ)
    gen = Generation(state.loop, state.metrics, req, state.capacity,
                     state.config.disconnect_poll_s, disconnected,
                     state.config.max_waiting_tokens, adapter)
    state.enter()
    handed_over = False  # once the stream body exists, its close() does the cleanup
    try:
        gen.wait_accepted()
        name = adapter.lora_name if adapter is not None else state.config.served_model_name
        responder = make(gen, name)
        replica = {REPLICA_HEADER: gen.replica} if gen.replica is not None else {}
        if not req.stream:
            response = jsonify(responder.full())
            response.headers.update(replica)
            return response
        body = _Stream(responder, state)
        handed_over = True
        # direct_passthrough: the WSGI server gets the _Stream itself (not werkzeug's wrapper
        # around it), so an ASGI server can drive it without a thread (wake_with).
        return Response(body, mimetype="text/event-stream", direct_passthrough=True,
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                 **replica})
    finally:
        if not handed_over:
            gen.close()
            state.leave()


class _Stream:
    """The SSE body. A class, not a generator: the WSGI server calls close() even when it
    never started iterating, and that must still abort the request and end the count.
    `responder` is a Responder or a ResponseFormatter (its `gen` and `stream()`).

    A WSGI server iterates it, a thread blocking while tokens are awaited; the ASGI adapter
    (server/asgi.py) calls `wake_with` first, and then next() gives PENDING instead of
    blocking, and the callback says when to try again."""

    def __init__(self, responder, state: ServerState):
        self._responder, self._state = responder, state
        self._chunks = responder.stream()
        self._closed = False

    def __iter__(self):
        return self

    def __next__(self) -> bytes:
        return next(self._chunks)

    def wake_with(self, wake: Callable[[], None]) -> None:
        self._responder.gen.wake_with(wake)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._chunks.close()
            self._responder.gen.close()
            self._state.leave()


def _register_routes(app: Flask, state: ServerState) -> None:
    @app.post("/v1/completions")
    def completions():
        return _generate(state, chat=False)

    @app.post("/v1/chat/completions")
    def chat_completions():
        return _generate(state, chat=True)

    @app.get("/v1/models")
    def models():
        return jsonify({"object": "list",
                        "data": state.models.cards(state.info.max_model_len)})

    @app.get("/health")
    def health():
        if not state.loop.alive:
            raise unavailable("the engine loop is not running", "engine_unavailable")
        if state.loop.draining:
            raise unavailable("the server is shutting down", "server_draining")
        return jsonify(state.loop.health())

    @app.get("/metrics")
    def metrics():
        return Response(state.metrics.render(), mimetype="text/plain; version=0.0.4")


def _register_errors(app: Flask, state: ServerState) -> None:
    app.before_request(lambda: _check_api_key(state.config))

    @app.errorhandler(ApiError)
    def api_error(err: ApiError):
        return _error_response(err, state)

    @app.errorhandler(ClientGone)
    def client_gone(_):
        return Response(status=499)  # nobody is listening; the sub-requests were aborted

    @app.errorhandler(HTTPException)
    def http_error(err: HTTPException):
        code = err.code or 500
        # Werkzeug's own headers, but for its HTML content type: a 405's `Allow` (RFC 9110
        # requires it), a 416's Content-Range.
        headers = {k: v for k, v in err.get_headers() if k.lower() != "content-type"}
        return _error_response(ApiError(code, err.description or err.name,
                                        type=HTTP_ERROR_TYPES.get(code, "invalid_request_error"),
                                        code=err.name.lower().replace(" ", "_"),
                                        headers=headers), state)

    @app.errorhandler(Exception)
    def internal_error(err: Exception):
        log.exception("unexpected error")
        return _error_response(ApiError(500, "internal server error", type="server_error"),
                               state)


def create_app(backend: Backend, config: ServerConfig | None = None) -> Flask:
    """An OpenAI-compatible Flask app serving `backend` (an EngineLoop, started, or a pool)."""
    config = config or ServerConfig()
    state = ServerState(backend, config)
    app = Flask("jaxserve", static_folder=None)  # the page's files are served by ui_routes
    app.config["MAX_CONTENT_LENGTH"] = config.max_body_bytes
    app.json.sort_keys = False
    app.extensions["jaxserve"] = state
    _register_routes(app, state)
    register_profile_routes(app, state)
    register_lora_routes(app, state)
    register_tokenize_routes(app, state)
    register_embedding_routes(app, state)
    register_ui_routes(app, state)
    register_openapi_routes(app, state)
    register_responses_routes(app, state, lambda *args: _serve(state, *args))
    _register_errors(app, state)
    return app
