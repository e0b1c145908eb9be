"""The GPU step's sampler: jaxserve/runtime/sampler.py's branch-free sampler with its filters,
draw, argmax and top logprobs in one Pallas kernel (pallas_kernels/sampling.py).

XLA keeps what fuses into one pass over the logits (the token bitmask, penalties, min_tokens
bans and the division by the temperature) and the per-slot uniforms; the kernel does the rest,
one row per program, so the step has no bisection unrolled into ~200 XLA kernels and no
top-k sort. The kernel computes the exact cutoffs the XLA sampler's candidates and bisections
compute, and draws in vocabulary order from the same uniform, so a slot gets the token the
CPU's sampler gives it (up to float rounding at a top-p or draw boundary: the kernel sums in
chunks), and it still depends only on the slot's row, seed and position.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.core.sampling_params import MAX_LOGPROBS
from jaxserve.runtime import sampler as xla_sampler
from pallas_kernels.sampling import sample_rows

# StepProgram.sampler_backend values that run the kernel: "pallas-interpret" runs it through
# the Pallas interpreter (the GPU step's sampler on CPU, for tests).
KERNEL_BACKENDS = ("pallas", "pallas-interpret")


def sample(logits: jax.Array, st: xla_sampler.SamplingTensors, history: jax.Array,
           context_lens: jax.Array, prompt_lens: jax.Array, positions: jax.Array,
           want_logprobs: jax.Array | bool = True, *, max_logprobs: int = MAX_LOGPROBS,
           mask: jax.Array | None = None, interpret: bool = False) -> xla_sampler.SamplerOutput:
    """sampler.sample's arguments and result (logits [S, V], history [S, L], the rest [S];
    mask [S, ceil(V / 32)] or None), always branch-free. max_logprobs and interpret are
    static."""
    raw = logits.astype(jnp.float32)  # [S, V]; logprobs are of these
    x = xla_sampler.apply_token_bitmask(raw, mask)
    x = xla_sampler.apply_penalties(x, st, history, context_lens, prompt_lens)
    x = xla_sampler.ban_stop_ids(x, st)  # [S, V]
    v = x.shape[-1]
    greedy = st.temperature < xla_sampler.GREEDY_EPS  # [S]
    # Greedy rows divide by 1 (exact), so the kernel's argmax of `scaled` is theirs of x.
    scaled = x / jnp.where(greedy, 1.0, st.temperature)[:, None]  # [S, V]
    u = jax.vmap(xla_sampler.uniform)(st.seed, positions)  # [S]
    tokens, logprob, top_ids, top_lps = sample_rows(
        scaled, raw, st.top_k, st.top_p, jnp.log(st.min_p), u, greedy, want_logprobs,
        num_logprobs=min(max_logprobs, v), interpret=interpret)
    return xla_sampler.SamplerOutput(tokens=tokens, logprob=logprob, top_ids=top_ids,
                                     top_logprobs=top_lps)
