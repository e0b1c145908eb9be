"""Flax Llama-family decoder (Llama, SmolLM2, Qwen2/3, Phi-3): RMSNorm, RoPE, GQA, SwiGLU.

Layers are stacked and run with `nn.scan`, so compile time stays flat in model depth (the GPU
step runs them as separate blocks instead: `unroll_layers`, models/layer_layout.py). Attention
goes through a backend function so the paged KV cache (and Pallas kernels) plug in without
touching the model: `attention(q, k, v, cache, layer, meta) -> (out, cache)`. The whole cache
(all layers) rides in the scan carry and each layer updates its slice in place: a cache passed
as a scanned input/output would be copied whole every step.

Linear layers go through a backend too, `linear(x, kernel, parallel) -> y`, where `parallel` is
the layer's tensor-parallel role from `LINEAR_ROLES`, declared once here: the layers are built
from it and jaxserve/runtime/sharding.py derives the weights' partition specs from it, so the
backend shards a layer by what it is declared, not by its name.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp

from models import windowed
from models.config import ModelConfig
from models.fused import (FusedLinearFn, LinearParams, NormScale, PackedAttentionFn, fusable,
                          rope_fusable)
from models.moe import GroupedMatmulFn, MoEMLP, ragged_gmm
from models.gemma import GemmaRMSNorm
from models.layer_layout import layer_name
from models.lora import SLOT_LEAVES, LoRAFn, apply_lora, dense_lora_delta
from models.quantized import is_quantized
from models.rope import apply_rope, attention_factor, inv_frequencies

# Megatron roles: "column" splits the output features over devices, "row" the input features
# (its partial products are summed: one all-reduce per block); None is not split by role (the
# LM head is vocab-parallel or replicated by its own rule in sharding.py).
Parallel = Literal["column", "row"] | None
PARALLEL_ROLES = ("column", "row", None)

# The tensor-parallel role of every linear layer, by its module name.
LINEAR_ROLES: dict[str, Parallel] = {
    "q_proj": "column", "k_proj": "column", "v_proj": "column", "o_proj": "row",
    "gate_proj": "column", "up_proj": "column", "down_proj": "row", "lm_head": None}

AttentionFn = Callable[..., tuple[jnp.ndarray, Any]]
LinearFn = Callable[[jnp.ndarray, Any, Parallel], jnp.ndarray]
HeadFn = Callable[[jnp.ndarray, jnp.ndarray], jnp.ndarray]  # (x [..., D], embedding [V, D])


def dense_linear(x, w, parallel: Parallel = None):
    """`x [..., K] @ w [K, N]` accumulated in float32: the default linear backend.

    Backends for quantized weights (jaxserve/runtime/backends.py) accept a quantized weight
    (models/quantized.py) in place of w; `parallel` is for sharding wrappers (unused here).
    """
    del parallel
    if x.dtype == jnp.bfloat16 and math.prod(x.shape[:-1]) == 1:
        # XLA:CPU runs a one-row bf16 product as a matrix-vector kernel several times slower
        # than its two-row matrix product (docs/performance.md); elsewhere the row is free.
        two = jnp.concatenate([x.reshape(1, -1), jnp.zeros_like(x.reshape(1, -1))])  # [2, K]
        y = jnp.einsum("ri,io->ro", two, w, preferred_element_type=jnp.float32)
        return y[:1].reshape(*x.shape[:-1], w.shape[-1])
    return jnp.einsum("...i,io->...o", x, w, preferred_element_type=jnp.float32)


def tied_head(x, embedding):
    """Logits of a tied head, `x [..., D] @ embedding [V, D]^T` in float32: the default head
    backend (the native CPU one reads the embedding in its stored [V, D] layout too)."""
    return jnp.einsum("...D,VD->...V", x, embedding, preferred_element_type=jnp.float32)


def soft_cap(scores, softcap: float | None):
    """Gemma 2's attention-logit soft-capping `cap * tanh(s / cap)`, applied before the mask."""
    return scores if softcap is None else softcap * jnp.tanh(scores / softcap)


