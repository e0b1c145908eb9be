"""The model runner: the one place that turns scheduler decisions into device arrays.

Two kinds of model step, both the same jitted step function at different shapes:
- decode: all decoding sequences at once, `[batch_bucket, 1]` tokens, and the page table cut
  to a bucket of blocks or the flat list of blocks in use, as the attention backend declares;
- prefill: one sequence's chunk, `[1, token_bucket]` tokens, page table `[1, block_bucket]`.
Sampling runs inside the step; only token ids (and logprobs when asked) come back.

Every device call, a step or a batch of copy-on-write block copies, is a `StepCall` or a
`CopyCall` run by `ModelRunner.run`: process 0 and multi-host followers (multihost.py) alike, so
process 0's broadcast hook (`before_call`) sees each one.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import jax
# Pallas imports its fuser lazily, the first time a kernel is lowered, and that import adds a
# value to JAX's tracing context: every program compiled before it would then be retraced once
# after warm-up. Importing it where every step is compiled, whichever backend object the runner
# is given, keeps the context fixed from the start.
import jax.experimental.pallas.fuser  # noqa: F401
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from jaxserve.runtime import buckets
from jaxserve.runtime.attention_backends import AttentionBackend, XlaAttention
from jaxserve.core.outputs import SampleResult
from jaxserve.runtime.kv_cache import KVCache, PagedMeta
from jaxserve.runtime.sampler import SamplerOutput, SamplingTensors, sample
from jaxserve.core.scheduler import ScheduledSeq, SchedulerOutput
from jaxserve.runtime.sharding import TensorParallel
from models.model import Model

log = logging.getLogger("jaxserve")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInputs:
    tokens: jax.Array        # [B, T] int32
    meta: PagedMeta          # positions/slots [B, T], page_table [B, nb], context_lens [B]
    logits_index: jax.Array  # [B] int32: which of the T tokens to sample after
    history: jax.Array       # [B, max_model_len] int32: prompt + output ids, for penalties
    prompt_lens: jax.Array   # [B] int32
    sample_pos: jax.Array    # [B] int32: position of the token being sampled (for its RNG)
    want_logprobs: jax.Array  # [] bool


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepCall:
    """One model step: its inputs and sampling tensors, both padded to the step's buckets."""

    inputs: StepInputs
    sampling: SamplingTensors

    @property
    def shape(self) -> tuple[int, int, int]:
        """(rows, tokens, width): what `ModelRunner.step_template` rebuilds it from.

        width counts the page table's columns, or the flat block list's entries (ragged decode).
        """
        rows, tokens = self.inputs.tokens.shape
        meta = self.inputs.meta
        width = meta.ragged.shape[1] if meta.ragged is not None else meta.page_table.shape[1]
        return rows, tokens, width


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CopyCall:
    """A batch of block copies: pairs [C, 2] int32 (src, dst), padded with (0, 0)."""

    pairs: jax.Array


def _copy_blocks(cache: KVCache, pairs: jax.Array) -> KVCache:
    """pairs [C, 2] int32 (src, dst). A dst is never another pair's src: dst blocks are fresh."""
    src, dst = pairs[:, 0], pairs[:, 1]
    return KVCache(k=cache.k.at[:, dst].set(cache.k[:, src]),
                   v=cache.v.at[:, dst].set(cache.v[:, src]))


