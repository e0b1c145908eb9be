"""The engine's embedding requests (EngineConfig.enable_embeddings): what LLMEngine asks of them.

An embedding request is a prompt-only sequence in the same scheduler as generation (chunked
prefill, preemption, the batch slots), with an EmbeddingState (core/embedding_state.py) as its
request state. Each step the engine asks `rows` which of the scheduled rows pool (the plan's
`pooled`, so the runner runs the pooled program only then), and hands the pooled sums that
come back to `on_pooled` before the step's samples are applied (a last chunk's sample finishes
its request, whose pool must be complete by then).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from jaxserve.core.embedding_state import EmbeddingState, embedding_sequence
from jaxserve.core.pooling import PoolingParams
from jaxserve.core.scheduler import ScheduledSeq, SchedulerOutput
from jaxserve.core.sequence import Sequence


class Embeddings:
    def __init__(self, pooling: str, hidden_size: int):
        self.pooling, self.hidden_size = pooling, hidden_size
        self._live: dict[str, EmbeddingState] = {}  # request id (= its sequence's) -> state

    @property
    def num_live(self) -> int:
        return len(self._live)

    def new_request(self, request_id: str, prompt: str | None, ids: list[int],
                    params: PoolingParams, *, arrival_time: float, cache_salt: str | None,
                    priority: int, lora_id: int) -> tuple[EmbeddingState, Sequence]:
        """The request's state and sequence; raises SamplingParamError (nothing kept) when
        the model cannot give this embedding. `add` it once the engine has accepted it."""
        params.check(self.hidden_size)
        seq = embedding_sequence(request_id, ids, self.pooling, arrival_time=arrival_time,
                                 cache_salt=cache_salt, priority=priority, lora_id=lora_id)
        return EmbeddingState(seq, prompt, self.pooling, params, arrival_time), seq

    def add(self, state: EmbeddingState) -> None:
        self._live[state.request_id] = state

    def forget(self, request_id: str) -> None:
        self._live.pop(request_id, None)

    def rows(self, out: SchedulerOutput) -> dict[str, str]:
        """The step's embedding rows: sequence id -> pooling (StepPlan.pooled)."""
        live = self._live
        if not live:
            return {}  # most steps: no row is looked at
        return {sid: self.pooling for item in out.scheduled if (sid := item.seq.request_id)
                in live}

    def on_pooled(self, pooled: Mapping[str, np.ndarray], items: Iterable[ScheduledSeq]) -> None:
        """A finished step's pooled sums (StepResult.pooled) of its pooling `items`; those of
        requests ended since the launch are dropped."""
        live = self._live
        for item in items:
            state = live.get(item.seq.request_id)
            if state is not None and state.seq is item.seq and not item.seq.status.is_finished:
                state.on_pooled(item, pooled[item.seq.request_id])
