"""What the HTTP layer needs from whatever runs the model: one engine thread in this process
(`EngineLoop`) or a pool of engine replicas on Ray Serve (`jaxserve.distributed.pool`).

The app reads the model's facts once (`ServedModel`) and talks to the backend only through
`Backend`: handlers never reach into an engine, so the same routes, streams and errors serve
both.
"""

from __future__ import annotations

import dataclasses
import queue
from typing import Protocol

from jaxserve.core.lora import LoRARequest


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """The served model and engine limits request validation needs (read-only)."""

    tokenizer: object            # models.tokenizer.Tokenizer, or None (token-id prompts only)
    vocab_size: int
    max_model_len: int
    max_num_seqs: int            # sequences one engine runs at once (bounds `n`)
    block_size: int
    grammar: object = None       # a thread-safe GrammarCompiler, or None: no structured outputs
    profiler: object = None      # the engine's Profiler where one process can be profiled
    # The engine's LoRA adapter registry (jaxserve/lora_adapters.py LoRAAdapters: thread-safe
    # add / remove / get / adapters), or None: no adapters (no enable_lora, or replicas).
    lora: object = None
    # The embeddings' length (the model's hidden size) when the engine serves embeddings
    # (enable_embeddings), else None (also behind a replica pool, which does not yet).
    embedding_size: int | None = None

    @classmethod
    def of(cls, engine) -> "ServedModel":
        size = engine.embeddings.hidden_size if engine.embeddings is not None else None
        return cls(engine.model.tokenizer, engine.model.config.vocab_size,
                   engine.max_model_len, engine.config.max_num_seqs, engine.config.block_size,
                   engine.grammar, engine.profiler, engine.lora, size)

    def adapter(self, name: str) -> LoRARequest | None:
        """The registered LoRA adapter called `name`, or None (none such, or no adapters)."""
        return self.lora.get(name) if self.lora is not None else None


@dataclasses.dataclass(frozen=True)
class Accepted:
    """First item on a group's queue once every sub-request is queued; `replica` names the
    engine replica that took the group (None: the one engine of this process)."""

    replica: str | None = None


class Backend(Protocol):
    """The surface the app uses (EngineLoop implements it; so does the Ray replica pool)."""

    model: ServedModel

    @property
    def alive(self) -> bool: ...
    @property
    def draining(self) -> bool: ...
    @property
    def error(self) -> BaseException | None: ...
    def begin_drain(self) -> None: ...
    def in_flight(self) -> int: ...
    def stats(self) -> dict: ...
    def engine_state(self) -> dict | None: ...
    @property
    def snapshot_error(self) -> Exception | None: ...
    def health(self) -> dict: ...
    # Events go to `out` (anything with a thread-safe `put`) when given, else to a new queue.
    def submit(self, subs: list, capacity: int, max_queued_tokens: int | None = None,
               out=None) -> queue.SimpleQueue: ...
    def abort(self, request_ids: list[str]) -> None: ...
    def fail_pending(self, message: str) -> None: ...
    def stop(self, timeout: float = 10.0) -> None: ...
