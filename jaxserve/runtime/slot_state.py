"""Per-slot batch state that lives on the device, changed by deltas when a slot changes.

Each of the `max_num_seqs` batch slots (plus one idle slot that padding rows and tokens point
at) keeps its sequence's sampling parameters, seed, prompt length, token history (for the
penalties) and the last token sampled for it. A step reads its rows' state by slot and writes
back the step's tokens and samples; the host sends a slot's state only when a sequence takes
the slot (`SlotsCall`), not every step.

The last sampled token is what makes asynchronous scheduling cheap: the next step's input
token of a decoding sequence is read from it on the device, before the host has seen the id.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.runtime.sampler import SamplingTensors


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotState:
    sampling: SamplingTensors  # [S + 1] per field (num_generated unused: derived per step)
    prompt_lens: jax.Array     # [S + 1] int32
    history: jax.Array         # [S + 1, L] int32: prompt + output ids by position
    last_tokens: jax.Array     # [S + 1] int32: the last id sampled for the slot's sequence
    lora: jax.Array            # [S + 1] int32: the sequence's LoRA device slot (-1: none)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotsCall:
    """New sequences' state for D slots (padded with the idle slot, which stays idle)."""

    slots: jax.Array           # [D] int32
    sampling: SamplingTensors  # [D]
    prompt_lens: jax.Array     # [D] int32
    history: jax.Array         # [D, L] int32
    lora: jax.Array            # [D] int32

    @property
    def shape(self) -> tuple[int]:
        return (self.slots.shape[0],)


def new_state(num_slots: int, max_model_len: int) -> SlotState:
    """Host arrays of `num_slots` idle slots (the runner puts them on the device)."""
    return SlotState(sampling=SamplingTensors.from_params([], [], [], size=num_slots),
                     prompt_lens=np.zeros((num_slots,), np.int32),  # [S + 1]
                     history=np.zeros((num_slots, max_model_len), np.int32),  # [S + 1, L]
                     last_tokens=np.zeros((num_slots,), np.int32),
                     lora=np.full((num_slots,), -1, np.int32))  # [S + 1]


def slots_call(slots: list[int], params, seeds, prompt_lens: list[int],
               tokens: list[list[int]], *, size: int, idle_slot: int, max_model_len: int,
               eos_ids=(), lora_slots=None) -> SlotsCall:
    """The delta writing `slots[i]`'s state: params[i], seeds[i], its known tokens, its
    adapter's device slot lora_slots[i] (None: no adapters)."""
    ids = np.full((size,), idle_slot, np.int32)  # [D]
    ids[:len(slots)] = slots
    history = np.zeros((size, max_model_len), np.int32)  # [D, L]
    lens = np.zeros((size,), np.int32)
    lora = np.full((size,), -1, np.int32)  # [D]
    if lora_slots:
        lora[:len(lora_slots)] = lora_slots
    for i, toks in enumerate(tokens):
        history[i, :len(toks)] = toks
        lens[i] = prompt_lens[i]
    sampling = SamplingTensors.from_params(params, seeds, [0] * len(params), eos_ids, size=size)
    return SlotsCall(slots=ids, sampling=sampling, prompt_lens=lens, history=history,
                     lora=lora)


def write_slots(state: SlotState, call: SlotsCall) -> SlotState:
    """Applies a SlotsCall (jitted with the state donated)."""
    at = call.slots
    sampling = jax.tree.map(lambda a, b: a.at[at].set(b), state.sampling, call.sampling)
    return SlotState(sampling=sampling, prompt_lens=state.prompt_lens.at[at].set(call.prompt_lens),
                     history=state.history.at[at].set(call.history),
                     last_tokens=state.last_tokens.at[at].set(0),
                     lora=state.lora.at[at].set(call.lora))


def rows_sampling(state: SlotState, row_slot, context_lens) -> SamplingTensors:
    """The rows' sampling tensors; num_generated is each row's outputs before this sample."""
    st = jax.tree.map(lambda a: a[row_slot], state.sampling)
    generated = jnp.maximum(context_lens - state.prompt_lens[row_slot], 0)
    return dataclasses.replace(st, num_generated=generated)


def set_in_bounds(x: jax.Array, index: tuple[jax.Array, ...], values: jax.Array) -> jax.Array:
    """x.at[index].set(values): index one `[N]` array per leading axis of x, all in bounds (a
    step's slots and positions), values `[N]`. A one-token step writes with a dynamic update
    slice: XLA runs a scatter of one element as three kernels on a GPU (its out-of-bounds
    check, the old value, the update), where in-bounds indices need one."""
    if values.shape[0] == 1:
        return jax.lax.dynamic_update_slice(
            x, values.reshape((1,) * len(index)).astype(x.dtype), tuple(i[0] for i in index))
    return x.at[index].set(values)
