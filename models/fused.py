"""What a block needs to run its linears through a fused-linear backend (the GPU decode step's
pallas_kernels/fused_linear.py): the backend's interface, which models and steps may take it,
and modules that declare a Linear's or an RMSNorm's params without applying them, so the fused
block reads the same param tree as the plain one (models/llama.py)."""

from __future__ import annotations

from typing import Any, Callable, Protocol

import flax.linen as nn
import jax.numpy as jnp

from models import windowed
from models.config import ModelConfig


class FusedLinearFn(Protocol):
    """`y = residual + epilogue(rmsnorm(x) @ [W_0 | W_1 ...])` for x `[M, K]`, M <= max_rows
    (pallas_kernels/fused_linear.py `fused_linear` gives the contract); the LM head takes
    x_rows (the rows of x to compute), transposed weights (a tied head's `[V, D]`) and
    float32 out. Every weight's width must be a multiple of `tile`."""

    max_rows: int
    tile: int

    def __call__(self, x, weights, norm_scale=None, biases=None, residual=None,
                 positions=None, inv_freq=None, x_rows=None, *, eps: float = 1e-6,
                 activation: str | None = None, rope_weights: int = 0,
                 rope_scale: float = 1.0, transposed: bool = False, out_dtype=None): ...


# attend_packed(qkv [1, T, H + 2K, Dh], cache, layer, meta, *, num_heads, **attention kwargs)
# -> (out [1, T, H, Dh], cache): jaxserve/runtime/attention_backends.py.
PackedAttentionFn = Callable[..., tuple]


def fusable(config: ModelConfig) -> str | None:
    """None when every block of `config` can run fused, else why not: the fused block is the
    plain pre-norm Llama block (RMSNorm scaled by w, SwiGLU MLP, q/k/v/o projections)."""
    c = config
    if c.architecture in windowed.GEMMA:
        return "Gemma's (1 + w) norms and sandwich norms"
    if c.num_experts:
        return "MoE experts"
    if c.qk_norm == "full":
        return "a q/k norm over the whole projection"
    if c.hidden_act != "silu":
        return f"activation {c.hidden_act!r} (the kernel has SiLU)"
    return None


def rope_fusable(config: ModelConfig) -> bool:
    """Whether the q/k/v kernel can rotate q and k itself: no norm between the projection and
    RoPE (Qwen3's per-head q/k norm needs the whole head), one RoPE for every layer (fusable()
    already leaves out Gemma's local layers), and half a head a multiple of the kernel's
    16-column tile."""
    return config.qk_norm == "none" and (config.head_dim // 2) % 16 == 0


class LinearParams(nn.Module):
    """A Linear's params (models/llama.py Linear: kernel `[in, out]`, lecun-normal; bias
    zeros), returned as `(kernel, bias or None)` instead of applied."""

    features: int
    in_features: int
    use_bias: bool = False
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self):
        kernel = self.param("kernel", nn.initializers.lecun_normal(),
                            (self.in_features, self.features), self.dtype)
        bias = (self.param("bias", nn.initializers.zeros, (self.features,), self.dtype)
                if self.use_bias else None)
        return kernel, bias


class NormScale(nn.Module):
    """An RMSNorm's scale `[D]` (models/llama.py RMSNorm's one param), returned, not applied."""

    features: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self):
        return self.param("scale", nn.initializers.ones, (self.features,), self.dtype)