class ModelRunner:
    def __init__(self, model: Model, *, max_num_seqs: int, max_num_batched_tokens: int,
                 block_size: int, num_blocks: int, max_model_len: int, eos_ids=(),
                 attention: AttentionBackend | None = None, linear=None,
                 tp: TensorParallel | None = None, kv_cache_dtype=None):
        c = model.config
        attention = _checked(XlaAttention() if attention is None else attention, c, block_size)
        jit_kwargs = {}
        if tp is not None:  # tensor parallel: params and cache sharded over tp's mesh
            shardings = tp.param_shardings(model.params, c)
            model = dataclasses.replace(model, params=tp.place(model.params, shardings))
            jit_kwargs = tp.step_jit_kwargs(shardings)
        self.model, self.block_size, self.max_model_len = model, block_size, max_model_len
        self.tp = tp
        self.before_call = None  # multi-host: process 0 broadcasts each device call here
        self.num_slots = max_num_seqs
        self.max_blocks = -(-max_model_len // block_size)
        self.eos_ids = tuple(eos_ids)
        shape = (c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim)
        dtype = jnp.dtype(kv_cache_dtype or model.dtype)  # None: the model's dtype
        self.cache = (tp.new_cache(shape, dtype) if tp is not None else
                      KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype)))
        self.page_table = np.zeros((self.num_slots, self.max_blocks), np.int32)  # [S, nb]
        self.history = np.zeros((self.num_slots, max_model_len), np.int32)  # [S, L]
        self.slot_of: dict[str, int] = {}
        self.free_slots = list(range(self.num_slots - 1, -1, -1))
        self.decode_buckets = buckets.decode_block_buckets(self.max_blocks)
        self.batch_buckets = buckets.decode_batch_buckets(max_num_seqs)
        self.token_buckets = buckets.prefill_token_buckets(max_num_batched_tokens)
        if tp is not None:
            attention = tp.attention(attention)
        self.attention = attention
        # Its decode reads the flat list of blocks in use, or the page table cut to a bucket.
        self.ragged = attention.decode_layout == "ragged"
        self._modules = step_modules(model, attention, linear)
        self._step = jax.jit(self._step_impl, donate_argnums=(1,), **jit_kwargs)
        # Copy-on-write copies run in fixed batches of (src, dst) pairs, padded with (0, 0)
        # (the null block onto itself), so one compiled program serves every step.
        self.copy_batch = max_num_seqs
        self._copy = jax.jit(_copy_blocks, donate_argnums=(0,))
        self._compiles_at_warmup: int | None = None

    # ---- the jitted step ------------------------------------------------------------------

    def _step_impl(self, params, cache, inp: StepInputs, st: SamplingTensors):
        # Named scopes label the ops in a profile (prefill|decode / attention, mlp, sampling).
        # A decode call has one token per row; prefill buckets start at 16 tokens (only a
        # max_num_batched_tokens of 1 would make a 1-token prefill, which is a decode's math).
        kind = "decode" if inp.tokens.shape[1] == 1 else "prefill"
        with jax.named_scope(kind):
            logits, cache = self._modules[kind].apply({"params": params}, inp.tokens,
                                                      inp.meta.positions, cache, inp.meta,
                                                      logits_index=inp.logits_index)
            if self.tp is not None:  # one gather of vocab-parallel logits; sampler replicated
                logits = jax.lax.with_sharding_constraint(logits, self.tp.replicated)
            with jax.named_scope("sampling"):
                out = sample(logits, st, inp.history, inp.meta.context_lens, inp.prompt_lens,
                             inp.sample_pos, inp.want_logprobs)
        return cache, out

    @property
    def num_compiled(self) -> int:
        return self._step._cache_size() + self._copy._cache_size()

    @property
    def num_compiles_after_warmup(self) -> int:
        base = self._compiles_at_warmup
        return 0 if base is None else self.num_compiled - base

    def shapes(self) -> list[tuple[int, int, int]]:
        """Every (rows, tokens, page-table width) the runner can run: what warm-up compiles."""
        out = [(rows, 1, nb) for rows in self.batch_buckets for nb in self._decode_widths(rows)]
        for tb in self.token_buckets:
            for nb in buckets.prefill_block_buckets(tb, self.block_size, self.max_blocks):
                out.append((1, tb, nb))
        return out

    def warmup(self, progress: bool = True) -> float:
        """Compiles every bucket now, so serving never stops to compile. Returns seconds."""
        start = time.perf_counter()
        for rows, tokens, nb in tqdm(self.shapes(), desc="jaxserve: compiling", unit="shape",
                                     disable=not progress):
            self._launch(self.step_template(rows, tokens, nb))
        # Every process warms up itself (same programs in the same order): nothing to broadcast.
        self._launch(self.copy_template())
        jax.block_until_ready(self.cache)
        self._compiles_at_warmup = self.num_compiled
        return time.perf_counter() - start

    def _decode_widths(self, rows: int) -> list[int]:
        if self.ragged:
            return buckets.ragged_block_buckets(rows, self.max_blocks)
        return self.decode_buckets

    def step_template(self, rows: int, tokens: int, width: int) -> StepCall:
        """An idle step of shape `StepCall.shape` (rows, tokens, width): empty rows, masked."""
        return StepCall(self._idle_inputs(rows, tokens, width),
                        SamplingTensors.from_params([], [], [], size=rows))

    def copy_template(self) -> CopyCall:
        """A batch of copies that copies nothing (the null block onto itself)."""
        return CopyCall(np.zeros((self.copy_batch, 2), np.int32))  # [C, 2]

    # ---- the one entry point for device work ----------------------------------------------

    def run(self, call: StepCall | CopyCall) -> SamplerOutput | None:
        """Runs one device call; a step returns its sampled tokens (on the device).

        Process 0's calls and a multi-host follower's replay of them both come through here, so
        `before_call` (process 0's broadcast) sees every call that changes the cache.
        """
        if self.before_call is not None:
            self.before_call(call)
        return self._launch(call)

    def _launch(self, call: StepCall | CopyCall) -> SamplerOutput | None:
        if isinstance(call, CopyCall):
            self.cache = self._copy(self.cache, call.pairs)
            return None
        self.cache, sampled = self._step(self.model.params, self.cache, call.inputs, call.sampling)
        return sampled

    def _idle_inputs(self, rows: int, tokens: int, nb: int) -> StepInputs:
        z = np.zeros((rows, tokens), np.int32)  # [B, T]
        ragged = None
        if self.ragged and tokens == 1:  # nb counts blocks in the flat list
            ragged, nb = np.zeros((3, nb), np.int32), 1
        meta = PagedMeta(positions=z, slots=z, page_table=np.zeros((rows, nb), np.int32),
                         context_lens=np.ones((rows,), np.int32), ragged=ragged)
        return StepInputs(tokens=z, meta=meta, logits_index=np.zeros((rows,), np.int32),
                          history=np.zeros((rows, self.max_model_len), np.int32),
                          prompt_lens=np.zeros((rows,), np.int32),
                          sample_pos=np.zeros((rows,), np.int32), want_logprobs=np.bool_(False))

    # ---- host bookkeeping -----------------------------------------------------------------

    def release(self, request_id: str) -> None:
        slot = self.slot_of.pop(request_id, None)
        if slot is not None:
            self.page_table[slot] = 0
            self.free_slots.append(slot)

    def _prepare_slot(self, item: ScheduledSeq) -> int:
        seq = item.seq
        slot = self.slot_of.get(seq.request_id)
        end = item.start_pos + item.num_new_tokens
        if slot is None:
            slot = self.slot_of[seq.request_id] = self.free_slots.pop()
            self.history[slot, :end] = seq.token_ids_slice(0, end)
        else:
            self.history[slot, item.start_pos:end] = item.token_ids
        table = seq.block_table
        self.page_table[slot, :len(table)] = table
        return slot

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copies each src block's K and V (all layers) onto its dst block, in place."""
        for i in range(0, max(len(pairs), 1), self.copy_batch):
            chunk = np.zeros((self.copy_batch, 2), np.int32)  # [C, 2] (src, dst); pads 0 -> 0
            part = pairs[i:i + self.copy_batch]
            if part:
                chunk[:len(part)] = part
            self.run(CopyCall(chunk))

    def _flat_slots(self, slot: int, positions: np.ndarray) -> np.ndarray:
        blocks = self.page_table[slot, positions // self.block_size]
        return blocks * self.block_size + positions % self.block_size

    # ---- one engine step ------------------------------------------------------------------

    def execute(self, out: SchedulerOutput, seeds: dict[str, int]) -> dict[str, SampleResult]:
        """Runs the scheduled work; returns the sampled token of every item that samples."""
        if out.blocks_to_copy:
            self.copy_blocks(out.blocks_to_copy)
        for rid in out.preempted:
            self.release(rid)
        # (items a call samples for, their rows in its output, its SamplerOutput): all calls are
        # dispatched before any result is fetched, so host and device work overlap.
        pending = []
        for item in out.prefills:
            sampled = self._prefill(item, seeds)
            if item.is_last_chunk:
                pending.append(([item], [0], sampled))
        if out.decodes:
            sampled = self._decode(out.decodes, seeds)
            pending.append((out.decodes, list(range(len(out.decodes))), sampled))
        results = {}
        for items, rows, sampled in pending:
            results.update(self._collect(items, rows, sampled))
        return results

    def _run_step(self, inp: StepInputs, params_per_row, seeds_per_row, generated, rows):
        st = SamplingTensors.from_params(params_per_row, seeds_per_row, generated,
                                         self.eos_ids, size=rows)
        return self.run(StepCall(inp, st))

    def _prefill(self, item: ScheduledSeq, seeds):
        seq, n, start = item.seq, item.num_new_tokens, item.start_pos
        slot = self._prepare_slot(item)
        tb = buckets.pick(self.token_buckets, n)
        nb = buckets.pick(buckets.prefill_block_buckets(tb, self.block_size, self.max_blocks),
                          -(-(start + n) // self.block_size))
        positions = np.full((1, tb), start + n - 1, np.int32)  # [1, T]; pads repeat the last
        positions[0, :n] = np.arange(start, start + n)
        slots = np.zeros((1, tb), np.int32)  # pads write into the null block
        slots[0, :n] = self._flat_slots(slot, positions[0, :n])
        tokens = np.zeros((1, tb), np.int32)
        tokens[0, :n] = item.token_ids
        meta = PagedMeta(positions=positions, slots=slots, page_table=self.page_table[slot:slot + 1, :nb],
                         context_lens=np.array([start + n], np.int32))
        p = seq.sampling_params
        inp = StepInputs(tokens=tokens, meta=meta, logits_index=np.array([n - 1], np.int32),
                         history=self.history[slot:slot + 1],
                         prompt_lens=np.array([seq.num_prompt_tokens], np.int32),
                         sample_pos=np.array([start + n], np.int32),
                         want_logprobs=np.bool_(p.logprobs is not None))
        return self._run_step(inp, [p], [seeds[seq.request_id]], [seq.num_output_tokens], 1)

    def _decode(self, items: list[ScheduledSeq], seeds):
        """Row r of the call is items[r]; rows past len(items) are idle padding."""
        s = buckets.pick(self.batch_buckets, len(items))
        tokens, positions = np.zeros((s, 1), np.int32), np.zeros((s, 1), np.int32)
        slots, ctx = np.zeros((s, 1), np.int32), np.ones((s,), np.int32)
        prompt_lens = np.zeros((s,), np.int32)
        rows_slot = np.zeros((s,), np.int64)  # padding rows read slot 0's (unused) tables
        params, row_seeds, generated = [None] * s, [None] * s, [0] * s
        for r, item in enumerate(items):
            seq, pos = item.seq, item.start_pos
            slot = rows_slot[r] = self._prepare_slot(item)
            tokens[r, 0], positions[r, 0], ctx[r] = item.token_ids[0], pos, pos + 1
            slots[r, 0] = self._flat_slots(slot, np.array([pos]))[0]
            prompt_lens[r] = seq.num_prompt_tokens
            params[r], row_seeds[r] = seq.sampling_params, seeds[seq.request_id]
            generated[r] = seq.num_output_tokens
        meta = self._decode_pages(rows_slot, ctx, len(items))
        meta = PagedMeta(positions=positions, slots=slots, context_lens=ctx, **meta)
        want = any(i.seq.sampling_params.logprobs is not None for i in items)
        inp = StepInputs(tokens=tokens, meta=meta, logits_index=np.zeros((s,), np.int32),
                         history=self.history[rows_slot], prompt_lens=prompt_lens,
                         sample_pos=ctx.copy(), want_logprobs=np.bool_(want))
        return self._run_step(inp, params, row_seeds, generated, s)

    def _decode_pages(self, rows_slot: np.ndarray, ctx: np.ndarray, n: int) -> dict:
        """The page table cut to a bucket, or (XLA path) the flat list of blocks in use."""
        counts = -(-ctx[:n] // self.block_size)  # [n] blocks per row
        if not self.ragged:
            nb = buckets.pick(self.decode_buckets, int(counts.max()))
            return {"page_table": self.page_table[rows_slot, :nb]}
        size = buckets.pick(buckets.ragged_block_buckets(len(rows_slot), self.max_blocks),
                            int(counts.sum()))
        ragged = np.zeros((3, size), np.int32)  # [3, P]; padding: block 0 of row 0, masked
        ragged[2] = np.iinfo(np.int32).max // 2
        rows = np.repeat(np.arange(n), counts)
        first = np.concatenate([np.arange(c) for c in counts])  # block index within its row
        ragged[0, :rows.size] = self.page_table[rows_slot[rows], first]
        ragged[1, :rows.size] = rows
        ragged[2, :rows.size] = first * self.block_size
        return {"page_table": np.zeros((len(rows_slot), 1), np.int32), "ragged": ragged}

    def _collect(self, items, rows, sampled) -> dict[str, SampleResult]:
        tokens, logprob = np.asarray(sampled.tokens), np.asarray(sampled.logprob)
        want = any(i.seq.sampling_params.logprobs is not None for i in items)
        top_ids = np.asarray(sampled.top_ids) if want else None
        top_lps = np.asarray(sampled.top_logprobs) if want else None
        results = {}
        for item, row in zip(items, rows):
            k = item.seq.sampling_params.logprobs
            top = None
            if k is not None:
                top = {int(t): float(lp) for t, lp in zip(top_ids[row, :k], top_lps[row, :k])}
            results[item.request_id] = SampleResult(int(tokens[row]), float(logprob[row]), top)
        return results


def _checked(attention, config, block_size: int) -> AttentionBackend:
    if not isinstance(attention, AttentionBackend):
        raise TypeError("attention must be an AttentionBackend (jaxserve/runtime/"
                        f"attention_backends.py), got {attention!r}")
    reasons = attention.supports(config, block_size)
    if reasons:
        raise ValueError(f"attention backend {attention.name!r} cannot run "
                         f"{', '.join(reasons)}")
    return attention


def step_modules(model: Model, attention: AttentionBackend, linear=None) -> dict:
    """The model with the backend's entry point for each step kind ("decode", "prefill")."""
    kw = {"linear": linear} if linear else {}
    return {"decode": model.module(attention=attention.decode, **kw),
            "prefill": model.module(attention=attention.prefill, **kw)}