def dense_causal_attention(q, k, v, cache, layer, meta, *, window=None, softcap=None,
                           scale=None):
    """Full-sequence causal attention without a KV cache: the correctness oracle.

    q `[B, T, H, Dh]`, k/v `[B, T, K, Dh]`; `meta` is unused; returns `[B, T, H, Dh]`.
    window: int32 scalar (may be traced): a query at p sees keys in (p - window, p]; softcap:
    logits soft-capped before the mask; scale: logit scale (default 1 / sqrt(Dh)).
    """
    del layer, meta
    b, t, h, dh = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(b, t, kv_heads, h // kv_heads, dh)  # [B, T, K, G, Dh]
    sm_scale = jnp.float32(scale) if scale is not None else 1 / jnp.sqrt(jnp.float32(dh))
    scores = jnp.einsum("BTKGD,BSKD->BKGTS", q, k,
                        preferred_element_type=jnp.float32) * sm_scale
    scores = soft_cap(scores, softcap)
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))  # [T, S]
    if window is not None:
        qpos, kpos = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
        causal = causal & (kpos > qpos - window)
    scores = jnp.where(causal, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("BKGTS,BSKD->BTKGD", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, dh).astype(q.dtype), cache


def attention_kwargs(config: ModelConfig, layer) -> dict:
    """The extra attention arguments of `layer` (int32, traced inside the scan): window (an
    int32 scalar looked up by layer), softcap and scale (static floats). Empty for the plain
    Llama family, whose backends are called exactly as before."""
    c, kw = config, {}
    windows = windowed.layer_windows(c)
    if windows is not None:
        kw["window"] = jnp.asarray(windows)[layer]
    if c.attn_logit_softcapping is not None:
        kw["softcap"] = float(c.attn_logit_softcapping)
    if c.query_pre_attn_scalar is not None:
        kw["scale"] = float(c.query_pre_attn_scalar) ** -0.5
    return kw


def layer_rope(config: ModelConfig, x, positions, layer):
    """RoPE of `layer`; Gemma 3's sliding layers use their own base (rope_local_theta)."""
    inv_freq, rope_scale = inv_frequencies(config), attention_factor(config)
    full = apply_rope(x, positions, inv_freq, rope_scale)
    windows = windowed.layer_windows(config)
    if config.rope_local_theta is None or windows is None:  # no local layers
        return full
    # Local layers: plain RoPE at their own base (scaling, if any, is the global layers').
    local = inv_frequencies(dataclasses.replace(config, rope_theta=config.rope_local_theta,
                                                rope_scaling=None))
    is_local = jnp.asarray(windows != windowed.NO_WINDOW)[layer]
    return jnp.where(is_local, apply_rope(x, positions, local), full)


class Linear(nn.Module):
    """`y = x @ kernel (+ bias)`; kernel `[in, out]`. The seam for quantized linear backends.

    `parallel` is the layer's tensor-parallel role, handed to the backend with every call.
    """

    features: int
    use_bias: bool = False
    dtype: Any = jnp.float32
    out_dtype: Any = None  # defaults to dtype; the LM head keeps float32 logits
    parallel: Parallel = None
    linear: LinearFn = dense_linear
    lora_fn: LoRAFn = dense_lora_delta  # adapters' delta (models/lora.py)

    def __post_init__(self):
        if self.parallel not in PARALLEL_ROLES:
            raise ValueError(f"Linear parallel must be one of {PARALLEL_ROLES}, got "
                             f"{self.parallel!r}")
        super().__post_init__()

    @nn.compact
    def __call__(self, x, lora=None):
        """lora: each token's adapter slot `[T]` (models/lora.py), or None; applied when the
        params hold adapter slots for this layer (lora_a, lora_b, lora_on beside the
        kernel)."""
        # A quantized checkpoint stores an Int4Weight/Int8Weight under "kernel"; `param` would
        # check it against the float kernel's shape, so read it directly.
        stored = self.get_variable("params", "kernel")
        kernel = stored if is_quantized(stored) else self.param(
            "kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features), self.dtype)
        y = self.linear(x, kernel, self.parallel)
        if lora is not None and self.has_variable("params", "lora_a"):
            slots = tuple(self.get_variable("params", leaf) for leaf in SLOT_LEAVES)
            y = apply_lora(y, x, slots, lora, self.lora_fn)
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.features,), self.dtype)
        return y.astype(self.out_dtype or self.dtype)


