"""Token sampling, one row per program, in one Pallas (Triton GPU) kernel; a sort-based reference.

Per row r of `scaled` [S, V] (processed logits divided by the row's temperature; greedy rows
divided by 1) and `raw` [S, V] (the logits the log-probabilities are of), the kernel returns:

- token: greedy rows the first index of the row max; other rows a draw by inverse CDF with
  the uniform u[r] from the distribution exp(scaled - max) restricted to scaled >= cutoff,
  where cutoff is the smallest logit kept by top-k (k[r]; V: off), then top-p (top_p[r]; 1: off)
  on the top-k renormalised probabilities, then min-p (log_min_p[r] = log(min_p); -inf: off).
  Each filter keeps a prefix of the descending order and ties at the cutoff are all kept: the
  top-k cutoff is the k-th largest logit, the top-p cutoff the largest logit t whose set
  {scaled >= t} holds at least top_p of the top-k mass. The draw takes the first token whose
  cumulative weight (vocabulary order) exceeds u * total, so a zero-weight token is never drawn.
- logprob: raw[token] - logsumexp(raw).
- the row's `num_logprobs` largest raw logits (ties: lower index first, as lax.top_k) minus
  logsumexp(raw), and their ids; zeros when `want` is 0.

The kernel walks the row in power-of-2 chunks (the last one masked): one pass for the max,
argmax, logsumexp (online) and the running top-`num_logprobs` list (a chunk is merged only
while it holds a logit above the list's last); for rows with a filter, the exact cutoffs by
bisection on the floats' order keys (32-bit keys with the floats' order; each step one pass
counting keys >= t, or summing the weights of those keys), the bracket snapped to the row's
keys so the search ends once no key lies strictly inside it; for rows that draw, one pass for the total weight and one that stops at the chunk holding
the draw. Rows without a filter skip the bisections, greedy rows the draw: a per-row branch
inside the kernel, which costs no host synchronisation. Every value is float32; sums are
chunk-wise (another order than XLA's), so a row whose top-p mass or draw lands within float
rounding of a boundary may pick a neighbouring token: the contract is the exact cutoffs above.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# One program per row leaves each SM a single program: 8 warps and 4096-logit chunks (16 per
# thread, as 4 warps on 2048) keep twice the bytes in flight. Chosen from that arithmetic and
# ptxas (126 registers, no spills), not timed on a GPU.
DEFAULT_CHUNK = 4096     # row elements per loop step
DEFAULT_WARPS = 8
_NEG = float("-inf")
_SIGN = 0x8000_0000
_MAX_KEY = 0xFFFF_FFFF
_GREEDY, _WANT = 1, 2  # the per-row flags' bits (one argument: one XLA fusion makes them)

__all__ = ["sample_rows", "sample_rows_reference", "order_key", "DEFAULT_CHUNK", "DEFAULT_WARPS"]


def order_key(x):
    """uint32 keys with the order of the float32 x: flip negative floats' bits, set positives'
    sign bit."""
    b = lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(b >> 31 == 1, ~b, b | jnp.uint32(_SIGN))


def _from_order_key(k):
    return lax.bitcast_convert_type(jnp.where(k >> 31 == 1, k & jnp.uint32(0x7FFF_FFFF), ~k),
                                    jnp.float32)


def _bisect(probe, hi):
    """Largest uint32 key t in [0, hi) with pred(t), given pred(0) and pred monotone (true below
    a threshold). probe(t) -> (pred(t), the smallest element key >= t, the largest < t): pred
    changes only at element keys, so the bracket snaps to them, and once it holds no element
    key strictly inside (a row of ~1e5 logits over 2^32 keys: after ~17 halvings, not 32) the
    answer is its low end."""
    def step(lohi):
        lo, hi = lohi
        mid = lo + (hi - lo) // 2
        ok, above, below = probe(mid)
        return (jnp.where(ok, jnp.maximum(mid, jnp.minimum(above, hi - 1)), lo),
                jnp.where(ok, hi, jnp.maximum(below + 1, lo + 1)))

    return lax.while_loop(lambda lohi: lohi[1] - lohi[0] > 1, step, (jnp.uint32(0), hi))[0]


def _sampling_kernel(k_ref, flags_ref, top_p_ref, log_min_p_ref, u_ref, scaled_ref, raw_ref,
                     tok_ref, lp_ref, ids_ref, tlp_ref, *, v, chunk, num_logprobs):
    r = pl.program_id(0)
    nc = pl.cdiv(v, chunk)
    lane = lax.broadcasted_iota(jnp.int32, (chunk,), 0)  # [C]
    kpow = 1 << (max(num_logprobs, 1) - 1).bit_length()  # the top list's power-of-2 width
    slot = lax.broadcasted_iota(jnp.int32, (kpow,), 0)  # [KP]
    prev = (lax.broadcasted_iota(jnp.int32, (kpow, kpow), 1)
            == lax.broadcasted_iota(jnp.int32, (kpow, kpow), 0) - 1)  # [KP, KP]: j-1 -> j

    def load(ref, c):
        idx = c * chunk + lane  # [C]
        ok = idx < v
        return plgpu.load(ref.at[r, pl.ds(c * chunk, chunk)], mask=ok, other=_NEG), idx, ok

    # ---- pass 1: max / argmax of scaled, online logsumexp and top list of raw ----
    flags = flags_ref[r]
    want = (flags & _WANT) != 0

    def merge(vals, idx, ok, lv, li, n):
        """The top-num_logprobs list (lv, li sorted, n filled) with this chunk's logits merged:
        its largest logits are inserted in descending order while they beat the list's last
        (or the list is not full). Ties go after equal logits already listed, which have lower
        indices, so the order is lax.top_k's."""
        def insert(s):
            alive, lv, li, n, it, _ = s
            m = jnp.max(jnp.where(alive, vals, _NEG))
            i = jnp.min(jnp.where(alive & (vals == m), idx, v))
            last = jnp.max(jnp.where(slot == num_logprobs - 1, lv, _NEG))
            accept = (i < v) & ((n < num_logprobs) | (m > last))
            pos = jnp.sum(((slot < n) & (lv >= m)).astype(jnp.int32))
            shifted_v = jnp.max(jnp.where(prev, lv[None, :], _NEG), axis=1)  # [KP]
            shifted_i = jnp.max(jnp.where(prev, li[None, :], -1), axis=1)
            new_v = jnp.where(slot < pos, lv, jnp.where(slot == pos, m, shifted_v))
            new_i = jnp.where(slot < pos, li, jnp.where(slot == pos, i, shifted_i))
            return (alive & ~(accept & (idx == i)), jnp.where(accept, new_v, lv),
                    jnp.where(accept, new_i, li),
                    jnp.where(accept, jnp.minimum(n + 1, num_logprobs), n), it + 1, accept)

        s = lax.while_loop(lambda s: s[5] & (s[4] < num_logprobs), insert,
                           (ok, lv, li, n, jnp.int32(0), jnp.bool_(True)))
        return s[1], s[2], s[3]

    def pass1(c, carry):
        m_raw, s_raw, m_s, arg, lv, li, n = carry
        raw, idx, ok = load(raw_ref, c)
        sc, _, _ = load(scaled_ref, c)
        new_m = jnp.maximum(m_raw, jnp.max(raw))
        # -inf logits add nothing (a chunk of them before any finite one would add NaN).
        fresh = jnp.where(ok & (raw != _NEG), jnp.exp(raw - new_m), 0.0)
        s_raw = jnp.where(m_raw == new_m, s_raw, s_raw * jnp.exp(m_raw - new_m)) + jnp.sum(fresh)
        cmax = jnp.max(sc)
        carg = jnp.min(jnp.where(sc == cmax, idx, v))  # first index of the chunk's max
        better = cmax > m_s
        if num_logprobs:
            lv, li, n = lax.cond(want, lambda: merge(raw, idx, ok, lv, li, n),
                                 lambda: (lv, li, n))
        return (new_m, s_raw, jnp.where(better, cmax, m_s), jnp.where(better, carg, arg),
                lv, li, n)

    init = (jnp.float32(_NEG), jnp.float32(0.0), jnp.float32(_NEG), jnp.int32(0),
            jnp.full((kpow,), _NEG, jnp.float32), jnp.zeros((kpow,), jnp.int32), jnp.int32(0))
    m_raw, s_raw, top, arg, lv, li, _ = lax.fori_loop(0, nc, pass1, init)
    lse = m_raw + jnp.log(s_raw)

    # ---- pass 2: the filters' cutoff (rows with a filter only) ----
    k, top_p, log_min_p = k_ref[r], top_p_ref[r], log_min_p_ref[r]
    greedy = (flags & _GREEDY) != 0
    has_k, has_p = k < v, top_p < 1.0
    filtered = ~greedy & (has_k | has_p | (log_min_p > _NEG))

    def measure(t, weight, floor):
        """(sum of weight(scaled) over keys >= max(t, floor), the smallest key >= t, the
        largest key < t) over the row."""
        def body(c, acc):
            total, above, below = acc
            sc, _, ok = load(scaled_ref, c)
            key = order_key(sc)
            ge = ok & (key >= t)
            w = weight(sc)
            return (total + jnp.sum(jnp.where(ge & (key >= floor), w, jnp.zeros_like(w))),
                    jnp.minimum(above, jnp.min(jnp.where(ge, key, jnp.uint32(_MAX_KEY)))),
                    jnp.maximum(below, jnp.max(jnp.where(ok & ~ge, key, jnp.uint32(0)))))
        zero = jnp.zeros((), weight(top).dtype)
        return lax.fori_loop(0, nc, body, (zero, jnp.uint32(_MAX_KEY), jnp.uint32(0)))

    def one(sc):
        return jnp.ones(sc.shape, jnp.int32)

    def prob(sc):  # exp(scaled - top): the top-k weights before normalisation
        return jnp.exp(sc - top)

    # Triton lowering: a lax.cond branch must not return a literal, so skipped sides return
    # their (traced) operand; a filter that is off gets a one-key bracket (no bisection step).
    def cutoff(_):
        hi = order_key(top) + jnp.uint32(1)  # no key passes max + 1
        def count_probe(t):
            n, above, below = measure(t, one, jnp.uint32(0))
            return n >= k, above, below

        k_key = _bisect(count_probe, jnp.where(has_k, hi, jnp.uint32(1)))
        need = lax.cond(has_p, lambda p: p * measure(k_key, prob, k_key)[0], lambda p: p, top_p)

        def mass_probe(t):
            mass, above, below = measure(t, prob, k_key)
            return mass >= need, above, below

        p_key = _bisect(mass_probe, jnp.where(has_p, hi, jnp.uint32(1)))
        kept = jnp.where(has_k | has_p, _from_order_key(jnp.maximum(k_key, p_key)), _NEG)
        return jnp.maximum(kept, top + log_min_p)

    cut = lax.cond(filtered, cutoff, lambda c: c, jnp.where(filtered, top, _NEG))

    # ---- pass 3: the draw (rows that are not greedy) ----
    def weights(c):
        sc, _, ok = load(scaled_ref, c)
        w = jnp.where(ok & (sc >= cut), jnp.exp(sc - top), 0.0)  # [C]
        cum = jnp.cumsum(w)
        return w, cum, jnp.max(cum)  # cum never decreases: its max is the chunk's sum

    def draw():
        total = lax.fori_loop(0, nc, lambda c, acc: acc + weights(c)[2], jnp.float32(0.0))
        below = lax.bitcast_convert_type(lax.bitcast_convert_type(total, jnp.int32) - 1,
                                         jnp.float32)  # nextafter(total, 0): total > 0
        target = jnp.minimum(u_ref[r] * total, below)

        def step(s):  # same chunk sums in the same order as total: the last hit is found
            c, run, tok = s
            w, cum, mass = weights(c)
            j = jnp.min(jnp.where((run + cum > target) & (w > 0), lane, chunk))
            hit = (run + mass > target) & (j < chunk)
            return c + 1, run + mass, jnp.where(hit, c * chunk + j, tok)

        tok = lax.while_loop(lambda s: (s[0] < nc) & (s[2] < 0), step,
                             (jnp.int32(0), jnp.float32(0.0), jnp.int32(-1)))[2]
        return jnp.where(tok < 0, arg, tok)  # only a NaN row finds nothing

    token = lax.cond(greedy, lambda: arg, draw)
    tok_ref[r] = token
    lp_ref[r] = raw_ref[r, token] - lse
    if num_logprobs:
        keep = slot < num_logprobs
        plgpu.store(ids_ref.at[r, pl.ds(0, kpow)], jnp.where(want, li, 0), mask=keep)
        plgpu.store(tlp_ref.at[r, pl.ds(0, kpow)], jnp.where(want, lv - lse, 0.0), mask=keep)


