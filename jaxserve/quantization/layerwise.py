"""One decoder layer at a time, split at the inputs of its linear layers.

GPTQ and AWQ work layer by layer on the activations that enter each linear. `LayerForward`
runs a layer of models/llama.py (its own Flax modules, so the numerics are the served ones) in
four stages, each returning the input of the next group of linears:

    attn_input(x)       -> h     input of q_proj, k_proj, v_proj   [S, T, D]
    o_input(h)          -> a     input of o_proj                   [S, T, H*Dh]
    mlp_input(x, a)     -> x2, m input of gate_proj, up_proj      [S, T, D]
    down_input(m)       -> d     input of down_proj                [S, T, F]
    output(x2, d)       -> x'    the layer's output                [S, T, D]

Layer params here are one layer's slice of params["layers"] with float32 kernels.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.quantization.core import QuantSpec, quantize, to_weight
from jaxserve.quantization.rtn import pick_group_size
from models.config import ModelConfig
from models.llama import Attention, RMSNorm, dense_causal_attention, dense_linear
from models.quantized import is_quantized

# Linears that share an input, in the order a layer computes them.
STAGES = (("attn", ("q_proj", "k_proj", "v_proj")), ("attn", ("o_proj",)),
          ("mlp", ("gate_proj", "up_proj")), ("mlp", ("down_proj",)))
LINEARS = tuple((block, name) for block, names in STAGES for name in names)


def spec_for(k: int, spec: QuantSpec) -> QuantSpec:
    """The spec for a kernel with K inputs: per group, the largest of g/64/32 that divides K."""
    if spec.granularity != "group":
        return spec
    return dataclasses.replace(spec, group_size=pick_group_size(k, spec.group_size))


def layer_slice(params: dict, layer: int) -> dict:
    return jax.tree.map(lambda a: jnp.asarray(a[layer], jnp.float32), params["layers"])


def stack_layers(layers: list[dict]) -> dict:
    """Per-layer trees (same structure) -> one tree with a leading [L] axis, as nn.scan wants."""
    return jax.tree.map(lambda *a: jnp.stack(a), *layers)


def kernel(lp: dict, block: str, name: str):
    return lp[block][name]["kernel"]


def with_kernels(lp: dict, block: str, kernels: dict) -> dict:
    """A copy of layer params `lp` with some kernels of `block` replaced."""
    new_block = dict(lp[block])
    for name, w in kernels.items():
        new_block[name] = dict(new_block[name], kernel=w)
    return dict(lp, **{block: new_block})


class LayerForward:
    """Jitted stages of one float32 decoder layer (see the module docstring)."""

    def __init__(self, config: ModelConfig):
        self.config = config
        attn = Attention(config, dense_causal_attention)
        norm = RMSNorm(config.rms_norm_eps)

        def o_input(lp, h, positions):
            captured = {}

            def grab(next_fun, args, kwargs, context):
                if context.module.name == "o_proj" and context.method_name == "__call__":
                    captured["x"] = args[0]
                return next_fun(*args, **kwargs)

            with nn.intercept_methods(grab):
                attn.apply({"params": lp["attn"]}, h, positions, None, 0, None)
            return captured["x"]

        def mlp_input(lp, x, a):
            x2 = x + dense_linear(a, kernel(lp, "attn", "o_proj"))
            return x2, norm.apply({"params": lp["post_norm"]}, x2)

        def down_input(lp, m):
            gate = dense_linear(m, kernel(lp, "mlp", "gate_proj"))
            return jax.nn.silu(gate) * dense_linear(m, kernel(lp, "mlp", "up_proj"))

        self.attn_input = jax.jit(lambda lp, x: norm.apply({"params": lp["input_norm"]}, x))
        self.o_input = jax.jit(o_input)
        self.mlp_input = jax.jit(mlp_input)
        self.down_input = jax.jit(down_input)
        self.output = jax.jit(lambda lp, x2, d: x2 + dense_linear(d, kernel(lp, "mlp",
                                                                             "down_proj")))

    def __call__(self, lp, x, positions):
        """The layer's output [S, T, D] (float kernels)."""
        a = self.o_input(lp, self.attn_input(lp, x), positions)
        x2, m = self.mlp_input(lp, x, a)
        return self.output(lp, x2, self.down_input(lp, m))

    def linear_inputs(self, lp, x, positions) -> dict:
        """{linear name: its input [S*T, K]} and the layer output, all from float kernels."""
        h = self.attn_input(lp, x)
        a = self.o_input(lp, h, positions)
        x2, m = self.mlp_input(lp, x, a)
        d = self.down_input(lp, m)
        flat = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
        inputs = {n: flat(h) for n in ("q_proj", "k_proj", "v_proj")}
        inputs.update(o_proj=flat(a), gate_proj=flat(m), up_proj=flat(m), down_proj=flat(d))
        return inputs, self.output(lp, x2, d)