def linear_layer(name: str, features: int, dtype, linear: LinearFn, use_bias: bool = False,
                 out_dtype=None, lora_fn: LoRAFn = dense_lora_delta) -> Linear:
    """The Linear called `name`, with its role from LINEAR_ROLES (the one declaration)."""
    return Linear(features, use_bias, dtype, out_dtype, parallel=LINEAR_ROLES[name],
                  linear=linear, lora_fn=lora_fn, name=name)


class RMSNorm(nn.Module):
    eps: float
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        # transformers casts back to the activation dtype before the weight multiply.
        return scale * normed.astype(self.dtype)


def norm_class(config: ModelConfig):
    """Gemma's RMSNorm scales by (1 + w) in float32; the rest of the family by w."""
    return GemmaRMSNorm if config.architecture in windowed.GEMMA else RMSNorm


class Attention(nn.Module):
    config: ModelConfig
    attention: AttentionFn
    dtype: Any = jnp.float32
    linear: LinearFn = dense_linear
    lora_fn: LoRAFn = dense_lora_delta
    fused: FusedLinearFn | None = None  # with norm_scale and residual given (Block's choice)
    # The attention on q, k, v side by side, as the fused q/k/v kernel makes them with RoPE.
    attention_packed: PackedAttentionFn | None = None

    @nn.compact
    def __call__(self, x, positions, cache, layer, meta, lora=None, norm_scale=None,
                 residual=None):
        """Plain: x is the normed input, returns (o_proj's output, cache). Fused (`fused`
        with norm_scale `[D]` and residual `[B, T, D]`): x is the block's input, normed by the
        projections' kernel, and the result is residual + o_proj's output."""
        c = self.config
        b, t, d = x.shape
        bias, lin = c.attention_bias, self.linear
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        def proj(name, features, use_bias=False):
            return linear_layer(name, features, self.dtype, lin, use_bias,
                                lora_fn=self.lora_fn)
        if norm_scale is not None:  # one kernel: the norm and q, k, v side by side
            w = [LinearParams(n, d, bias, self.dtype, name=name)() for name, n in
                 (("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size))]
            packed = self.attention_packed is not None and rope_fusable(c)
            rope = dict(positions=positions.reshape(-1), inv_freq=inv_frequencies(c),
                        rope_weights=2, rope_scale=attention_factor(c)) if packed else {}
            qkv = self.fused(x.reshape(b * t, d), tuple(k for k, _ in w), norm_scale,
                             tuple(bb for _, bb in w) if bias else None,
                             eps=c.rms_norm_eps, **rope)  # [B * T, (H + 2K) * Dh]
            if packed:  # q and k rotated: the attention kernel reads the kernel's output
                heads = qkv.reshape(b, t, c.num_heads + 2 * c.num_kv_heads, c.head_dim)
                with jax.named_scope("attention"):
                    out, cache = self.attention_packed(heads, cache, layer, meta,
                                                       num_heads=c.num_heads,
                                                       **attention_kwargs(c, layer))
                return self._output(out, residual, lora), cache
            q, k, v = jnp.split(qkv.reshape(b, t, -1), (q_size, q_size + kv_size), axis=-1)
        else:
            q = proj("q_proj", q_size, bias)(x, lora)
            k = proj("k_proj", kv_size, bias)(x, lora)
            v = proj("v_proj", kv_size, bias)(x, lora)
        if c.qk_norm == "full":  # OLMoE: over the whole projection, before the head split
            q = RMSNorm(c.rms_norm_eps, self.dtype, name="q_norm")(q)  # [B, T, H * Dh]
            k = RMSNorm(c.rms_norm_eps, self.dtype, name="k_norm")(k)  # [B, T, K * Dh]
        q = q.reshape(b, t, c.num_heads, c.head_dim)  # [B, T, H, Dh]
        k = k.reshape(b, t, c.num_kv_heads, c.head_dim)  # [B, T, K, Dh]
        if c.qk_norm == "per_head":  # Qwen3, Gemma 3: each head over head_dim
            q = norm_class(c)(c.rms_norm_eps, self.dtype, name="q_norm")(q)
            k = norm_class(c)(c.rms_norm_eps, self.dtype, name="k_norm")(k)
        v = v.reshape(b, t, c.num_kv_heads, c.head_dim)  # [B, T, K, Dh]
        q, k = layer_rope(c, q, positions, layer), layer_rope(c, k, positions, layer)
        with jax.named_scope("attention"):  # the paged-attention kernel, not the projections
            out, cache = self.attention(q, k, v, cache, layer, meta, **attention_kwargs(c, layer))
        return self._output(out, residual, lora), cache

    def _output(self, out, residual, lora):
        """o_proj of the attention's output `[B, T, H, Dh]`; fused (residual given): one
        kernel for it and the residual add."""
        c = self.config
        b, t, _, _ = out.shape
        q_size = c.num_heads * c.head_dim
        out = out.reshape(b, t, q_size)
        if residual is not None:
            d = residual.shape[-1]
            wo, _ = LinearParams(c.hidden_size, q_size, False, self.dtype, name="o_proj")()
            y = self.fused(out.reshape(b * t, q_size), (wo,),
                           residual=residual.reshape(b * t, d))  # [B * T, D]
            return y.reshape(b, t, d)
        return linear_layer("o_proj", c.hidden_size, self.dtype, self.linear,
                            lora_fn=self.lora_fn)(out, lora)


class MLP(nn.Module):
    config: ModelConfig
    dtype: Any = jnp.float32
    linear: LinearFn = dense_linear
    lora_fn: LoRAFn = dense_lora_delta
    fused: FusedLinearFn | None = None  # with norm_scale and residual given (Block's choice)

    @nn.compact
    def __call__(self, x, lora=None, norm_scale=None, residual=None):
        """Plain: x normed, returns down_proj's output. Fused: x is the residual stream
        (normed in the gate/up kernel), returns residual + down_proj's output."""
        f, lin = self.config.intermediate_size, self.linear
        if norm_scale is not None:  # two kernels: norm, gate, up, SiLU; down and the residual
            b, t, d = x.shape
            (wg, _), (wu, _) = (LinearParams(f, d, False, self.dtype, name=name)()
                                for name in ("gate_proj", "up_proj"))
            h = self.fused(x.reshape(b * t, d), (wg, wu), norm_scale,
                           eps=self.config.rms_norm_eps, activation="silu")  # [B * T, F]
            wd, _ = LinearParams(d, f, False, self.dtype, name="down_proj")()
            y = self.fused(h, (wd,), residual=residual.reshape(b * t, d))  # [B * T, D]
            return y.reshape(b, t, d)
        def proj(name, features):
            return linear_layer(name, features, self.dtype, lin, lora_fn=self.lora_fn)
        gate = proj("gate_proj", f)(x, lora)
        up = proj("up_proj", f)(x, lora)
        # Gemma's GeGLU: transformers' gelu_pytorch_tanh is the tanh approximation.
        act = (functools.partial(jax.nn.gelu, approximate=True)
               if self.config.hidden_act == "gelu_pytorch_tanh" else jax.nn.silu)
        return proj("down_proj", self.config.hidden_size)(act(gate) * up, lora)


class Block(nn.Module):
    config: ModelConfig
    attention: AttentionFn
    dtype: Any = jnp.float32
    linear: LinearFn = dense_linear
    grouped_matmul: GroupedMatmulFn = ragged_gmm  # MoE experts (models/moe.py)
    lora_fn: LoRAFn = dense_lora_delta
    fused: FusedLinearFn | None = None
    attention_packed: PackedAttentionFn | None = None

    @nn.compact
    def __call__(self, carry, positions, meta, lora=None):
        x, cache, layer = carry
        c = self.config
        b, t, d = x.shape
        if self.fused is not None and b * t <= self.fused.max_rows and lora is None:
            # A decode-sized step: each norm goes into the projections' kernel and each
            # residual add into the kernel before it (models/fused.py). Same params.
            x, cache = Attention(c, self.attention, self.dtype, self.linear, self.lora_fn,
                                 self.fused, self.attention_packed, name="attn")(
                x, positions, cache, layer, meta, None,
                norm_scale=NormScale(d, self.dtype, name="input_norm")(), residual=x)
            x = MLP(c, self.dtype, self.linear, self.lora_fn, self.fused, name="mlp")(
                x, None, norm_scale=NormScale(d, self.dtype, name="post_norm")(), residual=x)
            return (x, cache, layer + 1), None
        norm = functools.partial(norm_class(c), c.rms_norm_eps, self.dtype)
        h = norm(name="input_norm")(x)
        h, cache = Attention(c, self.attention, self.dtype, self.linear, self.lora_fn,
                             name="attn")(h, positions, cache, layer, meta, lora)
        if c.architecture in windowed.GEMMA:  # Gemma's sandwich: a norm after each sub-block
            h = norm(name="post_attn_norm")(h)
        x = x + h
        h = norm(name="post_norm")(x)
        # Flax puts module names on jax's name stack, so profiles already read ".../attn/...",
        # ".../mlp/..." (jaxserve/telemetry/profiling.py); Attention adds "attention" around the kernel.
        if c.num_experts:  # models/moe.py; the experts are not adapted
            h = MoEMLP(c, self.dtype, self.grouped_matmul, name="mlp")(h)
        else:
            h = MLP(c, self.dtype, self.linear, self.lora_fn, name="mlp")(h, lora)
        if c.architecture in windowed.GEMMA:
            h = norm(name="post_mlp_norm")(h)
        return (x + h, cache, layer + 1), None


class Llama(nn.Module):
    """Decoder-only transformer. Returns float32 logits `[B, T, V]` and the updated KV cache."""

    config: ModelConfig
    dtype: Any = jnp.float32
    attention: AttentionFn = dense_causal_attention
    linear: LinearFn = dense_linear
    # The MoE experts' grouped matmul (models/moe.py; jaxserve/runtime/grouped_matmul.py).
    grouped_matmul: GroupedMatmulFn = ragged_gmm
    # Layers as L separate blocks ("layers_0", ...; params from unstack_layers) instead of one
    # loop over stacked weights, where XLA:GPU first copies each layer's weight slices into
    # fresh buffers (a kernel operand must be a whole buffer): docs/gpu_step_report.md. The
    # loop keeps compile time flat in depth, so CPU and tests keep it.
    unroll_layers: bool = False
    # The tied LM head, x @ embedding^T (jaxserve/runtime/backends.py head_backend).
    head: HeadFn = tied_head
    # LoRA adapters' delta in every adapted linear (models/lora.py).
    lora_fn: LoRAFn = dense_lora_delta
    # Decode-sized steps run each block's linears with their norms and residual adds fused
    # (models/fused.py; the GPU step's kernel). Only for a model fusable() takes.
    fused_linear: FusedLinearFn | None = None
    # With fused linears: the attention backend's entry point for q, k, v as the q/k/v kernel
    # packs and rotates them (attention_backends.py attend_packed), where RoPE can be fused.
    attention_packed: PackedAttentionFn | None = None

    @nn.compact
    def __call__(self, tokens, positions, kv_cache=None, meta=None, logits_index=None,
                 lora=None, return_hidden: bool = False):
        """tokens, positions `[B, T]` int32; kv_cache: the attention backend's cache or None.

        With `logits_index` `[R]` (indices into the B * T tokens, row-major), only those get
        logits (`[R, V]`): a step samples after each sequence's last token, and the LM head over
        every prompt token would cost more than a layer. `lora`: each of the B * T tokens'
        adapter slot `[B * T]` int32 (-1: none), for params holding adapter slots.
        return_hidden (static): also return every token's final hidden state after the final
        norm, `[B * T, D]` in the model's dtype (what embeddings pool), as a third output.
        """
        c = self.config
        if self.fused_linear is not None and fusable(c):
            raise ValueError(f"fused linears cannot run this model: {fusable(c)}")
        embedding = self.param("embedding", nn.initializers.normal(0.02),
                               (c.vocab_size, c.hidden_size), self.dtype)
        x = jnp.take(embedding, tokens, axis=0)  # [B, T, D]
        if c.architecture in windowed.GEMMA:  # sqrt(D) rounded to the activation dtype, as HF
            x = x * jnp.asarray(math.sqrt(c.hidden_size), self.dtype)
        carry = (x, kv_cache, jnp.int32(0))
        if self.unroll_layers:
            for i in range(c.num_layers):
                carry, _ = Block(c, self.attention, self.dtype, self.linear,
                                 self.grouped_matmul, self.lora_fn, self.fused_linear,
                                 self.attention_packed, name=layer_name(i))(
                    carry, positions, meta, lora)
        else:
            layers = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                             in_axes=(nn.broadcast, nn.broadcast, nn.broadcast),
                             length=c.num_layers)
            carry, _ = layers(c, self.attention, self.dtype, self.linear, self.grouped_matmul,
                              self.lora_fn, self.fused_linear, self.attention_packed,
                              name="layers")(
                carry, positions, meta, lora)
        x, kv_cache, _ = carry
        # A quantized model may carry its own (quantized) copy of a tied head under lm_head.
        tied = c.tie_word_embeddings and not self.has_variable("params", "lm_head")
        rows = x.shape[0] * x.shape[1] if logits_index is None else logits_index.shape[0]
        if (self.fused_linear is not None and not return_hidden and
                rows <= self.fused_linear.max_rows and c.vocab_size % self.fused_linear.tile == 0):
            logits = self._fused_head(x.reshape(-1, x.shape[-1]), logits_index, embedding, tied)
            if logits_index is None:
                logits = logits.reshape(*x.shape[:2], c.vocab_size)  # [B, T, V]
        else:
            final_norm = norm_class(c)(c.rms_norm_eps, self.dtype, name="final_norm")
            # Normed apart from the logits rows, so the logits are computed as without it.
            hidden = (final_norm(x.reshape(-1, x.shape[-1])) if return_hidden
                      else None)  # [B * T, D]
            if logits_index is not None:
                x = x.reshape(-1, x.shape[-1])[logits_index]  # [R, D]
            x = final_norm(x)
            if tied:
                logits = self.head(x, embedding)
            else:
                logits = linear_layer("lm_head", c.vocab_size, self.dtype, self.linear,
                                      out_dtype=jnp.float32)(x)
        if c.final_logit_softcapping is not None:
            logits = soft_cap(logits.astype(jnp.float32), c.final_logit_softcapping)
        if return_hidden:
            return logits.astype(jnp.float32), kv_cache, hidden
        return logits.astype(jnp.float32), kv_cache

    def _fused_head(self, x, logits_index, embedding, tied):
        """The logits rows' gather, the final norm and the LM head in one fused call: x
        `[B * T, D]`, returns `[R, V]` float32 (R: logits_index's rows, else all). The params
        are the plain head's (final_norm's scale; lm_head's kernel, or the embedding)."""
        c = self.config
        scale = NormScale(c.hidden_size, self.dtype, name="final_norm")()
        w = (embedding if tied else
             LinearParams(c.vocab_size, c.hidden_size, False, self.dtype, name="lm_head")()[0])
        rows = (jnp.arange(x.shape[0], dtype=jnp.int32) if logits_index is None
                else logits_index)  # [R]
        return self.fused_linear(x, (w,), scale, x_rows=rows, eps=c.rms_norm_eps,
                                 transposed=tied, out_dtype=jnp.float32)  # [R, V]