@functools.partial(jax.jit, static_argnames=("num_logprobs", "chunk", "num_warps", "interpret"))
def sample_rows(scaled, raw, k, top_p, log_min_p, u, greedy, want, *, num_logprobs: int,
                chunk: int = DEFAULT_CHUNK, num_warps: int = DEFAULT_WARPS,
                interpret: bool = False):
    """scaled, raw [S, V] f32; k [S] i32 (top-k; <= 0 or >= V: off); top_p [S] f32 (1: off);
    log_min_p [S] f32 (-inf: off); u [S] f32 uniforms in [0, 1); greedy [S] bool; want: scalar
    bool (top logprobs wanted). Returns tokens [S] i32, logprob [S] f32, top_ids [S, K] i32 and
    top_logprobs [S, K] f32, K = num_logprobs (module docstring). chunk: a power of 2."""
    s, v = scaled.shape
    if raw.shape != (s, v) or scaled.dtype != jnp.float32 or raw.dtype != jnp.float32:
        raise ValueError(f"sample_rows takes float32 scaled and raw logits of one shape, got "
                         f"{scaled.dtype}{scaled.shape} and {raw.dtype}{raw.shape}")
    if chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of 2, got {chunk}")
    if not 0 <= num_logprobs <= v:
        raise ValueError(f"num_logprobs must be in [0, V={v}], got {num_logprobs}")
    chunk = min(chunk, max(16, 1 << (v - 1).bit_length()))  # no wider than the row needs
    nl = max(num_logprobs, 1)  # the kernel always has the outputs; K = 0 is sliced off
    flags = (jnp.where(greedy, _GREEDY, 0) | jnp.where(want, _WANT, 0)).astype(jnp.int32)
    k = jnp.where(k <= 0, v, jnp.minimum(k, v)).astype(jnp.int32)  # [S]; V: off
    rows = [k, flags, top_p.astype(jnp.float32),  # [S] each
            log_min_p.astype(jnp.float32), u.astype(jnp.float32)]
    kernel = functools.partial(_sampling_kernel, v=v, chunk=chunk, num_logprobs=num_logprobs)

    def whole(shape):
        return pl.BlockSpec(shape, lambda i: (0,) * len(shape))

    params = None if interpret else plgpu.CompilerParams(num_warps=num_warps)
    tok, lp, ids, tlp = pl.pallas_call(
        kernel,
        grid=(s,),
        in_specs=[whole(a.shape) for a in rows] + [whole((s, v))] * 2,
        out_specs=[whole((s,)), whole((s,)), whole((s, nl)), whole((s, nl))],
        out_shape=[jax.ShapeDtypeStruct((s,), jnp.int32),  # [S]
                   jax.ShapeDtypeStruct((s,), jnp.float32),  # [S]
                   jax.ShapeDtypeStruct((s, nl), jnp.int32),  # [S, K]
                   jax.ShapeDtypeStruct((s, nl), jnp.float32)],  # [S, K]
        compiler_params=params,
        interpret=interpret,
        name="sample_rows",
    )(*rows, scaled, raw)
    return tok, lp, ids[:, :num_logprobs], tlp[:, :num_logprobs]


