"""LLMEngine: requests in, one scheduler + runner step at a time, outputs out.

The streaming API the server drives: `add_request`, `step`, `abort`,
`has_unfinished_requests`, `stats`. Plain Python around the pure-Python scheduler and block
manager; device work happens only inside the runner.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Sequence as Seq

import jax
import numpy as np

from jaxserve import engine_build, spec_engine
from jaxserve.embeddings import Embeddings
from jaxserve.config import EngineConfig
from jaxserve.core import window_blocks
from jaxserve.core.admission import check_admission
from jaxserve.core.beam_search import BeamRequestState, search_params
from jaxserve.core.decision import Decision, RequestStateProtocol
from jaxserve.core.grammar import GrammarCompiler
from jaxserve.core.lora import LoRAError, LoRARequest
from jaxserve.core.outputs import RequestOutput, SampleResult
from jaxserve.core.pooling import EmbeddingRequestOutput, PoolingParams
from jaxserve.core.request_state import RequestState
from jaxserve.core.request_table import RequestTable
from jaxserve.core.sampling_params import (RequestOutputKind, SamplingParamError, SamplingParams,
                                           check_servable)
from jaxserve.core.scheduler import ScheduledSeq, SchedulerOutput
from jaxserve.core.sequence import Sequence, SequenceStatus
from jaxserve.core.step_plan import StepPlan
from jaxserve.faults import injector
from jaxserve.lora_adapters import LoRAAdapters
from jaxserve.runtime import multihost
from jaxserve.runtime.step_call import Pending
from jaxserve.structured import StructuredRequests
from jaxserve.telemetry import kv_accounting, kv_event_publisher
from jaxserve.telemetry.profiling import Profiler
from jaxserve.telemetry.step_stats import StepStats, StepTotals
from models import Model, windowed

log = logging.getLogger("jaxserve")

@dataclasses.dataclass
class _InFlight:
    """A launched step: what was scheduled, the runner's handle, and its host-side costs."""

    plan: StepPlan
    pending: Pending
    schedule_s: float
    launch_s: float = 0.0
    h2d_bytes: int = 0


NON_FINITE = "the model produced non-finite logits (NaN or inf) for this request"


