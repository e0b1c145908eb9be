"""Server configuration: one frozen dataclass, validated with messages a user can act on."""

from __future__ import annotations

import dataclasses

from jaxserve.core.sampling_params import MAX_LOGPROBS, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from jaxserve.server.reasoning import check_parser_name

HTTP_SERVERS = ("uvicorn", "waitress")  # server/http_server.py


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """How the HTTP layer admits and bounds requests (the engine has its own EngineConfig).

    `max_waiting_requests` bounds requests accepted beyond the engine's `max_num_seqs` running
    slots; past it new requests get 503 instead of queueing without limit.

    `http_server`: "uvicorn" (asyncio; an open stream holds no thread, server/asgi.py) or
    "waitress" (WSGI; every open response holds a thread). `threads` is the pool that runs
    the app's handlers: under uvicorn a stream holds one only until it is accepted, but a
    non-streamed generation holds one until it is done; under waitress every open response
    holds one, so it should then exceed the concurrent clients you expect.
    """

    served_model_name: str = "smollm2-135m"
    api_key: str | None = None
    max_waiting_requests: int = 128
    # Prompt tokens of accepted requests not yet prefilled; beyond it 503 (one request is
    # always accepted into an empty queue, however long). None: unbounded.
    max_waiting_tokens: int | None = None
    # Fail the engine (health 503, serve exits 1) after this long with work and no progress.
    watchdog_timeout_s: float | None = None
    max_n: int = 16
    max_logprobs: int = MAX_LOGPROBS
    max_stop_strings: int = MAX_STOP_STRINGS
    max_stop_string_chars: int = MAX_STOP_STRING_CHARS
    max_body_bytes: int = 4 << 20
    threads: int = 64
    http_server: str = "uvicorn"
    drain_timeout_s: float = 60.0
    # How often a handler waiting for tokens checks that its client is still connected.
    disconnect_poll_s: float = 0.5
    # GET /tokenizer_info (vLLM's flag): off by default, as in vLLM, since it shows the chat
    # template; lm-evaluation-harness's remote tokenizer needs it.
    enable_tokenizer_info_endpoint: bool = False
    # Chat outputs' <think>...</think> part as reasoning_content (server/reasoning.py):
    # "none", or vLLM's names of that format, "qwen3" / "deepseek_r1".
    reasoning_parser: str = "none"
    # POST /v1/responses with store: true keeps this many responses in memory (least recently
    # used first out) for previous_response_id and GET /v1/responses/{id}; 0: none (vLLM's
    # default: store: true is then answered as store: false).
    max_stored_responses: int = 0

    def __post_init__(self):
        if not isinstance(self.served_model_name, str) or not self.served_model_name:
            raise ValueError("served_model_name must be a non-empty string")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError("api_key must be a non-empty string or None")
        for name in ("max_n", "max_stop_strings", "max_stop_string_chars", "max_body_bytes",
                     "threads"):
            _positive_int(name, getattr(self, name))
        if isinstance(self.max_waiting_requests, bool) or not isinstance(
                self.max_waiting_requests, int) or self.max_waiting_requests < 0:
            raise ValueError("max_waiting_requests must be an integer >= 0, got "
                             f"{self.max_waiting_requests!r}")
        if self.max_waiting_tokens is not None:
            _positive_int("max_waiting_tokens", self.max_waiting_tokens)
        w = self.watchdog_timeout_s
        if w is not None and (isinstance(w, bool) or not isinstance(w, (int, float)) or w <= 0):
            raise ValueError(f"watchdog_timeout_s must be a positive number of seconds or "
                             f"None, got {w!r}")
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"max_logprobs must be in [0, {MAX_LOGPROBS}] (the sampler's "
                             f"limit), got {self.max_logprobs!r}")
        if self.max_stop_strings > MAX_STOP_STRINGS or \
                self.max_stop_string_chars > MAX_STOP_STRING_CHARS:
            raise ValueError(f"the engine allows at most {MAX_STOP_STRINGS} stop strings of "
                             f"{MAX_STOP_STRING_CHARS} characters")
        if not isinstance(self.enable_tokenizer_info_endpoint, bool):
            raise ValueError("enable_tokenizer_info_endpoint must be a boolean, got "
                             f"{self.enable_tokenizer_info_endpoint!r}")
        check_parser_name(self.reasoning_parser)
        if self.http_server not in HTTP_SERVERS:
            raise ValueError(f"http_server must be one of {', '.join(HTTP_SERVERS)}, got "
                             f"{self.http_server!r}")
        m = self.max_stored_responses
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise ValueError(f"max_stored_responses must be an integer >= 0, got {m!r}")
        for name in ("drain_timeout_s", "disconnect_poll_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
