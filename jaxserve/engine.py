"""LLMEngine: requests in, one scheduler + runner step at a time, outputs out.

The streaming API the server drives: `add_request`, `step`, `abort`,
`has_unfinished_requests`, `stats`. Plain Python around the pure-Python scheduler and block
manager; device work happens only inside the runner.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Sequence as Seq

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import backends, kv_accounting, multihost, sharding
from jaxserve.config import EngineConfig
from jaxserve.kv_cache import log_plan, plan_num_blocks
from jaxserve.outputs import RequestOutput
from jaxserve.profiling import Profiler
from jaxserve.request_state import RequestState
from jaxserve.runner import ModelRunner
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler import Scheduler, SchedulerConfig
from jaxserve.sequence import Sequence, SequenceStatus
from jaxserve.step_stats import StepStats, StepTotals
from models import Model, load_model

log = logging.getLogger("jaxserve")

CPU_KV_CACHE_BYTES = 1 << 30


def _kv_budget(config: EngineConfig, model: Model) -> int:
    if config.kv_cache_memory is not None:
        return config.kv_cache_memory
    stats = jax.local_devices()[0].memory_stats() or {}  # this process's (multi-host)
    if "bytes_limit" in stats:  # accelerators report their memory; the CPU does not
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        return int(free * config.gpu_memory_utilization)
    return CPU_KV_CACHE_BYTES


class LLMEngine:
    def __init__(self, config: EngineConfig, model: Model | None = None):
        self.config = config
        self.model = model if model is not None else load_model(config.model, config.dtype)
        # Tensor parallel: a mesh, and heads padded for it (float weights: before quantization).
        tp, self.model = sharding.setup(config.tensor_parallel_size, self.model)
        if config.quantization == "int4":
            from jaxserve.quantization import quantize_params_int4
            self.model = dataclasses.replace(self.model,
                                             params=quantize_params_int4(self.model.params))
        mc, bs = self.model.config, config.block_size
        # The budget is one device's memory, so plan with the KV heads one device holds.
        plan_mc = sharding.per_device_config(mc, tp.size) if tp else mc
        kv_dtype = np.dtype(self.model.params["embedding"].dtype if config.kv_cache_dtype == "auto"
                            else jnp.dtype(config.kv_cache_dtype))
        dtype_bytes = kv_dtype.itemsize
        num_blocks = plan_num_blocks(plan_mc, bs, dtype_bytes, _kv_budget(config, self.model))
        if jax.process_count() > 1:  # one cache shape on every host: process 0's plan
            num_blocks = multihost.agree(num_blocks)
        capacity = max(0, num_blocks - 1) * bs
        max_len = config.max_model_len or min(mc.max_position_embeddings, capacity)
        if max_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len={max_len} exceeds the model's context length "
                             f"({mc.max_position_embeddings})")
        # Raises, with the numbers, when one max_model_len sequence cannot fit the cache.
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=max_len,
            block_size=bs, num_blocks=num_blocks,
            enable_chunked_prefill=config.enable_chunked_prefill))
        log_plan(plan_mc, bs, dtype_bytes, num_blocks)
        self.max_model_len = max_len
        tok = self.model.tokenizer
        self.eos_ids = set(tok.stop_token_ids) if tok is not None else set(mc.eos_token_ids)
        linear_kind = backends.resolve(config.linear_backend)
        linear = backends.linear_backend(linear_kind)
        if tp is not None and linear_kind != "xla":  # the int4 kernel runs per shard
            linear = tp.linear(linear)
        self.runner = ModelRunner(
            self.model, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, block_size=bs,
            num_blocks=num_blocks, max_model_len=max_len, eos_ids=sorted(self.eos_ids),
            attention=backends.attention_backend(backends.resolve(config.attention_backend), mc,
                                                 bs, config.attention_backend),
            linear=linear, tp=tp, kv_cache_dtype=kv_dtype)
        self.model = self.runner.model  # with TP, the placed shards: no unsharded copy is kept
        # Multi-host: process 0 schedules and broadcasts every step; the others follow().
        self.channel = multihost.attach(self.runner)
        self.requests: dict[str, RequestState] = {}
        self._rng = np.random.default_rng(config.seed)
        self._counter = 0
        self.warmup_seconds = None
        self.profiler = Profiler(config.profile_dir)
        self.last_step: StepStats | None = None
        self.step_totals = StepTotals()
        self.kv_tracker = kv_accounting.MemoryTracker()
        if config.warmup:
            self.warmup_seconds = self.runner.warmup()
            log.info("warm-up: %d programs compiled in %.1fs", self.runner.num_compiled,
                     self.warmup_seconds)

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
                    params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Queues a request; raises ValueError (nothing queued) when it cannot be served."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs is not supported yet")
        text, ids = self._prompt_ids(prompt)
        seq = Sequence(request_id, ids, params, arrival_time=arrival_time or time.monotonic())
        self.scheduler.add(seq)  # validates length against max_model_len, duplicates, emptiness
        seed = params.seed if params.seed is not None else int(self._rng.integers(2 ** 63))
        self.requests[request_id] = RequestState(seq, text, self.model.tokenizer, seed,
                                                 seq.arrival_time)

    def abort(self, request_id: str) -> bool:
        found = self.scheduler.abort(request_id)
        self.runner.release(request_id)
        self.requests.pop(request_id, None)
        return found

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def next_request_id(self) -> str:
        self._counter += 1
        return str(self._counter)

    # ---- one step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedules, runs the model once, and returns outputs of requests that progressed."""
        with jax.profiler.StepTraceAnnotation("engine_step", step_num=self.step_totals.num_steps):
            t0 = time.perf_counter()
            with jax.profiler.TraceAnnotation("schedule"):
                out = self.scheduler.schedule()
            if out.is_empty:
                return []
            t1 = time.perf_counter()
            with jax.profiler.TraceAnnotation("execute"):
                seeds = {i.request_id: self.requests[i.request_id].seed for i in out.scheduled}
                sampled = self.runner.execute(out, seeds)
            t2 = time.perf_counter()
            with jax.profiler.TraceAnnotation("postprocess"):
                outputs = self._postprocess(out, sampled)
            self._record_step(out, len(sampled), t1 - t0, t2 - t1, time.perf_counter() - t2)
        self.profiler.on_step()
        return outputs

    def _postprocess(self, out, sampled) -> list[RequestOutput]:
        finished: dict[str, SequenceStatus] = {}
        for rid, result in sampled.items():
            reason = self.requests[rid].on_token(result, self.eos_ids)
            if reason is not None:
                finished[rid] = reason
        done = self.scheduler.update(out, {r: s.token for r, s in sampled.items()}, finished)
        done_ids = {seq.request_id for seq in done}
        outputs = []
        for rid in sampled:
            state = self.requests[rid]
            outputs.append(state.output(finished=rid in done_ids))
            if rid in done_ids:
                self.runner.release(rid)
                del self.requests[rid]
        return outputs

    def _record_step(self, out, num_sampled: int, schedule_s: float, device_s: float,
                     postprocess_s: float) -> None:
        bm = self.scheduler.block_manager
        self.last_step = StepStats(
            step=self.step_totals.num_steps, num_seqs=len(out.scheduled),
            num_prefill_seqs=len(out.prefills), num_decode_seqs=len(out.decodes),
            num_prefill_tokens=sum(i.num_new_tokens for i in out.prefills),
            num_decode_tokens=sum(i.num_new_tokens for i in out.decodes),
            num_sampled=num_sampled, num_preempted=len(out.preempted),
            kv_blocks_used=bm.num_used_blocks, schedule_s=schedule_s, device_s=device_s,
            postprocess_s=postprocess_s)
        self.step_totals.record(self.last_step)
        self.kv_tracker.observe(self.memory())

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
        """Starts a jax.profiler capture (see jaxserve/profiling.py); returns its directory."""
        return self.profiler.start(directory, num_steps)

    def stop_profile(self):
        """Stops the capture; returns the run directory holding the trace files."""
        return self.profiler.stop()

    def stats(self) -> dict:
        bm = self.scheduler.block_manager
        return {
            "kv_blocks_total": bm.num_usable_blocks,
            "kv_blocks_free": bm.num_free_blocks,
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
        }
