"""Writing LoRA adapters into the device slots the runner's params hold (models/lora.py).

`SlotWriter` makes an adapter's `LoRACall` (every adapted module's A [L, K, R] and B [L, R, N],
zeros for a module the adapter leaves alone, so every load is the same program) and applies
one to the params: a jitted write of one slot, the slot arrays donated, every other leaf kept
as it is. The runner runs the call like its others (multihost.py sees each one).
"""

from __future__ import annotations

import jax
import numpy as np

from jaxserve.runtime.step_call import LoRACall
from models import lora


class SlotWriter:
    def __init__(self, params, num_layers: int, max_loras: int, sharded: bool):
        """params: the runner's (placed) params holding the slots; sharded: keep each slot
        array's sharding across the donation (tensor parallelism)."""
        leaves = lora.slot_leaves(params, num_layers)
        if not leaves:
            raise ValueError("the program has LoRA slots but the params hold none: build the "
                             "runner with runner_factory.build_runner")
        self.num_layers, self.max_loras = num_layers, max_loras
        shard = ({"out_shardings": jax.tree.map(lambda x: x.sharding, leaves)}
                 if sharded else {})
        self.write = jax.jit(lora.write_slot, donate_argnums=(0,), **shard)
        # What a load carries per module: A [L, K, R], B [L, R, N] (zeros: not adapted).
        self._zeros = {
            name: (np.zeros((num_layers, a.shape[-3], a.shape[-1]), np.float32),
                   np.zeros((num_layers,) + b.shape[-2:], np.float32))
            for (name, layer), (a, b, _) in leaves.items() if layer in (None, 0)}

    def call(self, slot: int, adapter) -> LoRACall:
        """Writing `adapter` (models/lora_weights.py AdapterWeights; None: zeros) into `slot`."""
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"LoRA slot {slot} is out of range [0, {self.max_loras})")
        modules = {} if adapter is None else adapter.modules
        weights = {}
        for name, (za, zb) in self._zeros.items():
            a, b = modules.get(name, (za, zb))
            if np.shape(a) != za.shape or np.shape(b) != zb.shape:
                raise ValueError(f"LoRA weights of {name}: shapes {np.shape(a)}, {np.shape(b)} "
                                 f"where the slots hold {za.shape}, {zb.shape}")
            weights[name] = (np.asarray(a, np.float32), np.asarray(b, np.float32))
        return LoRACall(np.int32(slot), weights)

    def arguments(self, params, call: LoRACall) -> tuple:
        """The jitted write's arguments for `call` on `params`."""
        return (lora.slot_leaves(params, self.num_layers), call.slot, call.weights)

    @staticmethod
    def apply(params, written) -> dict:
        """params with the written slot arrays in place of the donated ones."""
        return lora.replace_slot_leaves(params, written)
