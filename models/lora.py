"""What a LoRA adapter may adapt and the error its files raise, kept at the bottom layer so the
adapter loader (models/lora_weights.py) raises the very exception the engine and server catch:
models/ cannot import jaxserve, whose core/lora.py re-exports both. Plain Python: no jax."""

from __future__ import annotations

# The projections an adapter may target, by our module names (models/llama.py LINEAR_ROLES
# without the LM head: heads and embeddings are left alone).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRAError(ValueError):
    """An adapter cannot be served, or a LoRA request is malformed; nothing changed.

    status: the HTTP status a server answers with (400 bad files or arguments, 404 unknown
    adapter, 409 an adapter still in use)."""

    status = 400
