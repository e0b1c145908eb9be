"""Host-side state of one embedding request: its pooled sums per prompt chunk, and the result.

The request is one prompt-only sequence (Sequence.prompt_only): the scheduler runs its prompt
in chunks like any prefill, and each step hands back, for each chunk, the sum of the final
hidden states the pooling takes from it (runtime/pooling.py): every token's for "mean", the
prompt's last token's for "last" (so only the last chunk has one). The step that runs the last
chunk also samples a token, as every last chunk does; that token is the scheduler's signal
that the prompt is done and is never shown.

Chunks are kept by start position: a sequence preempted and recomputed sends its chunks again
from where it restarts, and a chunk at start s replaces everything from s on, so the sum is
always over the positions of one complete run (the last chunk checks they cover the prompt).
"""

from __future__ import annotations

import time

import numpy as np

from jaxserve.core.decision import Decision, NewId
from jaxserve.core.outputs import RequestMetrics, SampleResult
from jaxserve.core.pooling import EmbeddingOutput, EmbeddingRequestOutput, PoolingParams
from jaxserve.core.sampling_params import RequestOutputKind, SamplingParams
from jaxserve.core.scheduler import ScheduledSeq
from jaxserve.core.sequence import Sequence, SequenceStatus

# The prompt-only sequence's sampling: one greedy token (the end-of-prompt signal), and no
# output before the request finishes.
PROMPT_ONLY = SamplingParams(max_tokens=1, temperature=0.0,
                             output_kind=RequestOutputKind.FINAL_ONLY)
NORM_EPS = 1e-12  # torch.nn.functional.normalize's, which vLLM's pooler uses


def embedding_sequence(request_id: str, ids: list[int], pooling: str, *, arrival_time: float,
                       cache_salt: str | None = None, priority: int = 0,
                       lora_id: int = 0) -> Sequence:
    """The scheduler's sequence of an embedding request. Mean pooling needs every prompt
    position's hidden state, which a prefix-cache hit would skip computing: it reads nothing
    from the cache (as vLLM does for poolers over all tokens); last-token pooling does, since
    the cache never holds a prompt's last token."""
    return Sequence(request_id, ids, PROMPT_ONLY, arrival_time=arrival_time,
                    cache_salt=cache_salt, priority=priority, lora_id=lora_id,
                    prompt_only=True, skip_prefix_cache=pooling == "mean")


class EmbeddingState:
    """One embedding request (RequestStateProtocol in core/decision.py), plus `on_pooled`."""

    acts_on_every_update = False
    constrained = False
    waits_for_ids = False
    speculates = False
    num_slots = 1
    num_pending_forks = 0

    def __init__(self, seq: Sequence, prompt: str | None, pooling: str,
                 params: PoolingParams, arrival_time: float):
        self.request_id, self.prompt, self.seq = seq.request_id, prompt, seq
        self.pooling, self.pooling_params = pooling, params
        self.params = seq.sampling_params  # FINAL_ONLY: the engine reports only the end
        self.prompt_token_ids = list(seq.prompt_token_ids)
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.error: str | None = None
        self._chunks: dict[int, tuple[int, np.ndarray]] = {}  # start -> (tokens, sum [D])
        self._embedding: list[float] | None = None

    def matcher_of(self, seq_id: str):
        return None

    def seed_of(self, seq_id: str) -> int:
        return 0  # its one greedy sample draws nothing

    def on_pooled(self, item: ScheduledSeq, pooled: np.ndarray) -> None:
        """`item` (a chunk of the prompt) ran; pooled [D] float32: its part of the pool."""
        start = item.start_pos
        if self.metrics.first_scheduled_time is None:
            self.metrics.first_scheduled_time = time.monotonic()
        self._chunks = {s: c for s, c in self._chunks.items() if s < start}
        self._chunks[start] = (item.num_new_tokens, pooled)

    def on_sampled(self, item: ScheduledSeq, result: SampleResult, new_id: NewId,
                   into: Decision | None = None) -> Decision:
        """The last chunk ran: the embedding is complete, and the sequence ends."""
        decision = Decision() if into is None else into
        sid = item.seq.request_id
        decision.tokens[sid] = result.token
        try:
            self._embedding = self._finish_pool(item)
            decision.finished[sid] = SequenceStatus.FINISHED_STOPPED
        except ValueError as e:
            self.error = str(e)
            decision.finished[sid] = SequenceStatus.FINISHED_ERROR
        return decision

    def _finish_pool(self, item: ScheduledSeq) -> list[float]:
        n = len(self.prompt_token_ids)
        if self.pooling == "last":
            count, pooled = self._chunks.get(item.start_pos, (0, None))
            covered = item.start_pos + count == n
        else:
            starts = sorted(self._chunks)
            covered = bool(starts) and starts[0] == 0 and all(
                a + self._chunks[a][0] == b for a, b in zip(starts, starts[1:])) and \
                starts[-1] + self._chunks[starts[-1]][0] == n
            pooled = sum(self._chunks[s][1].astype(np.float64) for s in starts) / n \
                if covered else None
        if not covered:  # a bug: the steps' chunks do not make up the prompt
            raise ValueError(f"the pooled chunks of {self.request_id!r} do not cover its "
                             f"{n} prompt tokens: {sorted(self._chunks)}")
        self._chunks = {}
        vec = np.asarray(pooled, np.float64)
        if not np.isfinite(vec).all():
            raise ValueError("the model produced non-finite hidden states (NaN or inf) for "
                             "this request")
        if self.pooling_params.normalize:
            vec = vec / max(float(np.linalg.norm(vec)), NORM_EPS)
        return vec.astype(np.float32).tolist()

    def on_updated(self, finished: list[Sequence], new_id: NewId) -> Decision:
        return Decision()

    def fail(self, message: str) -> None:
        self.error = message

    @property
    def finished(self) -> bool:
        return self.error is not None or self._embedding is not None

    def output(self) -> EmbeddingRequestOutput:
        finished = self.finished
        if finished:
            self.metrics.finished_time = time.monotonic()
        outputs = EmbeddingOutput(self._embedding) if self._embedding is not None and \
            self.error is None else None
        return EmbeddingRequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                                      outputs, finished, self.metrics, self.error)