def embed(params: dict, tokens: np.ndarray):
    """Token embeddings [S, T, D] and positions [S, T] of calibration windows."""
    tokens = jnp.asarray(tokens, jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    return jnp.take(jnp.asarray(params["embedding"], jnp.float32), tokens, axis=0), positions


_quantize = jax.jit(quantize, static_argnames="spec")


def replace_kernels(params: dict, layers: list[dict]) -> dict:
    """params with params["layers"] rebuilt from per-layer trees (quantized or float).

    The per-layer work runs in float32; float leaves go back to the model's dtype (a bfloat16
    model stays bfloat16), quantized pytrees keep their own dtypes.
    """
    dtype = params["embedding"].dtype
    restore = lambda leaf: leaf if is_quantized(leaf) else leaf.astype(dtype)  # noqa: E731
    return dict(params, layers=jax.tree.map(restore, stack_layers(layers),
                                            is_leaf=is_quantized))


def rtn_layer(lp: dict, spec: QuantSpec) -> dict:
    """Every linear of one layer as an RTN-quantized pytree."""
    out = lp
    for block, name in LINEARS:
        w = kernel(lp, block, name)
        s_ = spec_for(w.shape[0], spec)
        q, s, z = _quantize(w, s_)
        out = with_kernels(out, block, {name: to_weight(q, s, z, s_)})
    return out


def rtn_params(params: dict, spec: QuantSpec) -> dict:
    """Round-to-nearest of every decoder linear at any spec (the baseline GPTQ/AWQ must beat)."""
    num_layers = jax.tree.leaves(params["layers"])[0].shape[0]
    return replace_kernels(params, [rtn_layer(layer_slice(params, i), spec)
                                    for i in range(num_layers)])


def sequential_quantize(model, tokens: np.ndarray, quantize_stage, desc: str,
                        progress: bool = True) -> dict:
    """Quantizes the decoder layer by layer, stage by stage, on the quantized model's own inputs.

    `quantize_stage(kernels, x) -> {name: (pytree, dequantized kernel)}` gets the float
    kernels {name: [K, N]} of one stage and their input x [S*T, K]. Each stage's input comes from
    the already-quantized linears before it (earlier layers and earlier stages of this layer),
    as GPTQ does ("true sequential"): a linear then compensates the error of the ones before it.
    Returns the params with pytree kernels.
    """
    from tqdm import tqdm

    params = model.params
    fwd = LayerForward(model.config)
    x, positions = embed(params, tokens)
    flat = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
    layers = []
    for i in tqdm(range(model.config.num_layers), desc=desc, unit="layer", disable=not progress):
        lp = layer_slice(params, i)
        lp_hat, lp_q = lp, lp  # dequantized float kernels (to run forward) / pytrees (to store)

        def run(block, names, inp):
            nonlocal lp_hat, lp_q
            done = quantize_stage({n: kernel(lp, block, n) for n in names}, flat(inp))
            lp_hat = with_kernels(lp_hat, block, {n: w_hat for n, (_, w_hat) in done.items()})
            lp_q = with_kernels(lp_q, block, {n: q for n, (q, _) in done.items()})

        h = fwd.attn_input(lp, x)
        run("attn", STAGES[0][1], h)
        a = fwd.o_input(lp_hat, h, positions)
        run("attn", STAGES[1][1], a)
        x2, m = fwd.mlp_input(lp_hat, x, a)
        run("mlp", STAGES[2][1], m)
        d = fwd.down_input(lp_hat, m)
        run("mlp", STAGES[3][1], d)
        x = fwd.output(lp_hat, x2, d)
        layers.append(lp_q)
    return replace_kernels(params, layers)
