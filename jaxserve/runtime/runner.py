"""The model runner: the one place that turns scheduler decisions into device arrays.

Every engine iteration is one ragged step: one jitted call over a flat token axis holding the
decode token of every decoding sequence and prefill chunks of any number of sequences
(step_layout.py), compiled once per token bucket. Sampling runs inside the step; only token ids
(and logprobs when asked) come back. Per-slot state (sampling parameters, seeds, token history,
the last sampled id) lives on the device (slot_state.py) and is written only when a sequence
takes a slot.

`launch` dispatches a step and returns at once; `collect` waits for its ids. Between the two the
host can schedule and launch the next step, whose decode inputs the device takes from the slots'
last sampled ids (step_layout.PLACEHOLDER marks them): the engine's asynchronous scheduling.

Every device call, a step, a slot-state delta or a batch of copy-on-write block copies, is a
`StepCall`, `SlotsCall` or `CopyCall` run by `ModelRunner.run`: process 0 and multi-host
followers (multihost.py) alike, so process 0's broadcast hook (`before_call`) sees each one.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping

import jax
# Pallas imports its fuser lazily, the first time a kernel is lowered, and that import adds a
# value to JAX's tracing context: every program compiled before it would then be retraced once
# after warm-up. Importing it where every step is compiled, whichever backend object the runner
# is given, keeps the context fixed from the start.
import jax.experimental.pallas.fuser  # noqa: F401
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from jaxserve.runtime import (buckets, kv_quant, pooling, prompt_logprobs, slot_state,
                              spec_points, step_layout)
from jaxserve.runtime.attention_backends import AttentionBackend
from jaxserve.core.outputs import SampleResult
from jaxserve.runtime.kv_cache import new_cache
from jaxserve.runtime.lora_writer import SlotWriter
from jaxserve.runtime.runner_spec import RunnerSpec
from jaxserve.runtime.sampler import SamplerOutput, sample
from jaxserve.runtime.slot_state import SlotsCall, SlotState
from jaxserve.core.scheduler import ScheduledSeq
from jaxserve.core.step_plan import StepPlan, StepResult
from jaxserve.runtime.sharding import TensorParallel
from jaxserve.runtime.step_call import (ROW_FIELDS, TOKEN_FIELDS, CopyCall, LoRACall, Pending,
                                        StepCall, StepInputs, copy_blocks)
from jaxserve.runtime.step_layout import Row
from models import lora as lora_slots
from models.layer_layout import layer_views
from models.model import Model

log = logging.getLogger("jaxserve")


def _nbytes(tree) -> int:
    return sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree))


class ModelRunner:
    # The CPU program's shape unless __init__ says otherwise (see its docstring).
    unroll_layers: bool = False
    branch_free_sampling: bool = False
    sampler_backend: str = "xla"

    def __init__(self, model: Model, spec: RunnerSpec, *, attention: AttentionBackend,
                 linear=None, head=None, grouped_matmul=None, tp: TensorParallel | None = None,
                 lora_backend=None, fused_linear=None):
        """Built by runner_factory.build_runner, which prepares the arguments for `spec`.

        model: params as spec.program's step reads them (per-layer trees when it unrolls the
        layers); with `tp`, placed here over its mesh, as are the cache and slot state.
        linear: None is the model's dense dot. head: the tied LM head's backend
        (backends.head_backend; None: the model's einsum). grouped_matmul: the MoE experts'
        backend (jaxserve/runtime/grouped_matmul.py; None: models/moe.py's ragged_dot),
        already wrapped for tp where it needs to be. lora_backend: the adapters' delta
        (jaxserve/runtime/lora.py's kernel; None: models/lora.py's XLA path, DENSE), used when
        spec.program has LoRA slots (the params then hold them: prepare_weights).
        fused_linear: decode-sized steps' linears with their norms and residual adds
        (backends.fused_linear_backend; None: the plain ones).
        spec.program's unroll_layers and branch_free_sampling are the GPU program's shape
        (backends.gpu_step): layers unrolled so no weight slice is copied, and a sampler
        without conditionals, each of which would make the host wait for the device mid-step.
        Its num_speculative_tokens k > 0 compiles a verification variant of every step
        program (rows of up to k drafts sampled at each of their last k + 1 queries)."""
        c, program = model.config, spec.program
        max_num_seqs, block_size = spec.max_num_seqs, spec.block_size
        max_model_len, num_speculative_tokens = spec.max_model_len, program.num_speculative_tokens
        self.spec = spec
        self.num_speculative_tokens = num_speculative_tokens
        # Steps with constrained rows run a masked variant of each program, so steps without
        # any pay nothing for the feature. Warm-up compiles the plain ones; the masked ones
        # can follow off the engine thread (masked_warmup), so they do not delay serving.
        self.structured_outputs = program.structured_outputs
        self.poison_rows = program.poison_rows
        # Steps with embedding rows run a pooled variant of each program (runtime/pooling.py),
        # compiled at warm-up beside the plain one only when the engine serves embeddings.
        self.pooling = program.pooling
        self.mask_words = -(-c.vocab_size // 32)
        attention = _checked(attention, c, block_size)
        dtype = program.kv_dtype(model)
        jit_kwargs = {}
        if tp is not None:  # tensor parallel: params and cache sharded over tp's mesh
            shardings = tp.param_shardings(model.params, c)
            model = dataclasses.replace(model, params=tp.place(model.params, shardings))
            jit_kwargs = tp.step_jit_kwargs(shardings, kv_quant.is_quantized(dtype))
        self.model, self.block_size, self.max_model_len = model, block_size, max_model_len
        self.tp = tp
        self.before_call = None  # multi-host: process 0 broadcasts each device call here
        self.num_slots = max_num_seqs
        self.idle_slot = max_num_seqs  # padding rows and tokens read and write this slot
        self.max_blocks = -(-max_model_len // block_size)
        self.eos_ids = spec.eos_ids
        shape = (c.num_layers, spec.num_blocks, block_size, c.num_kv_heads, c.head_dim)
        self.cache = tp.new_cache(shape, dtype) if tp is not None else new_cache(shape, dtype)
        host_state = slot_state.new_state(max_num_seqs + 1, max_model_len)
        self.state: SlotState = (tp.place(host_state, jax.tree.map(lambda _: tp.replicated,
                                                                   host_state))
                                 if tp is not None else jax.tree.map(jnp.asarray, host_state))
        # Host copy of each slot's blocks [S + 1, nb]; the idle slot's row stays zeros.
        self.page_table = np.zeros((max_num_seqs + 1, self.max_blocks), np.int32)
        self.slot_of: dict[str, int] = {}
        self.free_slots = list(range(self.num_slots - 1, -1, -1))
        self.ragged = attention.layout == "ragged"
        self.token_buckets = step_layout.token_buckets(
            spec.max_num_batched_tokens, max_num_seqs, self.ragged, program.fine_decode_buckets,
            drafted_row=num_speculative_tokens + 1 if num_speculative_tokens else 0)
        self.slot_buckets = buckets.slot_write_buckets(max_num_seqs)
        if tp is not None:
            attention = tp.attention(attention)
        self.attention = attention
        self.branch_free_sampling, self.unroll_layers = (program.branch_free_sampling,
                                                         program.unroll_layers)
        self.sampler_backend = program.sampler_backend
        self.lora = program.lora  # LoRASlots, or None: no adapters
        # The XLA path without a conditional in a GPU program (branch-free), else skipped in
        # steps without adapters.
        self.lora_backend = lora_backend or (lora_slots.DENSE if program.branch_free_sampling
                                             else lora_slots.SKIPPING)
        self.fused_linear = fused_linear
        self._module = step_module(model, attention, linear, self.unroll_layers, grouped_matmul,
                                   head, self.lora_backend.delta if self.lora else None,
                                   fused_linear)
        self.lora_writer = (SlotWriter(model.params, c.num_layers, self.lora.max_loras,
                                       sharded=tp is not None)
                            if self.lora is not None else None)
        self._step = jax.jit(self._step_impl, donate_argnums=(1, 2), **jit_kwargs)
        self._write_slots = jax.jit(slot_state.write_slots, donate_argnums=(0,))
        # Copy-on-write copies run in fixed batches of (src, dst) pairs, padded with (0, 0)
        # (the null block onto itself), so one compiled program serves every step.
        self.copy_batch = max_num_seqs
        self._copy = jax.jit(copy_blocks, donate_argnums=(0,))
        # Ahead-of-time compiled programs by (kind, shape): warm-up compiles them without
        # running them (running the largest token buckets once costs seconds of real compute).
        self._executables: dict[tuple, jax.stages.Compiled] = {}
        self._compiles_at_warmup: int | None = None
        self._compile_lock = threading.Lock()  # warmup_masked may run on another thread
        self.h2d_bytes = 0  # host -> device bytes of every call run so far

    # ---- the jitted step ------------------------------------------------------------------

    def _step_impl(self, params, cache, state: SlotState, inp: StepInputs):
        # Named scopes label the ops in a profile (step / attention, mlp, sampling).
        meta, f = inp.meta(self.ragged), inp.field
        token_slot, row_slot, ctx = f("token_slot"), f("row_slot"), meta.context_lens
        logits_index, samples = f("logits_index"), f("samples") != 0  # [R] each
        if inp.points is not None:  # verification: sample at every point instead, [P] each
            logits_index, row_slot, ctx, samples = (inp.points[0], inp.points[1], inp.points[2],
                                                    inp.points[3] != 0)
        num_sampling = logits_index.shape[0]
        if inp.prompt_targets is not None:  # the head over every flat token too
            logits_index = jnp.concatenate([logits_index, jnp.arange(  # [R + T]
                inp.prompt_targets.shape[0], dtype=logits_index.dtype)])
        with jax.named_scope("step"):
            # Decode inputs not known on the host come from the slot's last sample.
            tokens = jnp.where(f("feed") != 0, state.last_tokens[token_slot], f("tokens"))  # [T]
            history = slot_state.set_in_bounds(state.history, (token_slot, meta.positions[0]),
                                                tokens)
            # Each token's adapter slot, from its batch slot (idle tokens: the idle slot's -1),
            # indexed once for the step's L x 7 adapted linears.
            lora = (self.lora_backend.index(state.lora[token_slot], self.lora.max_loras)
                    if self.lora is not None else None)
            pools = inp.pool is not None  # static: the pooled variant
            if self.unroll_layers:  # stacked leaves kept so (runner_factory) seen per layer
                params = layer_views(params, self.model.config.num_layers)
            result = self._module.apply({"params": params}, tokens[None], meta.positions,
                                        cache, meta, logits_index=logits_index, lora=lora,
                                        **({"return_hidden": True} if pools else {}))
            logits, cache = result[0], result[1]
            pooled = None
            if pools:
                with jax.named_scope("pooling"):  # [R, D] float32
                    pooled = pooling.pool_rows(result[2], inp.pool, inp.per_row.shape[1] - 1)
                if self.tp is not None:
                    pooled = jax.lax.with_sharding_constraint(pooled, self.tp.replicated)
            if self.tp is not None:  # one gather of vocab-parallel logits; sampler replicated
                logits = jax.lax.with_sharding_constraint(logits, self.tp.replicated)
            prompt = None
            if inp.prompt_targets is not None:
                with jax.named_scope("prompt_logprobs"):
                    prompt = prompt_logprobs.compute(logits[num_sampling:], inp.prompt_targets)
                logits = logits[:num_sampling]  # [R, V]
            if inp.poison is not None:  # fault injection: the sampler must see the bad row
                logits = logits + inp.poison[:, None].astype(logits.dtype)  # [R, V]
            with jax.named_scope("sampling"):
                st = slot_state.rows_sampling(state, row_slot, ctx)
                want = f("scalars")[1] != 0
                out = sample(logits, st, history[row_slot], ctx, state.prompt_lens[row_slot], ctx,
                             want, mask=inp.mask, branch_free=self.branch_free_sampling,
                             backend=self.sampler_backend)
            written = jnp.where(samples, row_slot, self.idle_slot)
            state = dataclasses.replace(state, history=history,
                                        last_tokens=slot_state.set_in_bounds(
                                            state.last_tokens, (written,), out.tokens))
        if pooled is not None:
            out = dataclasses.replace(out, pooled=pooled)
        if prompt is not None:
            out = dataclasses.replace(out, prompt=prompt)
        return cache, state, out

    @property
    def step_function(self):
        """The step before jit: (params, cache, state, StepInputs) -> (cache, state, sampled);
        cache and state are donated. For compiling it elsewhere (jaxserve/tools/gpu_step.py)."""
        return self._step_impl

    @property
    def num_compiled(self) -> int:
        return len(self._executables)

    @property
    def num_compiles_after_warmup(self) -> int:
        with self._compile_lock:
            base = self._compiles_at_warmup
            return 0 if base is None else self.num_compiled - base

    def shapes(self) -> list[tuple[int]]:
        """Every step shape (flat tokens,) the runner can run: what warm-up compiles (twice
        with structured outputs: without and with token bitmasks; each of those twice when
        the engine serves embeddings: without and with pooling)."""
        return [(t,) for t in self.token_buckets]

    def warmup(self, progress: bool = True, deferred: bool = False) -> float:
        """Compiles every bucket now, so serving never stops to compile. Returns seconds.

        deferred: leave the masked (structured-output) variants to `masked_warmup`."""
        start = time.perf_counter()
        # Every process warms up itself (same programs in the same order): nothing to broadcast.
        calls = [self.step_template(*shape) for shape in self.shapes()]
        if self.num_speculative_tokens:
            calls += [self.step_template(*shape, verify=True) for shape in self.shapes()]
        calls = self._with_pooled(calls)
        calls += [self.slots_template(d) for d in self.slot_buckets] + [self.copy_template()]
        if self.lora is not None:
            calls.append(self.lora_call(0, None))
        if self.structured_outputs and not deferred:
            calls += self._masked_templates()
        for call in tqdm(calls, desc="jaxserve: compiling", unit="program",
                         disable=not progress):
            self._executable(call)
        with self._compile_lock:
            self._compiles_at_warmup = self.num_compiled
        return time.perf_counter() - start

    def _masked_templates(self) -> list[StepCall]:
        return self._with_pooled([self.step_template(*shape, masked=True)
                                  for shape in self.shapes()])

    def _with_pooled(self, calls: list[StepCall]) -> list[StepCall]:
        """`calls`, and when the engine serves embeddings each one's pooled twin."""
        if not self.pooling:
            return calls
        return calls + [self.step_template(*c.shape, masked=c.masked, verify=c.verifies,
                                           pooled=True) for c in calls]

    def masked_warmup(self) -> Callable[[], float]:
        """The masked step variants that `warmup(deferred=True)` left out, as a job to run on
        another thread while steps run (returns its seconds; its compiles count as warm-up).
        The arguments are taken abstractly here, as steps donate the live cache and state. No
        masked step may run before the job returns: the engine admits constrained requests
        only then."""
        jobs = []
        for call in self._masked_templates():
            fn, args = self._arguments(call)
            abstract = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                if isinstance(x, jax.Array) else x, args)
            jobs.append((self._key(call), fn, abstract))

        def run() -> float:
            start = time.perf_counter()
            for key, fn, abstract in jobs:
                if key in self._executables:
                    continue
                exe = fn.lower(*abstract).compile()
                with self._compile_lock:
                    self._executables[key] = exe
                    if self._compiles_at_warmup is not None:
                        self._compiles_at_warmup += 1
            return time.perf_counter() - start
        return run

    def step_template(self, tokens: int, masked: bool = False,
                      verify: bool = False, pooled: bool = False,
                      scored: bool = False) -> StepCall:
        """An idle step of `tokens` flat tokens: no rows, everything masked (with an all-ones
        token bitmask when `masked`; with idle sampling points when `verify`; pooling no
        token when `pooled`; scoring no prompt token when `scored`)."""
        lay = step_layout.build([], self.page_table, tokens=tokens, max_num_seqs=self.num_slots,
                                block_size=self.block_size, idle_slot=self.idle_slot,
                                ragged=self.ragged)
        mask = self._all_allowed(lay) if masked else None
        points = self._points(lay, [])[0] if verify else None
        pool = pooling.idle_pool(tokens, lay.context_lens.shape[0]) if pooled else None
        targets = np.full(tokens, -1, np.int32) if scored else None  # [T]
        return self.step_call(lay, want_logprobs=False, mask=mask, points=points, pool=pool,
                              prompt_targets=targets)

    def _points(self, lay: step_layout.Layout, sampling_rows) -> tuple[np.ndarray, list]:
        size = spec_points.num_points(lay.tokens.shape[0], self.num_slots,
                                      self.num_speculative_tokens)
        return spec_points.build(lay, sampling_rows, size, self.idle_slot)

    def _all_allowed(self, lay: step_layout.Layout) -> np.ndarray:
        return np.full((lay.context_lens.shape[0], self.mask_words), -1, np.int32)  # [R, W]

    def slots_template(self, size: int) -> SlotsCall:
        """A slot-state delta that writes idle state into the idle slot."""
        return self._slots_call([], [], [], [], [], size)

    def copy_template(self) -> CopyCall:
        """A batch of copies that copies nothing (the null block onto itself)."""
        return CopyCall(np.zeros((self.copy_batch, 2), np.int32))  # [C, 2]

    def lora_call(self, slot: int, adapter) -> LoRACall:
        """Writing `adapter` (AdapterWeights; None: zeros) into device slot `slot`."""
        return self.lora_writer.call(slot, adapter)

    # ---- the one entry point for device work ----------------------------------------------

    def run(self, call: StepCall | SlotsCall | CopyCall | LoRACall) -> SamplerOutput | None:
        """Runs one device call; a step returns its sampled tokens (on the device), with the
        embedding rows' pooled sums in a pooled step.

        Process 0's calls and a multi-host follower's replay of them both come through here, so
        `before_call` (process 0's broadcast) sees every call that changes device state.
        """
        if self.before_call is not None:
            self.before_call(call)
        self.h2d_bytes += _nbytes(call)
        return self._launch(call)

    def _arguments(self, call: StepCall | SlotsCall | CopyCall) -> tuple:
        if isinstance(call, CopyCall):
            return self._copy, (self.cache, call.pairs)
        if isinstance(call, SlotsCall):
            return self._write_slots, (self.state, call)
        if isinstance(call, LoRACall):
            return self.lora_writer.write, self.lora_writer.arguments(self.model.params, call)
        return self._step, (self.model.params, self.cache, self.state, call.inputs)

    @staticmethod
    def _key(call: StepCall | SlotsCall | CopyCall) -> tuple:
        return (type(call).__name__, call.shape, getattr(call, "masked", False),
                getattr(call, "verifies", False), getattr(call, "pools", False),
                getattr(call, "scores_prompt", False))

    def _executable(self, call: StepCall | SlotsCall | CopyCall) -> jax.stages.Compiled:
        """The call's compiled program: compiled (from the persistent cache if it is there)
        the first time its kind and shape are met, which after warm-up is a bucket missed."""
        key = self._key(call)
        exe = self._executables.get(key)
        if exe is None:
            fn, args = self._arguments(call)
            exe = self._executables[key] = fn.lower(*args).compile()
        return exe

    def _launch(self, call: StepCall | SlotsCall | CopyCall) -> SamplerOutput | None:
        exe = self._executable(call)
        _, args = self._arguments(call)
        if isinstance(call, CopyCall):
            self.cache = exe(*args)
            return None
        if isinstance(call, SlotsCall):
            self.state = exe(*args)
            return None
        if isinstance(call, LoRACall):  # the new slot arrays replace the old (donated) ones
            params = self.lora_writer.apply(self.model.params, exe(*args))
            self.model = dataclasses.replace(self.model, params=params)
            return None
        self.cache, self.state, sampled = exe(*args)
        return sampled

    # ---- host bookkeeping -----------------------------------------------------------------

    def release(self, seq_ids: Iterable[str]) -> None:
        """Frees the batch slots of these sequences (ended or preempted); ids without a slot
        are skipped. The one place slots are freed."""
        slot_of, page_table, free = self.slot_of, self.page_table, self.free_slots
        for sid in seq_ids:
            slot = slot_of.pop(sid, None)
            if slot is not None:
                page_table[slot] = 0
                free.append(slot)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copies each src block's K and V (all layers) onto its dst block, in place."""
        for i in range(0, max(len(pairs), 1), self.copy_batch):
            chunk = np.zeros((self.copy_batch, 2), np.int32)  # [C, 2] (src, dst); pads 0 -> 0
            part = pairs[i:i + self.copy_batch]
            if part:
                chunk[:len(part)] = part
            self.run(CopyCall(chunk))

    def _slots_call(self, slots, params, seeds, prompt_lens, tokens, size,
                    lora=None) -> SlotsCall:
        return slot_state.slots_call(slots, params, seeds, prompt_lens, tokens, size=size,
                                     idle_slot=self.idle_slot, max_model_len=self.max_model_len,
                                     eos_ids=self.eos_ids, lora_slots=lora)

    def _assign_slots(self, items: list[ScheduledSeq], seeds: dict[str, int],
                      lora: Mapping[int, int]) -> set[str]:
        """Gives each new sequence a slot and writes its state there (one delta call), with
        its adapter's device slot from `lora` (lora_int_id -> slot). Returns the new
        sequences' ids."""
        slot_of = self.slot_of
        new = [i for i in items if i.seq.request_id not in slot_of]
        for i in range(0, len(new), self.slot_buckets[-1]):
            part = new[i:i + self.slot_buckets[-1]]
            slots = [self.free_slots.pop() for _ in part]
            for item, slot in zip(part, slots):
                self.slot_of[item.request_id] = slot
            seqs = [item.seq for item in part]
            self.run(self._slots_call(
                slots, [s.sampling_params for s in seqs], [seeds[s.request_id] for s in seqs],
                [s.num_prompt_tokens for s in seqs],
                [s.token_ids_slice(0, item.start_pos + item.num_new_tokens)
                 for s, item in zip(seqs, part)],
                buckets.pick(self.slot_buckets, len(part)),
                [lora[s.lora_id] if s.lora_id else -1 for s in seqs] if lora else None))
        return {item.request_id for item in new}

    # ---- one engine step ------------------------------------------------------------------

    def launch(self, plan: StepPlan) -> Pending:
        """Dispatches the plan's rows as one step; returns without waiting for the device.

        First the slots the plan releases are freed and its copy-on-write copies run; new
        sequences then take slots (their state written in one delta call). Constrained rows get
        their grammar's bitmask; a drafted row samples after each of its last k + 1 queries
        (not with grammar rows); poisoned rows get the value added to their logits.
        """
        out = plan.schedule
        if plan.released:
            self.release(plan.released)
        if out.blocks_to_copy:
            self.copy_blocks(out.blocks_to_copy)
        for slot, adapter in plan.lora_loads:  # before any row reads the slot
            self.run(self.lora_call(slot, adapter))
        items = out.scheduled
        new = self._assign_slots(items, plan.seeds, plan.lora_slots)
        if new or out.prefills:
            rows, lens, want = self._rows(items, new)
        else:  # decodes of held slots only, the steady state: by columns
            rows, lens, want = self._decode_rows(items)
        need = step_layout.flat_tokens_needed(lens, self.ragged)
        lay = step_layout.build(rows, self.page_table, tokens=buckets.pick(self.token_buckets,
                                                                            need),
                                max_num_seqs=self.num_slots, block_size=self.block_size,
                                idle_slot=self.idle_slot, ragged=self.ragged)
        mask, grammar = None, plan.grammar
        if grammar is not None and grammar.matchers:
            matchers = grammar.matchers
            mask = self._all_allowed(lay)
            grammar.fill(mask, [(matchers[item.request_id], lay.row_index[k])
                                for k, item in enumerate(items) if item.request_id in matchers])
        sampling = [(item, lay.row_index[k]) for k, item in enumerate(items) if item.is_last_chunk]
        points = owned = None
        drafts = plan.drafts
        if drafts:
            points, owned = self._points(lay, [(r, drafts.get(i.request_id, 0))
                                               for i, r in sampling])
        pool = pooled_rows = None
        if plan.pooled:
            pool, pooled_rows = pooling.token_rows(
                lay.query_start, lay.logits_index, lay.tokens.shape[0],
                [(item, lay.row_index[k], plan.pooled[item.request_id])
                 for k, item in enumerate(items) if item.request_id in plan.pooled])
        scored = [(item.request_id, item.seq.sampling_params.prompt_logprobs,
                   int(lay.logits_index[lay.row_index[k]]) - item.num_new_tokens + 1,
                   item.start_pos, item.num_new_tokens, item.seq.prompt_token_ids)
                  # Prefill chunks come first; a decode is past its prompt.
                  for k, item in enumerate(out.prefills)
                  if getattr(item.seq.sampling_params, "prompt_logprobs", None) is not None
                  and item.start_pos < item.seq.num_prompt_tokens - 1]
        # Most steps score nothing: no [T] targets array is built for them.
        targets, spans = (prompt_logprobs.targets(lay.tokens.shape[0], scored) if scored
                          else (None, []))
        call = self.step_call(lay, want, mask, points, pool,
                              prompt_targets=targets if spans else None)
        if plan.poison:  # fault injection: every logits row (or point) of a poisoned sequence
            for (item, row), at in zip(sampling, owned or [[r] for _, r in sampling]):
                if item.request_id in plan.poison:
                    call.inputs.poison[at] = plan.poison[item.request_id]
        sampled = self.run(call)
        return Pending([i for i, _ in sampling], [r for _, r in sampling], sampled, want,
                       points=owned, drafted=frozenset(drafts), pooling=pooled_rows or [],
                       prompt_spans=spans, prompt_targets=targets if spans else None)

    def _rows(self, items: list[ScheduledSeq], new: set[str]):
        """(rows, query lengths, whether a row wants logprobs) of the scheduled items; writes
        their page-table entries."""
        rows, lens, want = [], [], False
        slot_of, page_table, block_size = self.slot_of, self.page_table, self.block_size
        for item in items:
            seq, start, n = item.seq, item.start_pos, item.num_new_tokens
            rid, table = seq.request_id, seq.block_table
            slot = slot_of[rid]
            # A new slot takes the whole table (prefix-cache hits precede start); a held one
            # from the block being written: copy-on-write may have replaced it, appends follow.
            first = 0 if rid in new else start // block_size
            page_table[slot, first:len(table)] = table[first:]
            rows.append(Row(slot, start, seq.token_ids_slice(start, start + n),
                            item.is_last_chunk))
            lens.append(n)
            if seq.sampling_params.logprobs is not None:
                want = True
        return rows, lens, want

    def _decode_rows(self, items: list[ScheduledSeq]):
        """_rows for decodes of sequences that already hold slots (every step of steady
        decoding), a column at a time: one query each, the sequence's last token (a decode
        has one uncomputed token), in the block its position falls in."""
        seqs = [item.seq for item in items]
        starts = [item.start_pos for item in items]
        slots = [self.slot_of[seq.request_id] for seq in seqs]
        cols = [start // self.block_size for start in starts]
        # Copy-on-write may have replaced the block being written: its entry is rewritten.
        self.page_table[slots, cols] = [seq.block_table[c] for seq, c in zip(seqs, cols)]
        tokens = [(seq.output_token_ids or seq.prompt_token_ids)[-1] for seq in seqs]
        want = any(seq.sampling_params.logprobs is not None for seq in seqs)
        return step_layout.Columns(slots, starts, tokens), [1] * len(items), want

    def step_call(self, lay: step_layout.Layout, want_logprobs: bool,
                  mask: np.ndarray | None = None, points: np.ndarray | None = None,
                  pool: np.ndarray | None = None,
                  prompt_targets: np.ndarray | None = None) -> StepCall:
        """The StepCall of a step layout (step_layout.build with this runner's settings);
        mask [R, W] int32: the rows' token bitmasks, or None; pool [T] int32: each token's
        embedding row (runtime/pooling.py), or None; prompt_targets [T] int32: each token's
        next prompt token to score (prompt_logprobs.py), or None."""
        t, r = lay.tokens.shape[0], lay.context_lens.shape[0]
        per_token = np.empty((len(TOKEN_FIELDS), t), np.int32)  # [6, T]
        for i, name in enumerate(TOKEN_FIELDS):
            per_token[i] = getattr(lay, name)
        per_row = np.zeros((len(ROW_FIELDS), r + 1), np.int32)  # [6, R + 1]
        per_row[0] = lay.query_start
        for i, name in enumerate(ROW_FIELDS[1:-1], start=1):
            per_row[i, :r] = getattr(lay, name)
        per_row[-1, :2] = (0 if lay.num_pairs is None else lay.num_pairs, want_logprobs)
        pages = lay.chunk_pages if self.ragged else lay.page_table
        rows = r if points is None else points.shape[1]
        poison = np.zeros(rows, np.float32) if self.poison_rows else None  # [R] or [P]
        return StepCall(StepInputs(per_token=per_token, per_row=per_row, pages=pages,
                                   pairs=lay.pairs, mask=mask, poison=poison,
                                   points=points, pool=pool, prompt_targets=prompt_targets))

    def collect(self, pending: Pending) -> StepResult:
        """Waits for a launched step's ids; returns every sampling item's samples (one, or for a
        drafted row of a verification step its k + 1, in position order)."""
        result = self._samples(pending)
        if pending.prompt_spans:
            result = dataclasses.replace(result, prompt_logprobs=prompt_logprobs.entries(
                pending.sampled.prompt, pending.prompt_spans, pending.prompt_targets))
        return result

    def _samples(self, pending: Pending) -> StepResult:
        pooled = self._pooled(pending)
        if not pending.items:
            return StepResult({}, pooled=pooled)
        sampled = pending.sampled
        # Python ints and floats in one conversion each, not a numpy scalar per row.
        tokens = np.asarray(sampled.tokens).tolist()
        logprobs = np.asarray(sampled.logprob)
        logprob = logprobs.tolist()
        # NaN or inf anywhere in a row's logits makes its logprob non-finite: one array check.
        finite = bool(np.isfinite(logprobs).all())
        if not pending.want_logprobs and pending.points is None:  # most steps: kept lean
            return StepResult({item.seq.request_id: [SampleResult(tokens[row], logprob[row], None)]
                               for item, row in zip(pending.items, pending.rows)}, finite,
                              pooled)
        top_ids = np.asarray(sampled.top_ids) if pending.want_logprobs else None
        top_lps = np.asarray(sampled.top_logprobs) if pending.want_logprobs else None

        def result(k: int | None, at: int) -> SampleResult:
            top = None
            if k is not None:
                top = {int(t): float(lp) for t, lp in zip(top_ids[at, :k], top_lps[at, :k])}
            return SampleResult(tokens[at], logprob[at], top)

        if pending.points is None:  # a plain step: one sample per item
            return StepResult({item.request_id: [result(item.seq.sampling_params.logprobs, row)]
                               for item, row in zip(pending.items, pending.rows)}, finite,
                              pooled)
        results = {}
        for item, at in zip(pending.items, pending.points):
            k, rid = item.seq.sampling_params.logprobs, item.request_id
            results[rid] = ([result(k, p) for p in at] if rid in pending.drafted
                            else [result(k, at[-1])])
        return StepResult(results, finite, pooled)

    @staticmethod
    def _pooled(pending: Pending) -> dict[str, np.ndarray]:
        """The embedding rows' pooled sums: sequence id -> [D] float32."""
        if not pending.pooling:
            return {}
        rows = np.asarray(pending.sampled.pooled)  # [R, D]: the one transfer of hidden states
        return {item.request_id: rows[row] for item, row in pending.pooling}


def _checked(attention, config, block_size: int) -> AttentionBackend:
    if not isinstance(attention, AttentionBackend):
        raise TypeError("attention must be an AttentionBackend (jaxserve/runtime/"
                        f"attention_backends.py), got {attention!r}")
    reasons = attention.supports(config, block_size)
    if reasons:
        raise ValueError(f"attention backend {attention.name!r} cannot run "
                         f"{', '.join(reasons)}")
    return attention


def step_module(model: Model, attention: AttentionBackend, linear=None,
                unroll_layers: bool = False, grouped_matmul=None, head=None, lora_fn=None,
                fused_linear=None):
    """The model with the backend's attention (and linear, MoE grouped matmul, tied head,
    LoRA delta, fused linears) entry points."""
    kw = {"linear": linear} if linear else {}
    if fused_linear:
        kw.update(fused_linear=fused_linear, attention_packed=attention.attend_packed)
    if lora_fn:
        kw["lora_fn"] = lora_fn
    if grouped_matmul:
        kw["grouped_matmul"] = grouped_matmul
    if head:
        kw["head"] = head
    if unroll_layers:
        kw["unroll_layers"] = True
    return model.module(attention=attention.attend, **kw)
