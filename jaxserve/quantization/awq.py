"""AWQ (Lin et al., 2024): activation-aware per-input-channel scales, folded into the previous op.

For linears y = x W that share an input x [M, K], a scale s [K] > 0 rewrites y = (x / s)(s W):
exact in float, but the rounding error of s W on channel k shrinks relative to the weight's
magnitude there, which matters most where |x_k| is large (the salient channels). AWQ sets
s = mean|x|^alpha (normalised so that max(s) min(s) = 1) and picks alpha on a grid of 20 points
in [0, 1] to minimise ||x W - (x / s) Q(s W)||^2 over the stage's linear outputs on calibration
inputs; alpha = 0 is plain round-to-nearest, so the search never does worse than RTN on them.

The 1/s goes into the op that produces x, so the served model is still a plain Llama:
    q/k/v_proj   <- input_norm weight       gate/up_proj <- post_norm weight
    down_proj    <- up_proj's output columns (silu(g) * (u / s) = (silu(g) * u) / s)
    o_proj       <- v_proj's output columns (and bias): attention is linear in v, so o_proj's
                   input channel (head h, dim d) scales with v's channel (h // G, d). With GQA the
                   G query heads of a KV group share v, so their scales must be equal: s is
                   searched on the mean |x| over the group and tied (exact for any G).
Inputs of each layer come from the float model (as in the reference implementation); the
search and the folding are done for all four stages of a layer, then its linears are rounded.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.quantization.core import QuantSpec, dequantize_codes, quantize
from jaxserve.quantization.layerwise import (STAGES, LayerForward, embed, kernel, layer_slice,
                                             replace_kernels, rtn_layer, spec_for, with_kernels)
from models.config import ModelConfig

GRID = np.linspace(0.0, 1.0, 20)


def tie_gqa(v, config: ModelConfig):
    """Means over the query heads of each KV group, broadcast back: [H*Dh] -> [H*Dh]."""
    c = config
    g = v.reshape(c.num_kv_heads, c.queries_per_kv, c.head_dim).mean(axis=1, keepdims=True)
    return jnp.broadcast_to(g, (c.num_kv_heads, c.queries_per_kv, c.head_dim)).reshape(-1)


def scales_for(x_mean, alpha):
    s = jnp.maximum(x_mean, 1e-4) ** alpha
    return s / jnp.sqrt(jnp.max(s) * jnp.min(s))


@functools.partial(jax.jit, static_argnames="specs")
def _stage_loss(x, x_mean, kernels, refs, alpha, specs):
    """Mean squared output error of the linears `kernels` [K, N_i] (float outputs `refs`
    [M, N_i]) after scaling by alpha."""
    s = scales_for(x_mean, alpha)
    xs = x / s
    total = 0.0
    for w, ref, spec in zip(kernels, refs, specs):
        q, sc, z = quantize(w * s[:, None], spec)
        diff = ref - xs @ dequantize_codes(q, sc, z)
        total = total + jnp.sum(diff * diff)
    return total / x.shape[0]


def search_scale(x, kernels: list, spec: QuantSpec, x_mean=None):
    """The best scale s [K] for linears sharing input x [M, K]: (s, alpha, {alpha: loss})."""
    x = jnp.asarray(x, jnp.float32)
    if x_mean is None:
        x_mean = jnp.mean(jnp.abs(x), axis=0)
    specs = tuple(spec_for(w.shape[0], spec) for w in kernels)
    refs = tuple(x @ w for w in kernels)
    losses = {float(a): float(_stage_loss(x, x_mean, tuple(kernels), refs, jnp.float32(a),
                                          specs)) for a in GRID}
    best = min(losses, key=losses.get)
    return scales_for(x_mean, jnp.float32(best)), best, losses


def fold_scales(lp: dict, config: ModelConfig, scales: dict) -> dict:
    """Layer params with the AWQ scales of each stage folded in (exact in float).

    `scales` maps a stage's first linear ("q_proj", "o_proj", "gate_proj", "down_proj") to its
    s [K]; missing stages are left as they are.
    """
    lp = dict(lp)

    def scale_rows(block, names, s):
        return with_kernels(lp, block, {n: kernel(lp, block, n) * s[:, None] for n in names})

    if "q_proj" in scales:
        s = scales["q_proj"]
        lp = scale_rows("attn", ("q_proj", "k_proj", "v_proj"), s)
        lp["input_norm"] = {"scale": lp["input_norm"]["scale"] / s}
    if "o_proj" in scales:
        s = scales["o_proj"]
        c = config
        s_kv = s.reshape(c.num_kv_heads, c.queries_per_kv, c.head_dim)[:, 0].reshape(-1)
        v = dict(lp["attn"]["v_proj"], kernel=kernel(lp, "attn", "v_proj") / s_kv[None, :])
        if "bias" in v:
            v["bias"] = v["bias"] / s_kv
        lp["attn"] = dict(lp["attn"], v_proj=v)
        lp = scale_rows("attn", ("o_proj",), s)
    if "gate_proj" in scales:
        s = scales["gate_proj"]
        lp = scale_rows("mlp", ("gate_proj", "up_proj"), s)
        lp["post_norm"] = {"scale": lp["post_norm"]["scale"] / s}
    if "down_proj" in scales:
        s = scales["down_proj"]
        lp = with_kernels(lp, "mlp", {"up_proj": kernel(lp, "mlp", "up_proj") / s[None, :]})
        lp = scale_rows("mlp", ("down_proj",), s)
    return lp


def awq_scale(model, spec: QuantSpec, calibration, progress: bool = True):
    """The float params of `model` with AWQ scales folded in, and {(layer, stage): alpha}.

    The returned model computes the same function in float; only its rounding changes.
    """
    from tqdm import tqdm

    if calibration is None:
        from jaxserve.quantization.calibration import load_calibration
        calibration = load_calibration(model)
    c = model.config
    fwd = LayerForward(c)
    x, positions = embed(model.params, calibration.tokens)
    layers, alphas = [], {}
    for i in tqdm(range(c.num_layers), desc=f"AWQ int{spec.bits} search", unit="layer",
                  disable=not progress):
        lp = layer_slice(model.params, i)
        inputs, x = fwd.linear_inputs(lp, x, positions)
        scales = {}
        for block, names in STAGES:
            xin = inputs[names[0]]
            x_mean = jnp.mean(jnp.abs(xin), axis=0)
            if names[0] == "o_proj":
                x_mean = tie_gqa(x_mean, c)
            s, alpha, _ = search_scale(xin, [kernel(lp, block, n) for n in names], spec, x_mean)
            scales[names[0]] = s
            alphas[(i, names[0])] = alpha
        layers.append(fold_scales(lp, c, scales))
    return replace_kernels(model.params, layers), alphas


def awq_quantize(model, spec: QuantSpec, calibration, progress: bool = True) -> dict:
    """AWQ of every decoder linear: scales folded, then round-to-nearest -> params with pytrees."""
    folded, _ = awq_scale(model, spec, calibration, progress)
    n = model.config.num_layers
    return replace_kernels(folded, [rtn_layer(layer_slice(folded, i), spec) for i in range(n)])
