"""The native CPU float-weight matmul (jaxserve/native/cpu_float_matmul.cc) and its dispatch.

- the kernel (AVX-512 and portable loops) against float64 numpy over a grid of rows, widths,
  weight dtypes and both layouts ([K, N] kernels, the tied head's [N, K]), within the float32
  accumulation bound (float_matmul.error_bound);
- the cpu linear and head backends: the native call at up to NATIVE_FLOAT_ROWS rows, XLA's dot
  above, never for the xla kind;
- the engine on the native path (layers in a scan, the default, and unrolled) against a dense
  greedy loop on XLA's dots.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import LLM, native
from jaxserve.native import isa
from jaxserve.native.float_matmul import error_bound, float_matmul_cpu, float_matmul_reference
from jaxserve.runtime import backends
from models.random_init import random_model
from test_quantized_engine import ENGINE, PROMPTS, TINY, dense_greedy, engine_greedy

pytestmark = pytest.mark.skipif(native.unavailable_reason() is not None,
                                reason=f"native library: {native.unavailable_reason()}")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def check(m, k, n, dtype, transposed, target="jaxserve_float_matmul", seed=0):
    rng = np.random.default_rng(seed + 131 * m + k + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = jnp.asarray(rng.standard_normal((n, k) if transposed else (k, n)), DTYPES[dtype])
    y = np.asarray(float_matmul_cpu(jnp.asarray(x), w, transposed, target=target))
    assert y.shape == (m, n) and y.dtype == np.float32
    err = np.abs(y - float_matmul_reference(x, w, transposed))
    bound = error_bound(x, w, transposed)
    assert np.all(err <= bound), f"worst error {err.max():.3g} exceeds its bound by " \
                                 f"{np.max(err - bound):.3g}"


@pytest.mark.parametrize("transposed", [False, True], ids=["KN", "NK"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("m", [1, 3, 9, 16])
@pytest.mark.parametrize("k,n", [(64, 48), (37, 45), (576, 33)])
def test_kernel_matches_float64_reference(m, k, n, dtype, transposed):
    check(m, k, n, dtype, transposed)


@pytest.mark.parametrize("m,transposed", [(8, False), (17, False), (33, True), (2, True)])
def test_rows_past_a_register_block(m, transposed):
    check(m, 40, 70, "float32", transposed)


def test_leading_axes_and_bfloat16_activations_widen_exactly():
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((2, 3, 32)), jnp.bfloat16)  # [B, T, K]
    w = jnp.asarray(rng.standard_normal((32, 20)), jnp.bfloat16)
    y = np.asarray(float_matmul_cpu(x, w))
    assert y.shape == (2, 3, 20)
    x2 = np.asarray(x.astype(jnp.float32)).reshape(6, 32)
    err = np.abs(y.reshape(6, 20) - float_matmul_reference(x2, w))
    assert np.all(err <= error_bound(x2, w))


def test_bad_weights_are_refused():
    x = jnp.ones((2, 8), jnp.float32)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        float_matmul_cpu(x, jnp.ones((8, 4), jnp.float16))
    with pytest.raises(ValueError, match="does not match the weight's K = 6"):
        float_matmul_cpu(x, jnp.ones((4, 6), jnp.float32), transposed=True)


@pytest.fixture(scope="module")
def portable_target():
    """The float matmul's portable loop: the AVX2 build (jaxserve/native/isa.py) has no AVX-512
    loop, so it runs that one, registered under its own target name."""
    build = isa.BY_NAME["avx2"]
    if not build.needs <= isa.cpu_flags():
        pytest.skip("this CPU does not run the avx2 build")
    assert native.load_build(build, "avx2").jaxserve_float_matmul_avx512() == 0
    return "jaxserve_float_matmul_avx2"


@pytest.mark.parametrize("m,dtype,transposed", [(1, "float32", False), (9, "bfloat16", False),
                                                (3, "float32", True), (16, "bfloat16", True)])
def test_portable_loop_matches_float64_reference(portable_target, m, dtype, transposed):
    check(m, 37, 45, dtype, transposed, target=portable_target)


def ffi_targets(fn, *args) -> str:
    return str(jax.make_jaxpr(fn)(*args))


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_cpu_linear_and_head_go_native_at_few_rows_only(dtype):
    if not backends.native_float("cpu"):
        pytest.skip("the library has no AVX-512 loops here")
    rows = backends.NATIVE_FLOAT_ROWS[dtype]
    w = jnp.ones((32, 48), DTYPES[dtype])
    emb = jnp.ones((48, 32), DTYPES[dtype])  # [V, D]
    linear, head = backends.linear_backend("cpu"), backends.head_backend("cpu")
    for m, native_call in [(1, True), (rows, True), (rows + 1, False)]:
        x = jnp.ones((1, m, 32), DTYPES[dtype])  # [B, T, D]
        for fn, weight in [(linear, w), (head, emb)]:
            jaxpr = ffi_targets(lambda x, v, fn=fn: fn(x, v), x, weight)
            assert ("jaxserve_float_matmul" in jaxpr) == native_call, (m, fn)
            assert ("dot_general" in jaxpr) != native_call, (m, fn)
    x = jnp.ones((1, 1, 32), DTYPES[dtype])
    for kind in ("xla", "pallas-interpret"):
        assert "jaxserve_float_matmul" not in ffi_targets(
            lambda x, w: backends.linear_backend(kind)(x, w), x, w)
        assert backends.head_backend(kind) is not head
    assert "jaxserve_float_matmul" not in ffi_targets(  # float16: XLA's dot
        lambda x, w: linear(x, w), x.astype(jnp.float16), w.astype(jnp.float16))


def test_engine_on_native_float_path_equals_dense_oracle():
    if not backends.native_float("cpu"):
        pytest.skip("the library has no AVX-512 loops here")
    model = random_model(TINY, seed=5)
    assert model.config.tie_word_embeddings  # the head goes native too
    llm = LLM(model, linear_backend="cpu", **ENGINE)
    assert not llm.engine.runner.unroll_layers  # float weights keep the scan (start-up time)
    want = [dense_greedy(model, model.params, backends.linear_backend("xla"), p) for p in PROMPTS]
    got = engine_greedy(model, PROMPTS, "none", linear_backend="cpu")
    assert got == want
    assert engine_greedy(model, PROMPTS, "none", linear_backend="cpu", layer_loop="unrolled") == want
