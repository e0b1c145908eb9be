"""What a LoRA adapter may adapt and the error its files raise, kept at the bottom layer and
free of jax, so the adapter loader (models/lora_weights.py) raises the very exception the
engine and server catch: models/ cannot import jaxserve, whose core/lora.py re-exports both."""

from __future__ import annotations

# The projections an adapter may target, by our module names (models/llama.py LINEAR_ROLES
# without the LM head: heads and embeddings are left alone).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRAError(ValueError):
    """An adapter cannot be served, or a LoRA request is malformed; nothing changed.

    status: the HTTP status a server answers with (400 bad files or arguments, 404 unknown
    adapter, 409 an adapter still in use)."""

    status = 400


def module_shapes(config) -> dict[str, tuple[int, int]]:
    """(K, N) of each adaptable projection of a layer (our [in, out] kernels)."""
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {"q_proj": (c.hidden_size, q), "k_proj": (c.hidden_size, kv),
            "v_proj": (c.hidden_size, kv), "o_proj": (q, c.hidden_size),
            "gate_proj": (c.hidden_size, c.intermediate_size),
            "up_proj": (c.hidden_size, c.intermediate_size),
            "down_proj": (c.intermediate_size, c.hidden_size)}


# Where each projection lives in a layer's params.
MODULE_PARENT = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "o_proj": "attn",
                 "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
