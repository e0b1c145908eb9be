"""The MoE MLP (models/moe.py): routing and the ragged_dot grouped matmul vs numpy references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.moe import grouped_ffn, moe_ffn, route, sort_by_expert
from tests import cuda_lowering


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _numpy_moe(x, router, gate, up, down, k, renormalize):
    """Dense per-expert reference in float64: every token runs its top-k experts one by one."""
    x, router, gate, up, down = (np.asarray(a, np.float64) for a in (x, router, gate, up, down))
    logits = x @ router  # [N, E]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out, chosen = np.zeros_like(x), []
    for t in range(x.shape[0]):
        top = np.argsort(-probs[t], kind="stable")[:k]
        w = probs[t, top] / (probs[t, top].sum() if renormalize else 1.0)
        for e, we in zip(top, w):
            h = _silu(x[t] @ gate[e]) * (x[t] @ up[e])  # [F]
            out[t] += we * (h @ down[e])
        chosen.append(sorted(top.tolist()))
    return out, chosen


def _weights(rng, e, d, f, n, skew=0.0):
    x = rng.standard_normal((n, d)).astype(np.float32)
    router = rng.standard_normal((d, e)).astype(np.float32)
    if skew:  # feature 0 is always large, and the first experts weigh it negatively: unchosen
        x[:, 0] = np.abs(x[:, 0]) + 2.0
        router[0, : e // 2] -= 3.0 * skew
    gate = (rng.standard_normal((e, d, f)) / np.sqrt(d)).astype(np.float32)
    up = (rng.standard_normal((e, d, f)) / np.sqrt(d)).astype(np.float32)
    down = (rng.standard_normal((e, f, d)) / np.sqrt(f)).astype(np.float32)
    return x, router, gate, up, down


# (experts, top-k, tokens, router skew): one token, fewer tokens than experts, k = E, skewed
# routing that leaves experts empty, and a batch larger than E * k.
GRID = [(4, 2, 1, 0.0), (8, 2, 3, 0.0), (4, 4, 5, 0.0), (8, 2, 16, 3.0), (16, 4, 33, 0.0),
        (6, 1, 64, 2.0)]


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("e,k,n,skew", GRID)
def test_moe_ffn_matches_per_expert_numpy(e, k, n, skew, renormalize):
    rng = np.random.default_rng(e * 100 + k * 10 + n)
    args = _weights(rng, e, 24, 40, n, skew)
    fn = jax.jit(moe_ffn, static_argnames=("k", "renormalize"))
    out, experts = fn(*map(jnp.asarray, args), k=k, renormalize=renormalize)
    want, chosen = _numpy_moe(*args, k, renormalize)
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-5, rtol=2e-5)
    assert [sorted(r) for r in np.asarray(experts).tolist()] == chosen


def test_grid_has_experts_without_tokens():
    """The skewed cases really leave experts empty (else the zero-size groups go untested)."""
    for e, k, n, skew in GRID:
        if skew:
            args = _weights(np.random.default_rng(e * 100 + k * 10 + n), e, 24, 40, n, skew)
            _, _, experts = route(jnp.asarray(args[0]), jnp.asarray(args[1]), k, False)
            _, sizes = sort_by_expert(experts, e)
            assert (np.asarray(sizes) == 0).any() and int(np.asarray(sizes).sum()) == n * k


@pytest.mark.parametrize("sizes", [[3, 0, 5, 0], [0, 0, 0, 8], [8, 0, 0, 0], [2, 2, 2, 2]])
def test_grouped_ffn_matches_numpy_per_group(sizes):
    rng = np.random.default_rng(sum(sizes) + len(sizes) + sizes[0])
    _, _, gate, up, down = _weights(rng, len(sizes), 16, 24, 1)
    xs = rng.standard_normal((sum(sizes), 16)).astype(np.float32)
    got = grouped_ffn(jnp.asarray(xs), jnp.asarray(gate), jnp.asarray(up), jnp.asarray(down),
                      jnp.asarray(sizes, jnp.int32), jnp.float32)
    start, want = 0, []
    for e, s in enumerate(sizes):
        rows = xs[start:start + s].astype(np.float64)
        want.append((_silu(rows @ gate[e]) * (rows @ up[e])) @ down[e])
        start += s
    np.testing.assert_allclose(np.asarray(got), np.concatenate(want), atol=2e-5, rtol=2e-5)


def test_sort_by_expert_groups_pairs_stably():
    experts = jnp.asarray([[2, 0], [0, 3], [2, 1]], jnp.int32)  # [N=3, k=2]
    order, sizes = sort_by_expert(experts, 5)
    assert np.asarray(sizes).tolist() == [2, 1, 2, 1, 0]
    # pairs (token, slot) flattened as token * k + slot; grouped by expert, token order kept
    assert np.asarray(order).tolist() == [1, 2, 5, 0, 4, 3]


def _moe_args(n, e, d, f, dtype):
    s = jax.ShapeDtypeStruct
    return [s((n, d), dtype), s((d, e), dtype), s((e, d, f), dtype), s((e, d, f), dtype),
            s((e, f, d), dtype)]


def _moe_fn(x, router, gate, up, down):
    return moe_ffn(x, router, gate, up, down, 2, True)[0]


def test_lowers_for_h200_as_ragged_dot():
    """On CUDA, ragged_dot lowers to XLA's ragged dot (on CPU jax expands it into masked dots).

    The mesh's axis is Auto, as the engine's meshes are (jax has no sharding rule for
    ragged_dot under an Explicit axis, the AbstractMesh default)."""
    auto = (jax.sharding.AxisType.Auto,)
    mesh = jax.sharding.AbstractMesh((1,), ("x",), axis_types=auto,
                                     abstract_device=cuda_lowering.H200)
    with jax.sharding.use_abstract_mesh(mesh):
        lowered = jax.jit(_moe_fn).trace(*_moe_args(64, 8, 128, 256, jnp.bfloat16)).lower(
            lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert text.count("\"chlo.ragged_dot\"(") == 3


@pytest.mark.parametrize("n", [1, 256])
def test_compiles_for_h200(n):
    """Full sm_90a compile of the MoE MLP (decode- and prefill-sized), deviceless."""
    reason = cuda_lowering.cuda_compiler_available()
    if reason:
        pytest.skip(reason)
    compiled = cuda_lowering.compile_for_h200(_moe_fn, *_moe_args(n, 8, 128, 256, jnp.bfloat16))
    assert compiled.as_text()


def test_int8_experts_compile_for_h200():
    """w8a16 experts (output-major int8 codes, per-channel scales) compile for sm_90a."""
    from models.quantized import Int8Weight
    reason = cuda_lowering.cuda_compiler_available()
    if reason:
        pytest.skip(reason)
    s = jax.ShapeDtypeStruct
    e, d, f = 8, 128, 256

    def int8(k, n):
        return Int8Weight(q8=s((e, n, k), jnp.int8), scales=s((e, 1, n), jnp.float32),
                          group_size=k)

    args = [s((64, d), jnp.bfloat16), s((d, e), jnp.bfloat16), int8(d, f), int8(d, f),
            int8(f, d)]
    leaves, tree = jax.tree.flatten(args)  # compile_for_h200 takes flat arrays

    def fn(*flat):
        return moe_ffn(*jax.tree.unflatten(tree, flat), 2, True)[0]

    assert cuda_lowering.compile_for_h200(fn, *leaves).as_text()


def _backends():
    from jaxserve.runtime.grouped_matmul import grouped_matmul_backend
    return {kind: grouped_matmul_backend(kind) for kind in ("ragged", "xla", "pallas-interpret")}


@pytest.mark.parametrize("kind", ["xla", "pallas-interpret"])
@pytest.mark.parametrize("e,k,n,skew", [(4, 2, 1, 0.0), (8, 2, 16, 3.0), (6, 1, 64, 2.0)])
def test_moe_ffn_backends_match_per_expert_numpy(kind, e, k, n, skew):
    """The MoE MLP on the tiled XLA path and on the Pallas kernel (interpreted; D and F
    multiples of 16 so the kernel really runs) against the float64 per-expert loop."""
    rng = np.random.default_rng(e * 100 + k * 10 + n + 1)
    args = _weights(rng, e, 32, 48, n, skew)
    gmm = _backends()[kind]
    fn = jax.jit(lambda *a: moe_ffn(*a, k, True, gmm))
    out, experts = fn(*map(jnp.asarray, args))
    want, chosen = _numpy_moe(*args, k, True)
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-5, rtol=2e-5)
    assert [sorted(r) for r in np.asarray(experts).tolist()] == chosen


def test_moe_ffn_backends_run_int8_experts():
    """w8a16 experts through each backend equal ragged_dot's int8 path (itself tested against
    the dequantized weights in tests/modeling/test_moe_support.py)."""
    from jaxserve.quantization.paths import INT8_CHANNEL
    from jaxserve.quantization.rtn import rtn_weight
    rng = np.random.default_rng(5)
    x, router, gate, up, down = map(jnp.asarray, _weights(rng, 4, 32, 48, 9, 0.0))
    q = [jax.vmap(lambda w: rtn_weight(w, INT8_CHANNEL))(w) for w in (gate, up, down)]
    got = {kind: np.asarray(moe_ffn(x, router, *q, 2, True, gmm)[0])
           for kind, gmm in _backends().items()}
    for kind in ("xla", "pallas-interpret"):
        np.testing.assert_allclose(got[kind], got["ragged"], atol=2e-5, rtol=2e-5)


def test_kernel_backend_falls_back_where_triton_cannot_tile():
    """D = 24, F = 40 (not multiples of 16): the pallas backend runs the tiled XLA path."""
    rng = np.random.default_rng(11)
    args = _weights(rng, 4, 24, 40, 5, 0.0)
    out, _ = moe_ffn(*map(jnp.asarray, args), 2, True, _backends()["pallas-interpret"])
    np.testing.assert_allclose(np.asarray(out), _numpy_moe(*args, 2, True)[0], atol=2e-5,
                               rtol=2e-5)


def _never(name):
    def run(*a, **kw):
        raise AssertionError(f"the {name} grouped matmul ran")
    return run


@pytest.mark.parametrize("int8", [False, True], ids=["bf16", "int8"])
def test_mosaic_backend_runs_the_mosaic_kernel_where_it_takes_the_projection(int8, monkeypatch):
    """gpu_kernels="mosaic": bf16 experts with widths 64 and 128 (gate/up and down) run the
    Mosaic GPU kernel (GPU interpret mode; the Triton kernel must not run) and equal
    ragged_dot's grouped matmul to f32 summation order (both take exact products)."""
    from jaxserve.quantization.paths import INT8_CHANNEL
    from jaxserve.quantization.rtn import rtn_weight
    from jaxserve.runtime import grouped_matmul as backend
    from models.moe import ragged_gmm
    monkeypatch.setattr(backend, "grouped_matmul", _never("Triton"))
    gmm = backend.grouped_matmul_backend("pallas-interpret", "mosaic")
    rng = np.random.default_rng(3)
    x, _, gate, _, down = _weights(rng, 4, 64, 128, 11)
    sizes = jnp.asarray([4, 0, 2, 5], jnp.int32)
    for a, w in ((x, gate), (rng.standard_normal((11, 128)), down)):
        a, w = jnp.asarray(a, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
        if int8:
            w = jax.vmap(lambda e: rtn_weight(e, INT8_CHANNEL))(w.astype(jnp.float32))
        np.testing.assert_allclose(np.asarray(gmm(a, w, sizes)),
                                   np.asarray(ragged_gmm(a, w, sizes)), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype,width", [(jnp.float32, 64), (jnp.bfloat16, 96)])
def test_mosaic_backend_leaves_to_triton_what_it_cannot_run(dtype, width, monkeypatch):
    """f32 activations (wgmma would run them as TF32) and a width not a multiple of 64 run
    the Triton kernel under gpu_kernels="mosaic"."""
    from jaxserve.runtime import grouped_matmul as backend
    from models.moe import ragged_gmm
    monkeypatch.setattr(backend, "grouped_matmul_mgpu", _never("Mosaic GPU"))
    gmm = backend.grouped_matmul_backend("pallas-interpret", "mosaic")
    x, _, gate, _, _ = _weights(np.random.default_rng(4), 4, 64, width, 9)
    a, w = jnp.asarray(x, dtype), jnp.asarray(gate, dtype)
    sizes = jnp.asarray([3, 3, 0, 3], jnp.int32)
    np.testing.assert_allclose(np.asarray(gmm(a, w, sizes)),
                               np.asarray(ragged_gmm(a, w, sizes)), rtol=2e-5, atol=2e-5)


def test_grouped_matmul_backend_refuses_unknown_gpu_kernels():
    from jaxserve.runtime.grouped_matmul import grouped_matmul_backend
    with pytest.raises(ValueError, match="gpu_kernels must be 'mosaic' or 'triton'"):
        grouped_matmul_backend("pallas", "auto")
