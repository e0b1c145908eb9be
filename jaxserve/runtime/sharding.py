"""Tensor parallelism on JAX's SPMD machinery: the mesh, partition specs, head layout.

One 1-D mesh with a "model" axis of N devices, Megatron layout:
- column-parallel (output features split): q/k/v and gate/up projections;
- row-parallel (input features split): o and down projections, so each layer needs exactly one
  all-reduce after attention and one after the MLP (XLA inserts them from the shardings);
  both roles are declared once, in models/llama.py's LINEAR_ROLES: the weights' specs come from
  it here, and each Linear hands its role to the linear backend (`TensorParallel.linear`);
- attention heads split, and the paged KV cache `[L, NB, BS, K, Dh]` split on K: each device holds
  its heads' pages; block ids, page table, slots and sampling inputs are replicated, so the block
  manager and scheduler stay single and unchanged;
- embedding (and the LM head, tied or not) vocab-parallel when N divides the vocabulary: the table
  is the largest single weight of a small model (SmolLM2: 21% of its parameters, shared by input
  and output since it ties them), so replicating it would cap the per-device saving; the price is
  two small collectives per step outside the layers (the lookup's reduce and the logits gather
  that the sampler needs), none per layer.

Heads must split evenly: `head_layout` pads and replicates heads so both counts divide N (see its
docstring), a transform applied to the float weights before quantization and placement.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.runtime.attention_backends import AttentionBackend, WrappedAttention
from jaxserve.runtime import kv_quant
from jaxserve.runtime.kv_cache import KVCache, new_cache
from models.config import ModelConfig
from models.llama import LINEAR_ROLES, Parallel
from models.model import Model
from models.moe import EXPERT_ROLES
from models.quantized import Int4Weight, QuantizedWeight, is_quantized

log = logging.getLogger("jaxserve")

AXIS = "model"
# Which feature axis a role splits: column the outputs (N), row the inputs (K).
SPLIT = {"column": "out", "row": "in", None: None}
FLOAT_LAYOUT = {"kernel": ("in", "out"), "bias": ("out",),  # kernel [.., K, N], bias [.., N]
                # LoRA slots beside a kernel (models/lora.py): a [.., K, S, R], b [.., S, R, N],
                # split with their kernel's K or N (slots and rank never split).
                "lora_a": ("in", "slot", "rank"), "lora_b": ("rank", "out"),
                "lora_on": ("slot",)}  # which slots adapt the layer [.., S]
# Weights a non-XLA linear backend runs through a Pallas kernel, which the SPMD partitioner
# cannot split: they run per shard (shard_map). int8 weights run XLA dots and are partitioned
# like float ones, with the same (global) per-token activation scales as on one device.
KERNEL_WEIGHTS = (Int4Weight,)
HEADS = P(None, None, AXIS, None)            # q/k/v/attention output [B, T, H, Dh]
CACHE = P(None, None, None, AXIS, None)      # [L, NB, BS, K, Dh]
CACHE_SCALES = P(None, None, None, AXIS)     # an int8 cache's scales [L, NB, BS, K]


def cache_specs(quantized: bool) -> KVCache:
    """The KV cache's partition specs: split by KV head, an int8 cache's scales as its codes."""
    if quantized:
        return KVCache(k=CACHE, v=CACHE, k_scale=CACHE_SCALES, v_scale=CACHE_SCALES)
    return KVCache(k=CACHE, v=CACHE)


def make_mesh(n: int) -> Mesh:
    """A 1-D mesh of the first `n` devices with axis "model"."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {n!r}")
    have = jax.device_count()
    if n > have:
        raise ValueError(
            f"tensor_parallel_size={n} needs {n} devices, but JAX sees {have} "
            f"({jax.default_backend()}). On GPU, check CUDA_VISIBLE_DEVICES; on CPU, start Python "
            f"with XLA_FLAGS=--xla_force_host_platform_device_count={n}; across hosts, pass "
            "--coordinator-address/--num-processes/--process-id on every host.")
    if jax.process_count() > 1 and n != have:
        raise ValueError(f"with {jax.process_count()} processes tensor_parallel_size must use "
                         f"every device ({have}), got {n}")
    return Mesh(np.array(jax.devices()[:n]), (AXIS,))