@functools.partial(jax.jit, static_argnames=("num_logprobs",))
def sample_rows_reference(scaled, raw, k, top_p, log_min_p, u, greedy, want, *,
                          num_logprobs: int):
    """The kernel's contract by full sorts and flat cumulative sums (for tests: O(V log V) per
    row). Same arguments and results as `sample_rows`."""
    v = scaled.shape[-1]
    top = jnp.max(scaled, axis=-1, keepdims=True)  # [S, 1]
    arg = jnp.argmax(scaled, axis=-1).astype(jnp.int32)  # first index of the max
    desc = -jnp.sort(-scaled, axis=-1)  # [S, V]
    kk = jnp.clip(jnp.minimum(k, v), 1, v)[:, None]
    has_k, has_p = (k < v)[:, None], (top_p < 1.0)[:, None]
    k_val = jnp.where(has_k, jnp.take_along_axis(desc, kk - 1, axis=-1), _NEG)  # [S, 1]
    w_sorted = jnp.where(desc >= k_val, jnp.exp(desc - top), 0.0)  # [S, V]
    cum = jnp.cumsum(w_sorted, axis=-1)
    # The mass of {scaled >= desc[i]} is the cumulative weight at desc[i]'s last tie.
    last_tie = jax.vmap(lambda d: jnp.searchsorted(-d, -d, side="right") - 1)(desc)
    mass_ge = jnp.take_along_axis(cum, last_tie, axis=-1)  # [S, V]
    need = top_p[:, None] * cum[:, -1:]
    first = jnp.argmax(mass_ge >= need, axis=-1)[:, None]  # [S, 1]
    p_val = jnp.where(has_p, jnp.take_along_axis(desc, first, axis=-1), _NEG)
    cut = jnp.maximum(jnp.maximum(k_val, p_val), top + log_min_p[:, None])  # [S, 1]
    filtered = ~greedy[:, None] & (has_k | has_p | (log_min_p[:, None] > _NEG))
    cut = jnp.where(filtered, cut, _NEG)
    w = jnp.where(scaled >= cut, jnp.exp(scaled - top), 0.0)  # [S, V]
    flat = jnp.cumsum(w, axis=-1)
    total = flat[:, -1]
    target = jnp.minimum(u * total, jnp.nextafter(total, 0.0))[:, None]
    drawn = jnp.argmax((flat > target) & (w > 0), axis=-1).astype(jnp.int32)
    tokens = jnp.where(greedy, arg, drawn)
    lse = jax.nn.logsumexp(raw, axis=-1)
    logprob = jnp.take_along_axis(raw, tokens[:, None], axis=-1)[:, 0] - lse
    vals, ids = lax.top_k(raw, num_logprobs)  # [S, K]
    want = jnp.asarray(want, bool)
    return (tokens, logprob, jnp.where(want, ids.astype(jnp.int32), 0),
            jnp.where(want, vals - lse[:, None], 0.0))
