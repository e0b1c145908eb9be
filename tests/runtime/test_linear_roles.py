"""Linear layers carry their tensor-parallel role (models/llama.py LINEAR_ROLES): the backend
gets it from the declaration, the sharding wrapper splits by it, and no code reads flax's
private module stack to guess it from a layer's name."""

import pathlib
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.quantization import QuantSpec, quantize, to_weight
from jaxserve.runtime.backends import linear_backend
from jaxserve.runtime.sharding import TensorParallel, make_mesh
from models.llama import LINEAR_ROLES, Linear, dense_linear
from models.random_init import random_model
from jaxserve.testing.tiny_models import TINY_GQA

ROOT = pathlib.Path(__file__).resolve().parents[2]
INT4 = QuantSpec(bits=4, granularity="group", group_size=32)
INT8 = QuantSpec(bits=8, granularity="channel", symmetric=True)


def recorder(seen: list):
    def linear(x, w, parallel=None):
        seen.append(parallel)
        return dense_linear(x, w)
    return linear


@pytest.mark.parametrize("role", ["column", "row", None])
def test_the_declared_role_reaches_the_backend_whatever_the_name(role):
    seen = []
    layer = Linear(8, parallel=role, linear=recorder(seen), name="renamed")
    layer.init(jax.random.key(0), jnp.ones((2, 4)))
    assert seen == [role]


def test_every_model_linear_passes_its_table_role():
    seen = {}

    def grab(next_fun, args, kwargs, context):
        if isinstance(context.module, Linear) and context.method_name == "__call__":
            seen[context.module.name] = context.module.parallel
        return next_fun(*args, **kwargs)

    model = random_model(TINY_GQA)  # untied: lm_head is a Linear
    roles = []
    with nn.intercept_methods(grab):
        model.module(linear=recorder(roles)).apply(
            {"params": model.params}, jnp.zeros((1, 4), jnp.int32), jnp.zeros((1, 4), jnp.int32))
    assert seen == LINEAR_ROLES
    assert set(roles) == set(seen.values())


def shard_maps(role, spec):
    """(in_specs, out_specs, has psum) of each shard_map that TensorParallel.linear puts around
    a Linear declared `role` under a name no table knows."""
    w = np.random.default_rng(0).normal(size=(64, 32)).astype(np.float32)
    weight = to_weight(*quantize(w, spec), spec)
    tp = TensorParallel(make_mesh(1))
    layer = Linear(32, parallel=role, linear=tp.linear(linear_backend("xla")), name="renamed")
    jaxpr = jax.make_jaxpr(lambda x: layer.apply({"params": {"kernel": weight}}, x))(
        jnp.ones((2, 3, 64)))
    return [(e.params["in_specs"], e.params["out_specs"], "psum" in str(e.params["jaxpr"]))
            for e in jaxpr.jaxpr.eqns if e.primitive.name == "shard_map"]


def test_tensor_parallel_linear_splits_an_int4_layer_by_its_declared_role():
    P = jax.sharding.PartitionSpec
    # x, then packed [K/2, N], scales and offsets [K/g, N]; the output.
    assert shard_maps("column", INT4) == [
        ((P(), P(None, "model"), P(None, "model"), P(None, "model")),
         (P(None, None, "model"),), False)]
    assert shard_maps("row", INT4) == [
        ((P(None, None, "model"), P("model", None), P("model", None), P("model", None)),
         (P(),), True)]
    assert shard_maps(None, INT4) == []  # the LM head: vocab-parallel by the partitioner


@pytest.mark.parametrize("role", ["column", "row", None])
def test_int8_layers_are_left_to_the_partitioner(role):
    # int8 runs XLA dots: shard_map would give each shard its own per-token activation scale
    # (and the output-major codes need other specs than the other leaves).
    assert shard_maps(role, INT8) == []


def test_no_code_reads_flax_private_module_stack():
    pattern = re.compile(r"flax\.linen\.module\._context|linen\.module import _context|"
                         r"module_stack")
    offenders = [str(p.relative_to(ROOT))
                 for folder in ("jaxserve", "models", "pallas_kernels", "scripts")
                 for p in sorted((ROOT / folder).rglob("*.py"))
                 if pattern.search(p.read_text(encoding="utf-8"))]
    assert offenders == []


def test_an_unknown_role_is_refused_where_the_layer_is_declared():
    with pytest.raises(ValueError, match="parallel must be one of"):
        Linear(8, parallel="col")
