"""A decode step's linears with their neighbours fused in: Pallas Triton kernel and reference.

For the few rows of a decode step (M <= MAX_ROWS), XLA runs a block's projections as a norm
fusion, a pad fusion, one GEMM per weight (or a merged one), an activation fusion and a
residual add: each a kernel of its own, and at batch 1 each costs more in launch and ramp than
in bytes (docs/perf_model.md). One call of this kernel does

    y = residual + epilogue(prologue(x) @ [W_0 | W_1 | ...])

- prologue (optional): the RMSNorm before a block's projections, as models/llama.py's RMSNorm
  computes it: `scale * round(x * rsqrt(mean(x^2) + eps))`, rounded to x's dtype. Each program
  sums its rows' squares itself: the rows are a few KB, read again from L2;
- several weights side by side (q, k and v): their outputs concatenated, `[M, N_0 + N_1 + ...]`;
  or two weights under a gated activation (gate and up): `silu(x @ W_g) * (x @ W_u)`, `[M, N]`;
- each weight's output rounded to the activations' dtype after its bias (added in f32), as
  models/llama.py's Linear does; then the activation; then the residual (optional, rounded);
- RoPE (optional) on the first `rope_weights` weights' outputs (q and k), per head of
  head_dim = 2 * len(inv_freq) columns in the rotate-half layout, as models/rope.py's
  apply_rope: cos and sin in f32, times `rope_scale`, rounded to the dtype. A program then
  computes a column tile and its partner half a head away, so the pair never leaves it; the
  outputs, q, k and v side by side, are what the attention kernel reads (no pack or RoPE
  fusion between them);
- the LM head (plain, `out_dtype` float32: the logits unrounded): the rows to take from x
  (`x_rows`, the step's last token of each sequence) gathered in the prologue, and a tied
  head's embedding read in its stored `[V, D]` layout (`transposed`), so the final norm, the
  row gather and the head are one kernel.

Grid: one program per `block_n` output columns (per weight pair with the activation); each
sums over all of K (no split-K, so the epilogue sees whole sums). A step's rows are padded to
a 16-row tile in registers only (masked loads and stores: no pad kernel). The program count is
out features / block_n: the engine takes this kernel only where that fills an H200
(runtime/backends.py `fused_linear_backend`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gpu_tiling import MIN_DOT_ROWS, NUM_SMS, load_rows, next_pow2, store_rows

MAX_ROWS = 64          # decode buckets; a prefill-sized step keeps XLA's GEMMs
ACTIVATIONS = (None, "silu")
DEFAULT_BLOCK_K = 256  # weight rows per loop step: a [256, 16] bf16 tile is 8 KB
DEFAULT_WARPS = 4


def default_block_n(widths: tuple[int, ...], gated: bool = False) -> int:
    """Output columns per program: 32 where that still gives two programs per H200 SM, else
    16 (Triton's smallest dot), so a 4096-wide projection runs 256 programs. gated: the
    weights' columns pair up (gate and up), one program per pair of tiles."""
    total = widths[0] if gated else sum(widths)
    for bn in (32, 16):
        if all(w % bn == 0 for w in widths) and total // bn >= 2 * NUM_SMS:
            return bn
    return 16


def _block_k(k: int, block_k: int) -> int:
    """The largest power of 2 <= block_k dividing K (K = 576 takes 64)."""
    bk = next_pow2(block_k)
    while bk > 16 and (bk > block_k or k % bk):
        bk //= 2
    if k % bk:
        raise ValueError(f"the fused linear needs K divisible by 16, got K={k}")
    return bk


def _fused_kernel(*refs, m, widths, activation, has_rows, has_norm, has_bias, has_residual,
                  eps, block_m, block_n, block_k, rope_weights, rope_scale, transposed):
    """refs: x [T, K], (x_rows [M] int32), (norm scale [K]), weights [K, N_i] ([N_i, K]
    transposed)..., (biases [N_i]...), (residual [M, N_out]), (positions [M] int32, inv_freq
    [Dh/2] f32 with RoPE), out [M, N_out]. Program j: `block_n` columns of one weight (of both
    with the activation; and the columns half a head further with RoPE)."""
    it = iter(refs)
    x_ref = next(it)
    rows_ref = next(it) if has_rows else None
    scale_ref = next(it) if has_norm else None
    w_refs = [next(it) for _ in widths]
    b_refs = [next(it) for _ in widths] if has_bias else [None] * len(widths)
    res_ref = next(it) if has_residual else None
    pos_ref, freq_ref = (next(it), next(it)) if rope_weights else (None, None)
    out_ref = next(it)
    k = x_ref.shape[1]
    dtype = x_ref.dtype
    f32 = jnp.float32
    # f32 activations keep IEEE products (DEFAULT is TF32 on the tensor cores).
    precision = lax.Precision.HIGHEST if dtype == jnp.float32 else lax.Precision.DEFAULT
    j = pl.program_id(0)
    rows = lax.broadcasted_iota(jnp.int32, (block_m,), 0)
    ok = rows < m
    # The rows of x this call computes: x's own, or those x_rows names (the LM head's).
    x_at = (plgpu.load(rows_ref.at[jnp.where(ok, rows, 0)], mask=ok, other=0) if has_rows
            else rows)
    steps = k // block_k

    inv_rms = None
    if has_norm:
        def squares(i, ss):
            xs = load_rows(x_ref, x_at, ok, block_k, i * block_k).astype(f32)  # [bm, bk]
            return ss + jnp.sum(xs * xs, axis=1)
        ss = lax.fori_loop(0, steps, squares, jnp.zeros((block_m,), f32))
        inv_rms = lax.rsqrt(ss / k + eps)[:, None]  # [bm, 1]

    def x_chunk(i):
        xs = load_rows(x_ref, x_at, ok, block_k, i * block_k)  # [bm, bk]
        if not has_norm:
            return xs
        normed = (xs.astype(f32) * inv_rms).astype(dtype)
        g = scale_ref[pl.ds(i * block_k, block_k)].astype(f32)  # [bk]
        return (g[None, :] * normed.astype(f32)).astype(dtype)

    def tile(w, i, col):
        """x_chunk(i) @ the weight's [bk, bn] tile at (i * bk, col), f32."""
        xs, ks, cs = x_chunk(i), pl.ds(i * block_k, block_k), pl.ds(col, block_n)
        if transposed:  # w [N, K]: a [bn, bk] tile of whole rows, contracted on K
            return lax.dot_general(xs, w[cs, ks], (((1,), (1,)), ((), ())),
                                   precision=precision, preferred_element_type=f32)
        return lax.dot(xs, w[ks, cs], precision=precision, preferred_element_type=f32)

    def matmul(ws, cols):
        """[x @ w[:, col:col + bn] for w, col in zip(ws, cols)], f32, one pass over K for
        all of them."""
        def step(i, accs):
            return tuple(acc + tile(w, i, col) for acc, w, col in zip(accs, ws, cols))
        zero = jnp.zeros((block_m, block_n), f32)
        return lax.fori_loop(0, steps, step, (zero,) * len(ws))

    def rotate(a, b, c):
        """RoPE of a head's columns c.. (a) and their partners half a head away (b), `[bm,
        bn]` in the dtype: (a cos - b sin, b cos + a sin) at each row's position."""
        pos = plgpu.load(pos_ref.at[jnp.where(ok, rows, 0)], mask=ok, other=0).astype(f32)
        angle = pos[:, None] * freq_ref[pl.ds(c, block_n)].astype(f32)[None, :]  # [bm, bn]
        cos = (jnp.cos(angle) * rope_scale).astype(dtype).astype(f32)
        sin = (jnp.sin(angle) * rope_scale).astype(dtype).astype(f32)
        a, b = a.astype(f32), b.astype(f32)
        return (a * cos - b * sin).astype(dtype), (b * cos + a * sin).astype(dtype)

    def output(acc, b_ref, col):
        """A weight's columns as Linear returns them: bias in f32, rounded to the dtype (to
        the output's: the head's f32 logits)."""
        if b_ref is not None:
            acc = acc + b_ref[pl.ds(col, block_n)].astype(f32)[None, :]
        return acc.astype(out_ref.dtype)  # x's dtype but in plain calls (_check)

    def finish(y, out_col):
        if res_ref is not None:
            r = load_rows(res_ref, rows, ok, block_n, out_col)
            y = (r.astype(f32) + y.astype(f32)).astype(dtype)
        store_rows(out_ref, rows, ok, y.astype(out_ref.dtype), out_col)

    if activation is not None:  # gate and up: one program per block_n columns of both
        col = j * block_n
        gate, up = matmul(w_refs, (col, col))
        g = output(gate, b_refs[0], col).astype(f32)
        u = output(up, b_refs[1], col).astype(f32)
        # One rounding at the end, as XLA fuses silu(gate) * up (excess precision allowed).
        finish((g * jax.nn.sigmoid(g) * u).astype(dtype), col)
        return
    start, out0 = 0, 0
    half = freq_ref.shape[0] if rope_weights else 0  # head_dim / 2
    for i, (w_ref, b_ref, width) in enumerate(zip(w_refs, b_refs, widths)):
        roped = i < rope_weights
        tiles = width // block_n // (2 if roped else 1)

        @pl.when((j >= start) & (j < start + tiles))
        def _(w_ref=w_ref, b_ref=b_ref, start=start, out0=out0, roped=roped):
            p = j - start
            if not roped:
                (acc,) = matmul([w_ref], (p * block_n,))
                finish(output(acc, b_ref, p * block_n), out0 + p * block_n)
                return
            per_head = half // block_n
            c = (p % per_head) * block_n  # within the head's first half
            lo = (p // per_head) * 2 * half + c
            acc_lo, acc_hi = matmul([w_ref, w_ref], (lo, lo + half))
            a, b = rotate(output(acc_lo, b_ref, lo), output(acc_hi, b_ref, lo + half), c)
            finish(a, out0 + lo)
            finish(b, out0 + lo + half)
        start, out0 = start + tiles, out0 + width


def _check(x, x_rows, weights, norm_scale, biases, residual, activation, positions, inv_freq,
           rope_weights, transposed, out_dtype):
    if x.ndim != 2:
        raise ValueError(f"fused_linear takes x [M, K], got shape {x.shape}")
    if x_rows is not None and (x_rows.ndim != 1 or
                               not jnp.issubdtype(x_rows.dtype, jnp.integer)):
        raise ValueError(f"x_rows must be [M] integers, got {x_rows.dtype}{list(x_rows.shape)}")
    m, k = (x.shape if x_rows is None else (x_rows.shape[0], x.shape[1]))
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"fused_linear is for decode steps of 1..{MAX_ROWS} rows, got {m}")
    kdim = 1 if transposed else 0
    if not weights or any(w.ndim != 2 or w.shape[kdim] != k for w in weights):
        layout = f"[N, K={k}]" if transposed else f"[K={k}, N]"
        raise ValueError(f"weights must be {layout} matrices, got "
                         f"{[tuple(w.shape) for w in weights]}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    plain = activation is None and not rope_weights and residual is None
    if (x_rows is not None or jnp.dtype(out_dtype) != x.dtype) and not plain:
        raise ValueError("x_rows and an out_dtype other than x's are for plain calls (the LM "
                         "head): no activation, RoPE or residual")
    widths = tuple(w.shape[1 - kdim] for w in weights)
    if activation is not None and (len(weights) != 2 or widths[0] != widths[1]):
        raise ValueError(f"a gated activation takes two weights of one shape (gate, up), got "
                         f"{[tuple(w.shape) for w in weights]}")
    if norm_scale is not None and norm_scale.shape != (k,):
        raise ValueError(f"norm_scale must be [K={k}], got {norm_scale.shape}")
    if biases is not None and (len(biases) != len(weights) or any(
            b.shape != (n,) for b, n in zip(biases, widths))):
        raise ValueError(f"biases must be one [N_i] per weight, got "
                         f"{[tuple(b.shape) for b in biases]}")
    n_out = widths[0] if activation is not None else sum(widths)
    if residual is not None and residual.shape != (m, n_out):
        raise ValueError(f"residual must be [M, N]={(m, n_out)}, got {residual.shape}")
    if rope_weights:
        if activation is not None or not 0 < rope_weights <= len(weights):
            raise ValueError(f"rope_weights must be in [1, {len(weights)}] without an "
                             f"activation, got {rope_weights} with {activation!r}")
        if positions is None or inv_freq is None or positions.shape != (m,) or \
                inv_freq.ndim != 1:
            raise ValueError("RoPE needs positions [M] and inv_freq [head_dim / 2]")
        head_dim = 2 * inv_freq.shape[0]
        if any(n % head_dim for n in widths[:rope_weights]):
            raise ValueError(f"the rotated weights' widths {widths[:rope_weights]} must be "
                             f"whole heads of head_dim={head_dim}")
    return widths, n_out


@functools.partial(jax.jit, static_argnames=("eps", "activation", "rope_weights", "rope_scale",
                                             "transposed", "out_dtype", "block_n", "block_k",
                                             "num_warps", "interpret"))
def fused_linear(x, weights, norm_scale=None, biases=None, residual=None, positions=None,
                 inv_freq=None, x_rows=None, *, eps: float = 1e-6,
                 activation: str | None = None, rope_weights: int = 0, rope_scale: float = 1.0,
                 transposed: bool = False, out_dtype=None, block_n: int | None = None,
                 block_k: int = DEFAULT_BLOCK_K, num_warps: int = DEFAULT_WARPS,
                 interpret=False):
    """x `[M, K]` (M <= MAX_ROWS); weights: a tuple of `[K, N_i]` in x's dtype (`[N_i, K]`
    with transposed); norm_scale `[K]` (RMSNorm with `eps` first) or None; biases: one `[N_i]`
    per weight, or None; residual `[M, N_out]` or None; activation None (outputs side by side,
    N_out = sum N_i) or "silu" (two weights: silu(x @ W_0) * (x @ W_1), N_out = N_0);
    rope_weights > 0: RoPE on the first rope_weights outputs, at positions `[M]` int32 with
    inv_freq `[head_dim / 2]` f32, cos and sin times rope_scale. Plain calls only (no
    activation, RoPE or residual): x_rows `[M]` int32, the rows of x `[T, K]` to compute (any
    T); out_dtype, the outputs' dtype (default x's; float32 for logits). Returns `[M, N_out]`.
    interpret: False on GPU; True (or an interpreter's params) to run on CPU."""
    weights = tuple(weights)
    biases = None if biases is None else tuple(biases)
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    widths, n_out = _check(x, x_rows, weights, norm_scale, biases, residual, activation,
                           positions, inv_freq, rope_weights, transposed, out_dtype)
    m, k = x.shape if x_rows is None else (x_rows.shape[0], x.shape[1])
    bn = block_n or default_block_n(widths, gated=activation is not None)
    if rope_weights:  # a program's tile and its partner both inside half a head
        bn = min(bn, inv_freq.shape[0])
    if any(w % bn for w in widths) or (rope_weights and inv_freq.shape[0] % bn):
        raise ValueError(f"every weight's width (and half a head with RoPE) must be a "
                         f"multiple of block_n={bn}, got {widths}")
    bk = _block_k(k, block_k)
    tiles = (widths[0] // bn if activation is not None
             else sum(widths) // bn - sum(widths[:rope_weights]) // (2 * bn))
    kernel = functools.partial(
        _fused_kernel, m=m, widths=widths, activation=activation,
        has_rows=x_rows is not None, has_norm=norm_scale is not None,
        has_bias=biases is not None, has_residual=residual is not None, eps=float(eps),
        block_m=max(MIN_DOT_ROWS, next_pow2(m)), block_n=bn, block_k=bk,
        rope_weights=rope_weights, rope_scale=float(rope_scale), transposed=transposed)
    rope = [positions.astype(jnp.int32), inv_freq.astype(jnp.float32)] if rope_weights else []
    rows = [] if x_rows is None else [x_rows.astype(jnp.int32)]
    operands = [x, *rows, *([norm_scale] if norm_scale is not None else []), *weights,
                *(biases or ()), *([residual] if residual is not None else []), *rope]

    def whole(a):
        return pl.BlockSpec(a.shape, lambda i, nd=a.ndim: (0,) * nd)

    params = None if interpret else plgpu.CompilerParams(num_warps=num_warps)
    return pl.pallas_call(
        kernel,
        grid=(tiles,),
        in_specs=[whole(a) for a in operands],
        out_specs=pl.BlockSpec((m, n_out), lambda i: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((m, n_out), out_dtype),  # [M, N_out]
        compiler_params=params,
        interpret=interpret,
        name="fused_linear",
    )(*operands)


def _rope_reference(y, positions, inv_freq, scale):
    """models/rope.py's apply_rope on `[M, heads * Dh]`: rotate-half per head."""
    m, half = y.shape[0], inv_freq.shape[0]
    angle = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [M, Dh/2]
    cos = (jnp.cos(angle) * scale).astype(y.dtype)[:, None, :]  # [M, 1, Dh/2]
    sin = (jnp.sin(angle) * scale).astype(y.dtype)[:, None, :]
    x1, x2 = jnp.split(y.reshape(m, -1, 2 * half), 2, axis=-1)  # [M, heads, Dh/2] each
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).reshape(m, -1)


def fused_linear_reference(x, weights, norm_scale=None, biases=None, residual=None,
                           positions=None, inv_freq=None, x_rows=None, *, eps: float = 1e-6,
                           activation: str | None = None, rope_weights: int = 0,
                           rope_scale: float = 1.0, transposed: bool = False, out_dtype=None):
    """The kernel's contract in jax.numpy, op by op as models/llama.py runs a block (RMSNorm,
    Linear, RoPE, the MLP's silu(gate) * up, the residual add) and its head (the rows taken,
    the final norm, x @ W or x @ E^T in float32). Same arguments and result."""
    dtype = x.dtype
    if x_rows is not None:
        x = x[x_rows]
    if transposed:
        weights = [w.T for w in weights]
    h = x
    if norm_scale is not None:
        x32 = x.astype(jnp.float32)
        normed = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
        h = norm_scale * normed.astype(dtype)
    outs = []
    for i, w in enumerate(weights):
        y = jnp.einsum("mk,kn->mn", h, w, preferred_element_type=jnp.float32,
                       precision=lax.Precision.HIGHEST)
        if biases is not None:
            y = y + biases[i]
        y = y.astype(out_dtype or dtype)
        if i < rope_weights:
            y = _rope_reference(y, positions, inv_freq, rope_scale)
        outs.append(y)
    y = jax.nn.silu(outs[0]) * outs[1] if activation == "silu" else jnp.concatenate(outs, -1)
    return y if residual is None else residual + y
