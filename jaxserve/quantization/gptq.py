"""GPTQ (Frantar et al., 2023): layer-wise quantization with Hessian-based error compensation.

For a linear y = x W (W [K, N], rows along the input dimension K) and calibration inputs
X [M, K], GPTQ minimises ||X W - X W_hat||^2 one input row at a time: with H = 2 X^T X / M
(plus 1% of its mean diagonal as dampening), row k is rounded, and its error e_k = (w_k - q_k)
/ [U]_kk moves into the rows not yet quantized, W[j] -= U[k, j] e_k, where U is the upper
Cholesky factor of H^-1 (its rows are the OBS updates of the shrinking inverse Hessian). Rows
are processed in blocks of 128 (lazy batch updates: rows after the block get the block's
accumulated errors in one matmul). Output columns are independent given H, so linears that share
an input (q/k/v, gate/up) run as one wide problem.

Group parameters: without act-order, a group's (s, z) come from the group's rows as they are
when its first row is reached, i.e. after the compensation from all earlier rows. With act-order
(rows by decreasing diag(H), most sensitive first), the served pytree needs contiguous groups in
the original row order, so group parameters are computed up front from the original weights
("static groups"; what AutoGPTQ calls static_groups) and each row uses its original group's.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import scipy.linalg

from jaxserve.quantization.core import (QuantSpec, compute_qparams, dequantize_codes,
                                        quantize_with, to_weight)
from jaxserve.quantization.layerwise import sequential_quantize, spec_for

BLOCK_SIZE = 128
DAMP = 0.01


@dataclasses.dataclass(frozen=True)
class GPTQConfig:
    act_order: bool = False
    block_size: int = BLOCK_SIZE
    damp: float = DAMP  # fraction of the mean diagonal of H added to its diagonal

    def __post_init__(self):
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")
        if not 0 <= self.damp < 1:
            raise ValueError(f"damp is a fraction of the mean Hessian diagonal in [0, 1), got "
                             f"{self.damp!r}")


def hessian(x) -> np.ndarray:
    """H = 2 X^T X / M of inputs x [M, K], float64 [K, K]."""
    x = np.asarray(x, np.float64)
    return 2.0 / x.shape[0] * (x.T @ x)


def inverse_cholesky(h: np.ndarray, damp: float) -> np.ndarray:
    """Upper U with U^T U = (H + damp * mean(diag H) I)^-1, float64 (H's dead rows set to 1)."""
    h = np.array(h, np.float64)
    diag = np.arange(h.shape[0])
    h[diag, diag] = np.where(np.diag(h) == 0, 1.0, np.diag(h))
    h[diag, diag] += damp * np.mean(np.diag(h))
    # With J the row reversal, J H J = C C^T gives H = R R^T for the upper R = J C J, so
    # U = R^-1: one Cholesky and one triangular inverse instead of a full inverse and a second
    # Cholesky.
    r = np.linalg.cholesky(h[::-1, ::-1])[::-1, ::-1]  # upper
    return scipy.linalg.solve_triangular(r, np.eye(h.shape[0]), lower=False)


@functools.partial(jax.jit, static_argnames=("spec", "block_size", "dynamic_groups"))
def _gptq_rows(w, u, s_table, z_table, row_group, spec: QuantSpec, block_size: int,
               dynamic_groups: bool):
    """The row loop. w [K, N] and u [K, K] in processing order; row r uses group row_group[r]
    of s_table/z_table [G, N], which dynamic_groups fills at each group's first row.
    Returns codes [K, N] (processing order), s_table, z_table."""
    k, n = w.shape
    g = k // s_table.shape[0]
    codes = jnp.zeros((k, n), jnp.int32)
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        u1 = u[i1:i2, i1:i2]  # [B, B]

        def row(i, carry):
            w1, q1, err1, s_tab, z_tab = carry
            r = i1 + i
            grp = row_group[r]
            if dynamic_groups:  # g divides the block size: a group never straddles blocks
                def fresh():
                    s, z = compute_qparams(jax.lax.dynamic_slice(w1, (i, 0), (g, n)), spec)
                    return s_tab.at[grp].set(s[0]), z_tab.at[grp].set(z[0])
                s_tab, z_tab = jax.lax.cond(r % g == 0, fresh, lambda: (s_tab, z_tab))
            s, z = s_tab[grp][None], z_tab[grp][None]  # [1, N]
            w_row = w1[i][None]  # [1, N]
            q = quantize_with(w_row, s, z, spec)
            err = (w_row - dequantize_codes(q, s, z))[0] / u1[i, i]  # [N]
            # u1 is upper triangular: rows before i are untouched, row i becomes its rounding.
            w1 = w1 - u1[i][:, None] * err[None, :]
            return w1, q1.at[i].set(q[0]), err1.at[i].set(err), s_tab, z_tab

        b = i2 - i1
        init = (w[i1:i2], jnp.zeros((b, n), jnp.int32), jnp.zeros((b, n), jnp.float32),
                s_table, z_table)
        _, q1, err1, s_table, z_table = jax.lax.fori_loop(0, b, row, init)
        codes = codes.at[i1:i2].set(q1)
        w = w.at[i2:].add(-(u[i1:i2, i2:].T @ err1))  # the lazy batch update
    return codes, s_table, z_table


def gptq_kernel(w, h, spec: QuantSpec, config: GPTQConfig = GPTQConfig()):
    """GPTQ of one kernel w [K, N] with Hessian h [K, K]: (codes [K, N], s, z [K/g, N])."""
    w = np.array(w, np.float32)
    k, n = w.shape
    if spec.granularity == "group" and config.block_size % spec.rows_per_group(k):
        raise ValueError(f"block_size {config.block_size} must be a multiple of the group size "
                         f"{spec.group_size}")
    dead = np.diag(h) == 0
    w[dead] = 0.0  # inputs that are always zero: any value works, zero quantizes exactly
    perm = np.argsort(-np.diag(h), kind="stable") if config.act_order else np.arange(k)
    u = inverse_cholesky(np.asarray(h)[np.ix_(perm, perm)], config.damp).astype(np.float32)
    g = spec.rows_per_group(k)
    dynamic = spec.granularity == "group" and not config.act_order
    if dynamic:
        s0 = z0 = jnp.zeros((k // g, n), jnp.float32)
    else:  # per channel / tensor, or static groups: parameters of the original weights
        s0, z0 = compute_qparams(jnp.asarray(w), spec)
    row_group = (perm // g).astype(np.int32)
    codes, s, z = _gptq_rows(jnp.asarray(w[perm]), jnp.asarray(u), s0, z0,
                             jnp.asarray(row_group), spec, config.block_size, dynamic)
    inverse = np.argsort(perm)
    return codes[inverse], s, z


def gptq_stage(spec: QuantSpec, config: GPTQConfig = GPTQConfig()):
    """A `sequential_quantize` stage: GPTQ of the linears sharing input x, as one wide kernel."""

    def stage(kernels: dict, x) -> dict:
        k = x.shape[1]
        s_ = spec_for(k, spec)
        h = hessian(x)
        groups = [list(kernels)] if spec.granularity != "tensor" else [[n] for n in kernels]
        out = {}
        for names in groups:  # per-tensor parameters couple columns: one kernel at a time
            w = jnp.concatenate([kernels[n] for n in names], axis=1)  # [K, sum N]
            q, s, z = gptq_kernel(w, h, s_, config)
            start = 0
            for name in names:
                cols = slice(start, start + kernels[name].shape[1])
                start = cols.stop
                qn, sn, zn = q[:, cols], s[:, cols], z[:, cols]
                out[name] = (to_weight(qn, sn, zn, s_), dequantize_codes(qn, sn, zn))
        return out

    return stage


def gptq_quantize(model, spec: QuantSpec, calibration, config: GPTQConfig = GPTQConfig(),
                  progress: bool = True) -> dict:
    """GPTQ of every decoder linear of `model` on `calibration` -> params with pytrees.

    `calibration` is a calibration.Calibration, or None for the built-in text.
    """
    if calibration is None:
        from jaxserve.quantization.calibration import load_calibration
        calibration = load_calibration(model)
    return sequential_quantize(model, calibration.tokens, gptq_stage(spec, config),
                               f"GPTQ int{spec.bits}", progress)
