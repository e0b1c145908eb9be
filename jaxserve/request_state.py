"""Host-side state of one request: incremental detokenization and stop conditions."""

from __future__ import annotations

import time

from jaxserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxserve.runner import SampleResult
from jaxserve.sampling_params import SamplingParams
from jaxserve.sequence import Sequence, SequenceStatus
from models.tokenizer import IncrementalDetokenizer, Tokenizer

FINISH_REASONS = {SequenceStatus.FINISHED_STOPPED: "stop",
                  SequenceStatus.FINISHED_LENGTH: "length",
                  SequenceStatus.FINISHED_ABORTED: "abort"}


class RequestState:
    def __init__(self, seq: Sequence, prompt: str | None, tokenizer: Tokenizer | None,
                 seed: int, arrival_time: float):
        self.seq, self.prompt, self.seed = seq, prompt, seed
        self.params: SamplingParams = seq.sampling_params
        self.tokenizer = tokenizer
        self.detok = (IncrementalDetokenizer(tokenizer, seq.prompt_token_ids,
                                             skip_special_tokens=self.params.skip_special_tokens)
                      if tokenizer is not None else None)
        self.text = ""
        self.emitted_chars = 0  # of self.text, already handed out as delta_text
        self.emitted_tokens = 0
        self.logprobs: list[dict[int, float]] | None = [] if self.params.logprobs is not None \
            else None
        self.cumulative_logprob = 0.0
        self.stop_reason: int | str | None = None
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self._hold = max((len(s) for s in self.params.stop), default=1) - 1
        self._stop_ids = set(self.params.stop_token_ids)

    def on_token(self, result: SampleResult, eos_ids: set[int]) -> SequenceStatus | None:
        """Records a sampled token; returns FINISHED_STOPPED if it ends the request.

        eos_ids: the engine's end-of-sequence ids (tokenizer stop tokens, else the config's).
        """
        now = time.monotonic()
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now
        token, p = result.token, self.params
        self.cumulative_logprob += result.logprob
        if self.logprobs is not None:
            self.logprobs.append({token: result.logprob, **(result.top or {})})
        n_out = self.seq.num_output_tokens + 1  # counting this token
        min_reached = n_out >= p.min_tokens
        if token in self._stop_ids and min_reached:
            self.stop_reason = token
            return SequenceStatus.FINISHED_STOPPED
        is_eos = token in eos_ids
        if is_eos and not p.ignore_eos and min_reached:
            return SequenceStatus.FINISHED_STOPPED  # EOS: not part of the text
        if self.detok is not None:
            before = len(self.text)
            self.text += self.detok.add(token)
            if p.stop and min_reached and self._check_stop_strings(before):
                return SequenceStatus.FINISHED_STOPPED
        return None

    def _check_stop_strings(self, before: int) -> bool:
        # Only a match ending in the new text is new: it starts at most len(stop) - 1 characters
        # before what this token appended.
        start = max(0, before - self._hold)
        best = None
        for s in self.params.stop:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        self.text = self.text[:best[0]]
        self.stop_reason = best[1]
        return True

    def output(self, finished: bool) -> RequestOutput:
        """The request's output so far; delta fields hold what is new since the last call."""
        if finished and self.detok is not None and self.stop_reason is None:
            self.text += self.detok.flush()
        # While running, hold back a tail that could still grow into a stop string.
        visible = len(self.text) if finished else max(self.emitted_chars,
                                                      len(self.text) - self._hold)
        token_ids = list(self.seq.output_token_ids)
        delta_text = self.text[self.emitted_chars:visible]
        delta_ids = token_ids[self.emitted_tokens:]
        self.emitted_chars, self.emitted_tokens = visible, len(token_ids)
        status = self.seq.status
        completion = CompletionOutput(
            index=0, text=self.text[:visible], token_ids=token_ids,
            finish_reason=FINISH_REASONS.get(status) if finished else None,
            stop_reason=self.stop_reason, logprobs=self.logprobs,
            cumulative_logprob=self.cumulative_logprob, delta_text=delta_text,
            delta_token_ids=delta_ids)
        if finished:
            self.metrics.finished_time = time.monotonic()
        return RequestOutput(request_id=self.seq.request_id, prompt=self.prompt,
                             prompt_token_ids=list(self.seq.prompt_token_ids),
                             outputs=[completion], finished=finished, metrics=self.metrics)
