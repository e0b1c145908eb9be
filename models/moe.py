"""Mixture-of-experts MLP (Mixtral, Qwen3-MoE, OLMoE): top-k routing and a grouped matmul.

Each token picks its top-k experts by router softmax; its k (token, expert) pairs are sorted by
expert so that every expert's rows are contiguous, and each expert projection is one grouped
matmul over the sorted rows with the per-expert row counts as group sizes (no Python loop
over experts, the number of programs independent of the routing). The rows
are put back in token order by a gather (deterministic, unlike a scatter-add) and summed with
their routing weights.

Expert weights are stacked per layer: gate/up `[E, D, F]`, down `[E, F, D]`, router `[D, E]`
(the decoder's `nn.scan` adds the leading `[L]`). They are not Linear layers: tensor
parallelism splits them by `EXPERT_ROLES` (runtime/sharding.py), and w8a16 quantizes them
per expert and output channel (jaxserve/quantization/moe.py); other quantization paths refuse
MoE models.

The grouped matmul is a backend, injected like the Linears' (`grouped_matmul(a, w,
group_sizes, parallel) -> [M, N] float32`, `parallel` the kernel's EXPERT_ROLES role):
`ragged_gmm` here is the default and the oracle; jaxserve/runtime/grouped_matmul.py supplies
the Pallas kernel and the tiled XLA path (pallas_kernels/grouped_matmul.py), which do not
compute every expert for every row as XLA's `ragged_dot` does (docs/moe.md).
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.config import ModelConfig
from models.quantized import Int8Weight, is_quantized


# Tensor-parallel role of each stacked expert kernel, as LINEAR_ROLES declares the Linears':
# gate/up split their F outputs over devices and down its F inputs, so every device runs every
# expert on its share of F and the MLP ends in one all-reduce, like the dense MLP. The router
# (and so the routing) is replicated.
EXPERT_ROLES = {"gate": "column", "up": "column", "down": "row"}


def route(x, router, k: int, renormalize: bool):
    """Top-k routing of tokens x `[N, D]` with router `[D, E]`, as transformers does.

    Softmax over all E logits in float32, top-k of the probabilities, optionally renormalised
    over the k chosen (`norm_topk_prob`; Mixtral's softmax over its top-k logits is the same).
    Returns (logits `[N, E]` float32, weights `[N, k]` float32, experts `[N, k]` int32).
    """
    logits = jnp.einsum("ND,DE->NE", x, router, preferred_element_type=jnp.float32)  # [N, E]
    probs = jax.nn.softmax(logits, axis=-1)  # [N, E]
    weights, experts = jax.lax.top_k(probs, k)  # [N, k], [N, k]
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return logits, weights, experts.astype(jnp.int32)


def sort_by_expert(experts, num_experts: int):
    """experts `[N, k]` -> (order `[N*k]`, group_sizes `[E]` int32).

    `order` lists the flat (token, slot) pairs grouped by expert (stable, so a group keeps
    token order); pair p belongs to token p // k. An expert no token chose has group size 0.
    """
    flat = experts.reshape(-1)  # [N*k]
    order = jnp.argsort(flat, stable=True)  # [N*k]
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)  # [E]
    return order, group_sizes


# ragged_dot on int8 codes stored output-major ([E, N, K], models/quantized.py): contract K.
_OUTPUT_MAJOR = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0])


def int8_expert_arrays(w: Int8Weight):
    """(codes `[E, N, K]` int8, scales `[E, N]`) of w8a16 experts; other quantized weights are
    refused: the MoE paths take int8 per-channel symmetric weights only."""
    if not isinstance(w, Int8Weight) or w.offsets is not None or w.scales.shape[-2] != 1:
        groups = getattr(getattr(w, "scales", None), "shape", (0, 0))[-2]
        raise ValueError("MoE experts run int8 per-channel symmetric weights only (w8a16); got "
                         f"{type(w).__name__} with {groups} groups")
    return w.q8, w.scales[..., 0, :]


def ragged_gmm(a, w, group_sizes, parallel: str | None = None):
    """a `[M, K]` (rows grouped by expert) @ each group's expert of w `[E, K, N]` -> `[M, N]`
    float32, by `jax.lax.ragged_dot`: the default grouped matmul and the tests' oracle.
    An Int8Weight (per output channel, symmetric: w8a16's experts) is converted to a's dtype
    inside the product (exact) and its per-(expert, channel) scale applied per row.
    `parallel` (the kernel's EXPERT_ROLES role) is for sharding wrappers (unused here)."""
    del parallel
    if not is_quantized(w):
        return jax.lax.ragged_dot(a, w, group_sizes, preferred_element_type=jnp.float32)
    q8, scales = int8_expert_arrays(w)
    y = jax.lax.ragged_dot_general(a, q8.astype(a.dtype), group_sizes, _OUTPUT_MAJOR,
                                   preferred_element_type=jnp.float32)  # [M, N]
    row_expert = jnp.repeat(jnp.arange(group_sizes.shape[0]), group_sizes,
                            total_repeat_length=a.shape[0])  # [M]
    return y * jnp.take(scales, row_expert, axis=0).astype(jnp.float32)


GroupedMatmulFn = Callable[[jnp.ndarray, Any, jnp.ndarray, "str | None"], jnp.ndarray]


def grouped_ffn(xs, gate, up, down, group_sizes, dtype, gmm: GroupedMatmulFn = ragged_gmm):
    """SwiGLU expert FFN over rows sorted by expert: xs `[M, D]`, gate/up `[E, D, F]`,
    down `[E, F, D]` (float, or Int8Weight), group_sizes `[E]` (summing to M). Returns
    `[M, D]` in `dtype`."""
    def mm(a, w, name):
        return gmm(a, w, group_sizes, EXPERT_ROLES[name])

    h = (jax.nn.silu(mm(xs, gate, "gate").astype(dtype))
         * mm(xs, up, "up").astype(dtype))  # [M, F]
    return mm(h, down, "down").astype(dtype)  # [M, D]


def moe_ffn(x, router, gate, up, down, k: int, renormalize: bool,
            gmm: GroupedMatmulFn = ragged_gmm):
    """The MoE MLP on tokens x `[N, D]`; returns (`[N, D]` in x's dtype, experts `[N, k]`)."""
    n, d = x.shape
    num_experts = router.shape[-1]
    _, weights, experts = route(x, router, k, renormalize)
    order, group_sizes = sort_by_expert(experts, num_experts)
    xs = jnp.take(x, order // k, axis=0)  # [N*k, D], grouped by expert
    ys = grouped_ffn(xs, gate, up, down, group_sizes, x.dtype, gmm)  # [N*k, D]
    back = jnp.argsort(order)  # [N*k]: the sorted row of each (token, slot) pair
    ys = jnp.take(ys, back, axis=0).reshape(n, k, d)  # [N, k, D]
    # transformers weights each expert's output in the activation dtype, then sums.
    out = jnp.sum(ys * weights.astype(x.dtype)[..., None], axis=1)  # [N, D]
    return out.astype(x.dtype), experts


# Flax initialisers for the stacked expert kernels: fan-in along D (gate/up) or F (down).
_EXPERT_INIT = nn.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))


class MoEMLP(nn.Module):
    """The Block's MLP when `config.num_experts > 0`; x `[B, T, D]` -> `[B, T, D]`."""

    config: ModelConfig
    dtype: Any = jnp.float32
    grouped_matmul: GroupedMatmulFn = ragged_gmm

    @nn.compact
    def __call__(self, x):
        c = self.config
        e, d, f = c.num_experts, c.hidden_size, c.moe_intermediate_size
        router = self.param("router", nn.initializers.lecun_normal(), (d, e), self.dtype)
        gate = self._experts("gate", (e, d, f))  # [E, D, F]
        up = self._experts("up", (e, d, f))  # [E, D, F]
        down = self._experts("down", (e, f, d))  # [E, F, D]
        flat = x.reshape(-1, d)  # [B*T, D]
        out, experts = moe_ffn(flat, router, gate, up, down, c.num_experts_per_tok,
                               c.norm_topk_prob, self.grouped_matmul)
        # Kept only when the caller asks for "intermediates" (the routing tests); else a no-op.
        self.sow("intermediates", "experts", experts.reshape(*x.shape[:-1], -1))  # [B, T, k]
        return out.reshape(x.shape)

    def _experts(self, name: str, shape):
        # A w8a16 model stores an Int8Weight here; `param` would check it against the float
        # shape, so read it directly (as models/llama.py's Linear does).
        stored = self.get_variable("params", name)
        if is_quantized(stored):
            return stored
        return self.param(name, _EXPERT_INIT, shape, self.dtype)