class LLMEngine:
    def __init__(self, config: EngineConfig, model: Model | None = None,
                 draft_model: Model | None = None):
        """draft_model: the draft of speculative_config's "draft_model" method, already
        loaded (else loaded from speculative_config.model)."""
        self.config = config
        self.faults = injector(config.faults)  # None (no fault injection) but in tests
        self._num_step_calls = 0
        self.draft_model = draft_model
        parts = engine_build.build(config, model, self.faults)
        self.model, self.quantization = parts.model, parts.quantization
        self.scheduler, self.runner = parts.scheduler, parts.runner
        self.max_model_len, self.eos_ids = parts.max_model_len, parts.eos_ids
        tok, mc = self.model.tokenizer, self.model.config
        # Multi-host: process 0 schedules and broadcasts every step; the others follow().
        self.channel = multihost.attach(self.runner)
        if config.speculative_config is not None and jax.process_count() > 1:
            raise ValueError("speculative decoding runs on one host; multi-host serving does "
                             "not support speculative_config yet")
        # Every live request and sequence (core/request_table.py).
        self.requests = RequestTable()
        # Sequences ended or preempted whose batch slots the runner frees with the next plan.
        self._released: list[str] = []
        self.spec = spec_engine.speculation(
            config.speculative_config, requests=self.requests, scheduler=self.scheduler,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=config.max_num_batched_tokens, draft=self._draft_proposer)
        self._rng = np.random.default_rng(config.seed)
        self._counter = 0
        self.warmup_seconds = None
        self.profiler = Profiler(config.profile_dir)
        self.last_step: StepStats | None = None
        self.step_totals = StepTotals()
        self.kv_tracker = kv_accounting.MemoryTracker()
        self._inflight: _InFlight | None = None  # the step launched and not yet finished
        # Where each step's KV-cache events go (kv_events_endpoint); None: events are off.
        self.kv_event_sink = kv_event_publisher.sink(config, jax.process_index())
        # Structured output (structured.py): None when the engine does not serve it.
        self.structured = (StructuredRequests(GrammarCompiler(
            tok.to_json(), vocab_size=mc.vocab_size, eos_ids=sorted(self.eos_ids)))
            if config.structured_outputs and tok is not None else None)
        # Embedding requests (embeddings.py): None when the engine serves none.
        self.embeddings = (Embeddings(config.pooling, mc.hidden_size)
                           if config.enable_embeddings else None)
        # LoRA adapters (lora_adapters.py): None when the engine serves none.
        self.lora = (LoRAAdapters(max_loras=config.max_loras, max_cpu_loras=config.cpu_loras,
                                  load=self._load_adapter)
                     if self.runner.lora is not None else None)
        if config.warmup:
            deferred = self.structured is not None
            self.warmup_seconds = self.runner.warmup(deferred=deferred)
            log.info("warm-up: %d programs compiled in %.1fs", self.runner.num_compiled,
                     self.warmup_seconds)
            if deferred:
                self.structured.compile_masked_programs(self.runner.masked_warmup())

    @property
    def grammar(self) -> GrammarCompiler | None:
        """The grammar compiler of structured output (the server checks a request's
        constraint compiles before accepting it); None when the engine does not serve it."""
        return self.structured.compiler if self.structured is not None else None

    def _load_adapter(self, request: LoRARequest):
        """An adapter's weights for this model's slots (raises LoRAError naming the problem)."""
        from models.lora_weights import load_peft_adapter
        return load_peft_adapter(request.lora_path, self.model.config,
                                 max_rank=self.config.max_lora_rank,
                                 target_modules=self.runner.lora.targets)

    def _draft_proposer(self):
        """The draft model's proposer (speculative_config's "draft_model" method)."""
        from jaxserve.runtime.draft_model import draft_proposer
        return draft_proposer(self.config, target=self.model, draft=self.draft_model,
                              num_blocks=self.scheduler.config.num_blocks,
                              max_model_len=self.max_model_len)

    # ---- requests -------------------------------------------------------------------------

    def _prompt_ids(self, prompt: str | Seq[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            tok = self.model.tokenizer
            if tok is None:
                raise ValueError("this model has no tokenizer: pass token ids")
            bos = [tok.bos_token_id] if tok.add_bos and tok.bos_token_id is not None else []
            return prompt, bos + tok.encode(prompt)
        ids = list(prompt)
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, (int, np.integer))
               or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}); got "
                             f"{bad[:5]}{' ...' if len(bad) > 5 else ''}")
        return None, [int(t) for t in ids]

    def add_request(self, request_id: str, prompt: str | Seq[int],
                    params: SamplingParams | PoolingParams | None = None,
                    arrival_time: float | None = None, cache_salt: str | None = None,
                    priority: int = 0, lora_request: LoRARequest | None = None) -> None:
        """Queues a request; raises ValueError (nothing queued) when it cannot be served.

        Everything a step will need of the request is checked here (lengths, token ids, the
        sampler's limits), so that a bad request is refused instead of failing inside a step.
        Raises EngineOverloaded (nothing queued) beyond max_waiting_requests/_tokens.
        cache_salt: requests with different salts never share prefix-cache blocks.
        priority: lower runs first (FCFS within a priority) and is preempted last.
        lora_request: the LoRA adapter its rows run with (None: the base model); a new one is
        registered and loaded here (LoRAError, nothing queued, when its files cannot be served).
        PoolingParams make it an embedding request (engine started with enable_embeddings):
        its prompt runs, and its one output (an EmbeddingRequestOutput) holds the pooled
        final hidden states.
        """
        params = params or SamplingParams()
        pooling = isinstance(params, PoolingParams)
        if pooling:
            if self.embeddings is None:
                raise SamplingParamError("input", "this engine does not serve embeddings: "
                                                  "start it with enable_embeddings=True")
        elif not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams or PoolingParams, got "
                            f"{type(params).__name__}")
        else:
            check_servable(params, self.eos_ids)  # SamplingParamError names the field
        if not pooling and params.constrained and self.structured is None:
            raise SamplingParamError("structured_outputs", "this engine does not serve "
                                     "structured outputs (started with structured_outputs="
                                     "False, or the model has no tokenizer)")
        if self.requests.in_use(request_id):
            raise ValueError(f"request id {request_id!r} is already in use by an unfinished "
                             f"request")
        if lora_request is not None:
            if self.lora is None:
                raise LoRAError("this engine serves no LoRA adapters: start it with "
                                "enable_lora=True")
            self.lora.check(lora_request)
        text, ids = self._prompt_ids(prompt)
        compiling = self.structured.num_compiling if self.structured is not None else 0
        check_admission(self.config, self.scheduler, compiling, len(ids), priority)
        arrival = arrival_time or time.monotonic()
        lora_id = lora_request.lora_int_id if lora_request is not None else 0
        if pooling:
            state, seq = self.embeddings.new_request(
                request_id, text, ids, params, arrival_time=arrival, cache_salt=cache_salt,
                priority=priority, lora_id=lora_id)
            self._submit(state, seq, lora_request)
            self.embeddings.add(state)
            return
        beam = params.use_beam_search
        # Prompt logprobs need every prompt token's logits: nothing is taken from the prefix
        # cache (as in vLLM); the computed blocks are still registered for others.
        seq = Sequence(request_id, ids, search_params(params) if beam else params,
                       arrival_time=arrival, cache_salt=cache_salt, priority=priority,
                       lora_id=lora_id, skip_prefix_cache=params.prompt_logprobs is not None)
        if beam:
            state = BeamRequestState(seq, text, self.model.tokenizer, params, arrival,
                                     self.eos_ids)
        else:
            seed = params.seed if params.seed is not None else int(self._rng.integers(2 ** 63))
            state = RequestState(seq, text, self.model.tokenizer, seed, arrival, self.eos_ids)
        seq.num_reserved_slots = state.num_slots  # forks take them: never over max_num_seqs
        self._submit(state, seq, lora_request)

    def _submit(self, state: RequestStateProtocol, seq: Sequence,
                lora_request: LoRARequest | None) -> None:
        """add_request's last part, for every kind of request: into the scheduler (or to
        wait for its adapter) and the request table."""
        request_id = state.request_id
        if self.faults is not None:
            self.faults.on_request(state)
        self.scheduler.check(seq)  # length, duplicates, emptiness, slots
        # The adapter last: registering it is the one step that changes state when it fails.
        if lora_request is not None and not self.lora.use(request_id, lora_request):
            self.lora.wait(state, seq)  # holds no slot while its adapter is read again
        else:
            self._queue(state, seq)
        self.requests.add(state)

    def _queue(self, state: RequestStateProtocol, seq: Sequence) -> None:
        """Into the scheduler, or first into the grammar's waiting room."""
        params = seq.sampling_params  # a beam's search_params keep the request's constraint
        if params.constrained:  # waits outside the scheduler while its grammar compiles
            self.structured.submit(state, seq, params.structured_outputs)
        else:
            self.scheduler.add(seq)

    def _admit_lora(self) -> list[RequestOutput]:
        """Queues the requests whose adapter has been read; fails those whose read failed."""
        if self.lora is None or not self.lora.num_waiting:
            return []
        ready, failed = self.lora.admit()
        for waiting in ready:
            self._queue(waiting.state, waiting.seq)
        return [self._fail_waiting(w.state, w.seq, message) for w, message in failed]

    def _admit_constrained(self) -> list[RequestOutput]:
        """Schedules the constrained requests whose grammar is ready; fails those it refused."""
        if self.structured is None or not self.structured.num_compiling:
            return []
        idle = not self.scheduler.has_unfinished() and self._inflight is None
        ready, failed = self.structured.admit(idle)
        for waiting in ready:
            if self.faults is not None:
                self.faults.on_grammar(waiting.state)
            self.scheduler.add(waiting.seq)
        return [self._fail_waiting(w.state, w.seq, message) for w, message in failed]

    def _fail_waiting(self, state: RequestStateProtocol, seq: Sequence,
                      message: str) -> RequestOutput:
        """Ends a request that waited outside the scheduler (for its grammar or adapter)."""
        self._forget(state.request_id)
        self.requests.drop_sequence(seq.request_id)
        seq.status = SequenceStatus.FINISHED_ERROR
        state.fail(message)
        return state.output()

    def wait_until_warm(self, timeout: float | None = None) -> bool:
        """Waits for the programs compiled after warm-up (the structured-output variants);
        returns whether they are ready. Serving does not need this: it starts at once."""
        return self.structured is None or self.structured.wait_until_warm(timeout)

    def abort(self, request_id: str) -> bool:
        state = self._forget(request_id)
        if state is None:
            return False
        self._end_sequences(state, SequenceStatus.FINISHED_ABORTED)
        self._release_idle_slots()
        return True

    def _forget(self, request_id: str) -> RequestStateProtocol | None:
        """Drops an ended request from the request table and the features; returns its state."""
        if self.structured is not None:
            self.structured.forget(request_id)
        if self.lora is not None:
            self.lora.forget(request_id)
        if self.embeddings is not None:
            self.embeddings.forget(request_id)
        return self.requests.forget(request_id)

    def _end_sequences(self, state: RequestStateProtocol, status: SequenceStatus) -> None:
        for sid in self.requests.sequences_of(state):
            self.scheduler.abort(sid, status)
            self._released.append(sid)
            self.requests.drop_sequence(sid)

    def _new_seq_id(self, request_id: str) -> str:
        # Unique among live ids; a later user request that picks the same id is refused.
        self._counter += 1
        sid = f"{request_id}#{self._counter}"
        while self.requests.in_use(sid):
            sid += "#"
        return sid

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished() or self._inflight is not None
                or (self.structured is not None and self.structured.num_compiling > 0)
                or (self.lora is not None and self.lora.num_waiting > 0))

    def next_request_id(self) -> str:
        self._counter += 1
        return str(self._counter)

    # ---- one step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput | EmbeddingRequestOutput]:
        """Schedules and launches one model step; returns outputs of requests that progressed.

        With `async_scheduling` (the default) the step launched here runs on the device while
        the host returns the previous step's outputs and, on the next call, schedules the step
        after it: a decoding sequence's next input is taken from the device, and the host
        learns each id one call later, checking stops then (a sequence that stopped runs one
        extra token, which is dropped). Outputs are token-for-token those of the synchronous
        loop. A request that fails while its rows are prepared is finished with an error (its
        output has finish_reason "error"); the others run on.
        """
        if self.faults is not None:
            self.faults.before_step(self._num_step_calls)
        self._num_step_calls += 1
        with jax.profiler.StepTraceAnnotation("engine_step", step_num=self.step_totals.num_steps):
            t0 = time.perf_counter()
            prev, self._inflight = self._inflight, None
            outputs, wait = self._admit_lora() + self._admit_constrained(), 0.0
            if prev is not None and not self._can_commit(prev.plan.schedule):
                # Forks, beams and grammars decide on the ids: finish the previous step first.
                done, wait = self._finish(prev, committed=False)
                outputs += done
                prev = None
            with jax.profiler.TraceAnnotation("schedule"):
                if prev is not None:
                    self.scheduler.commit(prev.plan.schedule)
                drafts = (self.spec.propose(self.structured is not None
                                            and self.structured.active)
                          if self.spec is not None else {})
                out = self.scheduler.schedule()
                if drafts:
                    drafts = self.spec.after_schedule(out, drafts)
                self._released += out.preempted  # also when nothing runs this step
            t1 = time.perf_counter()
            launched = None
            if not out.is_empty:
                with jax.profiler.TraceAnnotation("launch"):
                    launched = self._launch(out, drafts, outputs, schedule_s=t1 - t0)
            if prev is not None:
                done, wait_prev = self._finish(prev, committed=True)
                outputs += done
                wait += wait_prev
            if launched is not None:
                if self.config.async_scheduling and not launched.plan.drafts:
                    self._inflight = launched
                else:
                    done, wait_now = self._finish(launched, committed=False)
                    outputs += done
                    wait += wait_now
            self._release_idle_slots()
        self._publish_kv_events()
        self.profiler.on_step()
        return outputs

    def _publish_kv_events(self) -> None:
        events = self.scheduler.block_manager.events
        if events is not None:
            batch = events.drain()  # also without a sink (a follower host): the log stays small
            if batch and self.kv_event_sink is not None:
                self.kv_event_sink.publish(batch)

    def close(self) -> None:
        """Releases what outlives a step: the KV-event publisher's socket and thread."""
        if self.lora is not None:
            self.lora.close()
        if self.kv_event_sink is not None:
            self._publish_kv_events()
            self.kv_event_sink.close()
            self.kv_event_sink = None

    def _release_idle_slots(self) -> None:
        """With no step in flight, no next plan may come soon to carry the released slots:
        they are freed now (the runner frees every slot, here or at a plan's start)."""
        if self._released and self._inflight is None:
            self.runner.release(self._released)
            self._released = []

    def _launch(self, out: SchedulerOutput, drafts: dict[str, int],
                outputs: list[RequestOutput], schedule_s: float) -> _InFlight | None:
        """Builds the step's plan and launches it; the requests that fail preparing their rows
        end with an error (added to `outputs`). None when no row is left to run."""
        t0, bytes0 = time.perf_counter(), self.runner.h2d_bytes
        seeds, failed = self._prepare_rows(out)
        if failed:
            out, errors = self._drop_failed(out, failed)
            outputs += errors
            if out.is_empty:
                return None
        released, self._released = tuple(self._released), []
        poison = (self.faults.poison(out.scheduled, self.requests.owner)
                  if self.faults is not None else None)
        lora_slots, lora_loads = (self.lora.assign(out, self.scheduler.running)
                                  if self.lora is not None else ({}, ()))
        plan = StepPlan(out, seeds, released, drafts,
                        self.structured.rows(out, self.requests)
                        if self.structured is not None else None, poison,
                        lora_slots=lora_slots, lora_loads=lora_loads,
                        pooled=self.embeddings.rows(out) if self.embeddings is not None else {})
        pending = self.runner.launch(plan)
        return _InFlight(plan, pending, schedule_s=schedule_s,
                         launch_s=time.perf_counter() - t0,
                         h2d_bytes=self.runner.h2d_bytes - bytes0)

    def _can_commit(self, out: SchedulerOutput) -> bool:
        """Whether the next step may be scheduled before `out`'s ids are known: not when a
        request of it forks branches or searches beams on them, nor when it is constrained
        (its next mask follows from the id), nor when it speculates from its last id."""
        if self.requests.waits_for_ids(out.scheduled):
            return False
        return self.spec is None or not self.spec.needs_ids(out)

    def _finish(self, step: _InFlight, committed: bool) -> tuple[list[RequestOutput], float]:
        """Waits for a launched step's ids and applies them; returns (outputs, seconds waited)."""
        t0 = time.perf_counter()
        with jax.profiler.TraceAnnotation("wait"):
            result = self.runner.collect(step.pending)
        t1 = time.perf_counter()
        with jax.profiler.TraceAnnotation("postprocess"):
            # Requests aborted (or stopped by an earlier step) since the launch: dropped, also
            # when a new request has taken the id since (its sequence is another one).
            owner, samples = self.requests.owner, result.samples
            for sid, (first, entries) in result.prompt_logprobs.items():
                if sid in owner:  # not aborted since the launch
                    owner[sid].on_prompt_logprobs(first, entries)
            items = {sid: item for item in step.pending.items
                     if (sid := item.seq.request_id) in owner
                     and not item.seq.status.is_finished}
            if len(items) < len(samples):
                samples = {sid: r for sid, r in samples.items() if sid in items}
            if result.pooled:  # before the samples: a last chunk's finishes its embedding
                self.embeddings.on_pooled(result.pooled, (i for i, _ in step.pending.pooling))
            # A row of NaN/inf logits gives a non-finite logprob (which always comes back):
            # that request alone failed; its token is not kept.
            bad = {} if result.all_finite else {
                owner[sid].request_id: NON_FINITE for sid, r in samples.items()
                if not all(math.isfinite(x.logprob) for x in r)}
            outputs = self._fail(bad) if bad else []
            if bad:
                samples = {sid: r for sid, r in samples.items() if sid in owner}
            if step.plan.drafts:
                outputs += self.spec.accept(step.plan.schedule, items, samples,
                                            step.plan.drafts, self._apply_round)
            else:
                outputs += self._postprocess(step.plan.schedule, items, samples, committed)
        t2 = time.perf_counter()
        self._record_step(step, len(samples), wait_s=t1 - t0, postprocess_s=t2 - t1)
        return outputs, t1 - t0

    def _apply_round(self, out: SchedulerOutput, items: dict[str, ScheduledSeq],
                     sampled: dict[str, list[SampleResult]]) -> list[RequestOutput]:
        """One round of a verification step's tokens (spec_engine.Apply)."""
        return self._postprocess(out, items, sampled, committed=False)

    def _prepare_rows(self, out: SchedulerOutput) -> tuple[dict[str, int], dict[str, str]]:
        """Per-row host work done before any device call, so that a failure names its request.

        Returns each row's seed, and request id -> error message for the requests that failed.
        """
        seeds, failed, owner = {}, {}, self.requests.owner
        for item in out.scheduled:
            sid = item.seq.request_id
            state = owner[sid]
            if state.request_id in failed:
                continue
            try:
                seeds[sid] = self._prepare_row(state, item)
            except Exception as e:  # noqa: BLE001 - any failure here is this request's alone
                log.exception("request %r failed preparing its step", state.request_id)
                failed.setdefault(state.request_id, f"{type(e).__name__}: {e}")
        return seeds, failed

    def _prepare_row(self, state: RequestStateProtocol, item: ScheduledSeq) -> int:
        # The sampler's limits were checked once, in add_request (params are frozen): not again
        # for every row of every step.
        return state.seed_of(item.seq.request_id)

    def _drop_failed(self, out: SchedulerOutput, failed: dict[str, str]):
        """Ends the failed requests (blocks and slots freed) and takes their rows out of `out`."""
        owner = self.requests.owner

        def kept(items: list[ScheduledSeq]) -> list[ScheduledSeq]:
            return [i for i in items if owner[i.request_id].request_id not in failed]

        out = dataclasses.replace(out, prefills=kept(out.prefills), decodes=kept(out.decodes))
        return out, self._fail(failed)

    def _fail(self, failed: dict[str, str]) -> list[RequestOutput]:
        """Ends each failed request (request id -> message): blocks and slots freed."""
        errors = []
        for rid, message in failed.items():
            state = self._forget(rid)
            self._end_sequences(state, SequenceStatus.FINISHED_ERROR)
            state.fail(message)
            errors.append(state.output())
        return errors

    def _postprocess(self, out: SchedulerOutput, items: dict[str, ScheduledSeq],
                     sampled: dict[str, list[SampleResult]],
                     committed: bool) -> list[RequestOutput]:
        """items: `out`'s scheduled items by sequence id; sampled: their samples, of which the
        first is applied (a verification step's others come as later rounds)."""
        step, progressed, failed = Decision(), {}, {}
        requests = self.requests
        owner = requests.owner
        new_id = self._new_seq_id  # one bound method for the step, not one per request
        for sid, results in sampled.items():
            state = owner[sid]
            rid = state.request_id
            if rid in failed:
                continue
            progressed[rid] = state
            try:
                state.on_sampled(items[sid], results[0], new_id, into=step)
            except Exception as e:  # noqa: BLE001 - detokenizer, grammar: this request's alone
                log.exception("request %r failed applying its token", rid)
                failed[rid] = f"{type(e).__name__}: {e}"
        errors = []
        if failed:
            step = step.without({s for s, o in owner.items() if o.request_id in failed})
            errors = self._fail(failed)
            progressed = {r: s for r, s in progressed.items() if r not in failed}
        left = self._apply(step)  # n > 1: forks off a prompt that just ran, before update
        done = self.scheduler.update(out, step.tokens, step.finished, step.hold, committed)
        ended: dict[str, list[Sequence]] = {}
        for seq in done:
            ended.setdefault(owner[seq.request_id].request_id, []).append(seq)
        # Only ended branches and beam groups act on an update: with neither (most steps) the
        # loop would skip every request.
        for rid, state in progressed.items() if ended or requests.may_wait_for_ids() else ():
            seqs = ended.get(rid)
            if seqs is None and not state.acts_on_every_update:
                continue  # on_updated would act only on ended sequences: skipped, per request
            left += self._apply(state.on_updated(seqs or [], new_id))
        for seq in done + left:
            self._released.append(seq.request_id)
            requests.drop_sequence(seq.request_id)
        outputs = errors
        for rid, state in progressed.items():
            if state.params.output_kind is RequestOutputKind.FINAL_ONLY and not state.finished:
                continue  # LLM.generate's requests: no output built until the last step
            output = state.output()
            outputs.append(output)
            if output.finished:
                self._forget(rid)
                if output.error is not None:  # a grammar rejected a token: end every branch
                    self._end_sequences(state, SequenceStatus.FINISHED_ERROR)
        return outputs

    def _apply(self, decision: Decision) -> list[Sequence]:
        """Applies a decision's structural part (see Decision for the order) through the
        scheduler; its tokens / finished / hold go to Scheduler.update. Returns the freed."""
        if not (decision.reserve or decision.forks or decision.append or decision.free):
            return []  # the common case, once per request per step
        for seq, num_slots in decision.reserve:
            self.scheduler.set_reserved_slots(seq, num_slots)
        for fork in decision.forks:
            self.scheduler.fork(fork.parent, fork.child, fork.num_computed_tokens)
            self.requests.add_sequence(fork.child.request_id, of=fork.parent.request_id)
        for seq, token in decision.append:
            self.scheduler.extend(seq, token)
        for seq, status in decision.free:
            self.scheduler.finish(seq, status)
        return [seq for seq, _ in decision.free]

    def _record_step(self, step: _InFlight, num_sampled: int, wait_s: float,
                     postprocess_s: float) -> None:
        bm, out = self.scheduler.block_manager, step.plan.schedule
        self.last_step = StepStats(
            step=self.step_totals.num_steps, num_seqs=len(out.scheduled),
            num_prefill_seqs=len(out.prefills), num_decode_seqs=len(out.decodes),
            num_prefill_tokens=sum(i.num_new_tokens for i in out.prefills),
            num_decode_tokens=len(out.decodes),  # a decode runs one token
            num_sampled=num_sampled, num_preempted=len(out.preempted),
            kv_blocks_used=bm.num_used_blocks, schedule_s=step.schedule_s,
            device_s=step.launch_s + wait_s, postprocess_s=postprocess_s, wait_s=wait_s,
            h2d_bytes=step.h2d_bytes)
        self.step_totals.record(self.last_step)
        self.kv_tracker.observe(kv_accounting.totals(
            self.scheduler.running, block_size=self.config.block_size,
            num_usable_blocks=bm.num_usable_blocks, max_model_len=self.max_model_len,
            num_used_blocks=bm.num_used_blocks))

    def reset_prefix_cache(self) -> int:
        """Drops the cached KV blocks no request holds; returns how many were dropped."""
        dropped = self.scheduler.block_manager.reset_prefix_cache()
        self._publish_kv_events()
        return dropped

    def reset_stats(self) -> None:
        """Restarts the step and memory running totals (e.g. after a warm-up pass)."""
        self.last_step, self.step_totals = None, StepTotals()
        self.kv_tracker = kv_accounting.MemoryTracker()

    def memory(self) -> kv_accounting.MemorySnapshot:
        """KV memory now: per request and in total, with the contiguous baselines."""
        bm = self.scheduler.block_manager
        return kv_accounting.snapshot(
            self.scheduler.running, block_size=self.config.block_size,
            num_usable_blocks=bm.num_usable_blocks, max_model_len=self.max_model_len,
            num_used_blocks=bm.num_used_blocks)

    def start_profile(self, directory=None, num_steps: int | None = None):
        """Starts a jax.profiler capture (see jaxserve/telemetry/profiling.py); returns its directory."""
        return self.profiler.start(directory, num_steps)

    def stop_profile(self):
        """Stops the capture; returns the run directory holding the trace files."""
        return self.profiler.stop()

    def stats(self) -> dict:
        bm = self.scheduler.block_manager
        return {
            "kv_blocks_total": bm.num_usable_blocks,
            "kv_blocks_free": bm.num_free_blocks,
            "kv_blocks_in_use": bm.num_used_blocks,
            "prefix_caching": bm.enable_caching,
            "prefix_cache_queries_blocks": bm.num_query_blocks,
            "prefix_cache_queries_tokens": bm.num_query_tokens,
            "prefix_cache_hits_blocks": bm.num_hit_blocks,
            "prefix_cache_hits_tokens": bm.num_hit_tokens,
            "prefix_cache_blocks": bm.num_cached_blocks,
            "prefix_cache_evictions": bm.cache.num_evictions,
            "cow_copies": bm.num_cow_copies,
            # Blocks of running sequences that every layer's sliding window has passed.
            "kv_blocks_slid_past": window_blocks.total_slid_past(
                self.scheduler.running, bm.block_size, windowed.model_window(self.model.config)),
            "tokens_computed": self.scheduler.num_computed_tokens,
            "prompt_tokens_computed": self.scheduler.num_computed_prompt_tokens,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_compiles_after_warmup": self.runner.num_compiles_after_warmup,
            "running": self.scheduler.num_running,
            "waiting": self.scheduler.num_waiting,
            "block_size": self.config.block_size,
            "max_model_len": self.max_model_len,
            "last_step": None if self.last_step is None else self.last_step.to_dict(),
            "step_totals": self.step_totals.to_dict(),
            "kv_memory": self.memory().to_dict(),
            "kv_memory_time_avg": self.kv_tracker.to_dict(),
            "profiling": self.profiler.active,
            "speculation": None if self.spec is None else self.spec.stats(),
            "lora": None if self.lora is None else self.lora.stats(self.scheduler.running,
                                                                  self.scheduler.waiting),
        }