def setup(n: int, model: Model) -> tuple[TensorParallel | None, Model]:
    """The mesh of `n` devices (None: one device, one process) and `model` padded for it."""
    if n == 1 and jax.process_count() == 1:
        return None, model
    tp = TensorParallel(make_mesh(n))
    return tp, pad_heads(model, n)


# ---- head layout --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class HeadLayout:
    """Where each head of the sharded model comes from: an original head index, or -1 (zero).

    New q head i attends with new KV head i // (len(q_src) // len(kv_src)), the usual GQA
    grouping, and device d holds the d-th contiguous slice of both lists.
    """

    q_src: tuple[int, ...]
    kv_src: tuple[int, ...]

    @property
    def num_heads(self) -> int:
        return len(self.q_src)

    @property
    def num_kv_heads(self) -> int:
        return len(self.kv_src)

    @property
    def is_identity(self) -> bool:
        return self.q_src == tuple(range(len(self.q_src))) and \
            self.kv_src == tuple(range(len(self.kv_src)))


def head_layout(num_heads: int, num_kv_heads: int, n: int) -> HeadLayout:
    """Pads and replicates heads so that N divides both head counts.

    With K KV heads, G = H / K query heads per KV head:
    1. K' = the smallest K' >= K that N divides or that divides N; KV heads K..K'-1 are zero
       heads (their query heads too), which changes nothing: their o_proj rows are zero.
    2. If K' < N, each KV head is replicated r = N / K' times, and its G query heads are dealt
       to the copies in order, G' = ceil(G / r) per copy; slots past G are zero query heads.
    Zero query heads add 0 to the output exactly (zero o_proj rows), so the sharded model
    computes the same function; only summation order differs.
    Examples: K divisible by N (most Llamas): unchanged. SmolLM2 (H=9, K=3): N=2 -> K'=4, H'=12
    (2 KV heads per device); N=4 -> K'=4, H'=12 (1 per device); N=8 -> K'=4 replicated twice,
    G'=2, H'=16 (1 KV head and 2 query heads per device).
    """
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads "
                         f"{num_kv_heads}")
    k, g = num_kv_heads, num_heads // num_kv_heads
    kp = k
    while kp % n and n % kp:
        kp += 1
    r = max(1, n // kp)
    gp = -(-g // r)
    q_src, kv_src = [], []
    for j in range(kp):
        for c in range(r):
            kv_src.append(j if j < k else -1)
            for s in range(gp):
                q = c * gp + s
                q_src.append(j * g + q if j < k and q < g else -1)
    return HeadLayout(tuple(q_src), tuple(kv_src))


def _take_heads(w, src: tuple[int, ...], head_dim: int, axis: int):
    """Reorders the heads of `w` along `axis` (size heads * head_dim); src -1 gives zeros."""
    axis = axis % w.ndim
    shape = w.shape
    heads = w.reshape(shape[:axis] + (shape[axis] // head_dim, head_dim) + shape[axis + 1:])
    idx = np.asarray(src)
    out = jnp.take(heads, np.maximum(idx, 0), axis=axis)
    keep = (idx >= 0).reshape((-1,) + (1,) * (heads.ndim - axis - 1))
    out = jnp.where(keep, out, jnp.zeros((), w.dtype))
    return out.reshape(shape[:axis] + (len(src) * head_dim,) + shape[axis + 1:])


def pad_heads(model: Model, n: int) -> Model:
    """The model with heads padded/replicated for `n` devices (`head_layout`); float weights."""
    c = model.config
    layout = head_layout(c.num_heads, c.num_kv_heads, n)
    if layout.is_identity:
        return model
    attn = model.params["layers"]["attn"]
    if any(is_quantized(attn[name].get("kernel")) for name in attn):
        raise ValueError("heads must be padded before quantization: quantize after "
                         "pad_heads (the engine does)")
    if c.qk_norm == "full":
        # The norm's mean runs over every head of the projection: zero heads would change it.
        raise ValueError(f"tensor_parallel_size={n} needs padded heads ({c.num_heads} query / "
                         f"{c.num_kv_heads} KV heads), which a whole-projection q/k norm "
                         "(qk_norm='full') does not allow; pick a size dividing the KV heads")
    dh = c.head_dim
    new = dict(attn)  # q/k norms (per head) are shared by every head: kept as they are
    for name, src, axis in (("q_proj", layout.q_src, -1), ("k_proj", layout.kv_src, -1),
                            ("v_proj", layout.kv_src, -1), ("o_proj", layout.q_src, -2)):
        new[name] = {key: _take_heads(value, src, dh, -1 if key == "bias" else axis)
                     for key, value in attn[name].items()}
    params = dict(model.params, layers=dict(model.params["layers"], attn=new))
    config = dataclasses.replace(c, num_heads=layout.num_heads, num_kv_heads=layout.num_kv_heads)
    log.info("tensor parallel %d: heads %d/%d (q/kv) -> %d/%d (zero-padded and replicated)", n,
             c.num_heads, c.num_kv_heads, layout.num_heads, layout.num_kv_heads)
    return dataclasses.replace(model, config=config, params=params)


# ---- partition specs ----------------------------------------------------------------------

def axes_spec(shape: tuple[int, ...], layout: tuple[str, ...], split: str | None) -> P:
    """The spec of an array whose trailing axes run along `layout` ("in"/"out"), split on the
    `split` one. A leading [L] layer axis is never split, nor an axis of size 1: a per-channel
    scale row ([.., 1, N]) of a row-parallel kernel is one every K shard needs."""
    lead = (None,) * (len(shape) - len(layout))
    tail = shape[len(lead):]
    return P(*lead, *(AXIS if axis == split and dim != 1 else None
                      for axis, dim in zip(layout, tail)))


def weight_specs(w: QuantizedWeight, split: str | None) -> QuantizedWeight:
    """A quantized weight's specs, leaf by leaf, from its type's declared layout (its int8 codes
    are output-major, [.., N, K]: their split axis swaps with the other leaves')."""
    return dataclasses.replace(w, **{name: axes_spec(a.shape, w.LAYOUT[name], split)
                                     for name, a in w.arrays().items()})


def _module_role(names: list[str]) -> tuple[str | None, Parallel]:
    """The linear layer on a params path (None for norms and the embedding) and its role."""
    module = next((n for n in names if n in LINEAR_ROLES), None)
    return module, LINEAR_ROLES.get(module)


def _split_of(names: list[str], vocab_parallel: bool) -> str | None:
    module, role = _module_role(names)
    if module == "lm_head":  # vocab-parallel when the vocabulary splits, else replicated
        return "out" if vocab_parallel else None
    return SPLIT[role]


def _check_divisible(path, leaf, spec: P, n: int) -> None:
    for dim, axis in zip(leaf.shape, spec):
        if axis == AXIS and dim % n:
            name = "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
            raise ValueError(f"{name} {tuple(leaf.shape)} does not split over "
                             f"tensor_parallel_size={n} (dimension {dim})")


def _check_groups(name: str, w: QuantizedWeight, n: int) -> None:
    """Row-parallel quantized kernels split K: a quantization group must not straddle devices."""
    k, g = w.in_features, w.group_size
    if g == k:  # per output channel: one scale over all of K, shared by every shard
        return
    if k % n or (k // n) % g:
        raise ValueError(
            f"{name}: input dimension {k} split over tensor_parallel_size={n} gives "
            f"{k / n:g} rows per device, not a multiple of the quantization group size "
            f"{g}; quantize with a group size dividing {k // n if k % n == 0 else k}"
            " or pick another tensor_parallel_size")


def vocab_parallel(config: ModelConfig, n: int) -> bool:
    return n > 1 and config.vocab_size % n == 0


def param_specs(params, config: ModelConfig, n: int):
    """PartitionSpecs for a params tree (float or quantized), validated for `n` devices."""
    vp = vocab_parallel(config, n)
    flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_quantized)[0]
    for path, leaf in flat:  # first: its message says what to change
        names = [getattr(k, "key", None) for k in path]
        module, role = _module_role(names)
        if is_quantized(leaf) and role == "row":
            _check_groups(module, leaf, n)

    def spec(path, leaf):
        names = [getattr(k, "key", None) for k in path]
        if names[0] == "embedding":
            s = P(AXIS, None) if vp else P()
        elif "mlp" in names and names[-1] in EXPERT_ROLES:  # stacked experts [.., E, in, out]
            split = SPLIT[EXPERT_ROLES[names[-1]]]
            if is_quantized(leaf):
                s = weight_specs(leaf, split)
                for name, a in leaf.arrays().items():
                    _check_divisible(path, a, getattr(s, name), n)
                return s
            s = axes_spec(leaf.shape, ("in", "out"), split)
        elif _module_role(names)[0] is None:  # norms (and a MoE router: replicated)
            s = P()
        elif is_quantized(leaf):
            s = weight_specs(leaf, _split_of(names, vp))
            for name, a in leaf.arrays().items():
                _check_divisible(path, a, getattr(s, name), n)
            return s
        else:
            s = axes_spec(leaf.shape, FLOAT_LAYOUT[names[-1]], _split_of(names, vp))
        _check_divisible(path, leaf, s, n)
        return s

    return jax.tree_util.tree_map_with_path(spec, params, is_leaf=is_quantized)


# ---- placement and the step's shardings ---------------------------------------------------

class TensorParallel:
    """Shardings of one mesh; the runner asks it to place params and cache and to wrap kernels."""

    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self.size = mesh.devices.size

    def sharding(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    @property
    def replicated(self) -> NamedSharding:
        return self.sharding(P())

    @property
    def cache_shardings(self) -> KVCache:
        """A float cache's shardings (cache_shardings_of: either kind)."""
        return self.cache_shardings_of(False)

    def cache_shardings_of(self, quantized: bool) -> KVCache:
        return jax.tree.map(self.sharding, cache_specs(quantized),
                            is_leaf=lambda x: isinstance(x, P))

    def param_shardings(self, params, config: ModelConfig):
        return jax.tree.map(self.sharding, param_specs(params, config, self.size),
                            is_leaf=lambda x: isinstance(x, P))

    def place(self, tree, shardings):
        if jax.process_count() == 1:
            return jax.device_put(tree, shardings)
        # Every process holds the same full values; each contributes its devices' shards.
        return jax.tree.map(
            lambda x, s: jax.make_array_from_callback(
                x.shape, s, lambda idx, x=np.asarray(x): x[idx]), tree, shardings)

    def step_jit_kwargs(self, param_shardings, quantized_kv: bool = False) -> dict:
        """jit shardings of the runner's step(params, cache, state, inputs) -> (cache, state,
        out).

        The slot state, inputs and outputs are replicated; the cache keeps its sharding across
        the donation.
        """
        rep, cache = self.replicated, self.cache_shardings_of(quantized_kv)
        return dict(in_shardings=(param_shardings, cache, rep, rep),
                    out_shardings=(cache, rep, rep))

    def new_cache(self, shape: tuple[int, ...], dtype) -> KVCache:
        """Zeros allocated shard by shard: no device ever holds the whole cache."""
        if shape[3] % self.size:
            raise ValueError(f"{shape[3]} KV heads do not split over {self.size} devices: "
                             "pad_heads the model first")
        quantized = kv_quant.is_quantized(dtype)
        return jax.jit(lambda: new_cache(shape, dtype),
                       out_shardings=self.cache_shardings_of(quantized))()

    def attention(self, backend: AttentionBackend) -> AttentionBackend:
        """The backend as it runs on this mesh, as it declares: per shard, or annotated."""
        backend = backend.for_tensor_parallel()
        wrap = self._per_shard if backend.per_shard else self._annotated
        return WrappedAttention(inner=backend, attend_fn=wrap(backend.attend))

    def _per_shard(self, fn):
        # A pallas_call is opaque to the SPMD partitioner: run it on each device's heads.
        def per_shard(q, k, v, cache, layer, meta, **kw):
            # The layer's window (if any) is traced: it crosses as a replicated argument;
            # softcap and scale are static.
            traced = {name: kw.pop(name) for name in ("window",) if name in kw}

            def local(q, k, v, cache, layer, meta, traced):
                return fn(q, k, v, cache, layer, meta, **traced, **kw)
            specs = cache_specs(cache.quantized)
            return jax.shard_map(local, mesh=self.mesh,
                                 in_specs=(HEADS, HEADS, HEADS, specs, P(), P(), P()),
                                 out_specs=(HEADS, specs), check_vma=False)(
                q, k, v, cache, layer, meta, traced)
        return per_shard

    def _annotated(self, fn):
        def annotated(q, k, v, cache, layer, meta, **kw):
            c = functools.partial(jax.lax.with_sharding_constraint, shardings=self.sharding(HEADS))
            out, cache = fn(c(q), c(k), c(v), cache, layer, meta, **kw)
            cache = jax.lax.with_sharding_constraint(cache,
                                                     self.cache_shardings_of(cache.quantized))
            return c(out), cache
        return annotated

    def linear(self, fn):
        """Wraps a linear backend whose quantized path is a kernel: shard_map by layer role.

        The role is the one the layer declares (models/llama.py LINEAR_ROLES), passed with each
        call. Column parallel: x replicated, weight columns split, output features split. Row
        parallel: x features and weight rows split, partial products psum'd: the layer's one
        all-reduce. Other weights (float, int8), and layers without a role (the LM head), go
        through `fn` under the annotations, as on the XLA path.
        """
        def sharded(x, w, parallel: Parallel = None):
            if parallel is None or not isinstance(w, KERNEL_WEIGHTS):
                return fn(x, w, parallel)
            lead = (None,) * (x.ndim - 1)
            split = SPLIT[parallel]
            x_spec, out_spec = (P(), P(*lead, AXIS)) if split == "out" else (P(*lead, AXIS), P())

            def local(x, w):  # x [..., K(/N)], w's leaves their shard of [K, N]
                y = fn(x, w, parallel)
                return jax.lax.psum(y, AXIS) if split == "in" else y

            return jax.shard_map(local, mesh=self.mesh, in_specs=(x_spec, weight_specs(w, split)),
                                 out_specs=out_spec, check_vma=False)(x, w)
        return sharded

    def grouped_matmul(self, fn):
        """Wraps the MoE grouped matmul kernel (opaque to the SPMD partitioner): each device
        runs it on its share of the experts' F, by the kernel's EXPERT_ROLES role (models/
        moe.py). gate/up (column): rows replicated, weights and output split on F; down (row):
        rows and weights split on F, partial products psum'd (the MLP's one all-reduce). The
        group sizes (the routing) are replicated."""
        def sharded(x, w, group_sizes, parallel: Parallel = None):
            if parallel is None:
                return fn(x, w, group_sizes, parallel)
            split = SPLIT[parallel]
            x_spec, out_spec = (P(), P(None, AXIS)) if split == "out" else (P(None, AXIS), P())
            w_spec = (weight_specs(w, split) if is_quantized(w)
                      else axes_spec(w.shape, ("in", "out"), split))

            def local(x, w, group_sizes):  # x [M, D] or [M, F/N]; w its expert shards
                y = fn(x, w, group_sizes, parallel)
                return jax.lax.psum(y, AXIS) if split == "in" else y

            return jax.shard_map(local, mesh=self.mesh, in_specs=(x_spec, w_spec, P()),
                                 out_specs=out_spec, check_vma=False)(x, w, group_sizes)
        return sharded


def per_device_config(config: ModelConfig, n: int) -> ModelConfig:
    """The config one device sees for KV planning: its share of the (padded) KV heads."""
    return dataclasses.replace(config, num_kv_heads=config.num_kv_heads // n,
                               num_heads=config.num_heads // n)


def bytes_per_device(tree) -> dict:
    """{device: bytes} of the shards of every array in `tree` (from their shardings)."""
    out: dict = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
    return out
