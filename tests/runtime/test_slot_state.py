"""jaxserve/runtime/slot_state.py's in-bounds write (the step's history and last-token
updates): a one-token step's dynamic update slice and the scatter of larger steps both equal
jax's `.at[].set`; the one-token form is what a GPU step compiles (docs/gpu_step_report.md)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runtime.slot_state import set_in_bounds


@pytest.mark.parametrize("n", [1, 3])
def test_set_in_bounds_equals_at_set(n):
    history = jnp.arange(5 * 7, dtype=jnp.int32).reshape(5, 7)  # [S + 1, L]
    slots = jnp.asarray([3, 0, 4][:n], jnp.int32)
    positions = jnp.asarray([6, 2, 0][:n], jnp.int32)
    tokens = jnp.asarray([100, 101, 102][:n], jnp.int32)
    got = set_in_bounds(history, (slots, positions), tokens)
    np.testing.assert_array_equal(got, history.at[slots, positions].set(tokens))
    assert int(got[3, 6]) == 100 and int((got != history).sum()) == n
    last = jnp.zeros((5,), jnp.int32)  # [S + 1]
    got = set_in_bounds(last, (slots,), tokens)
    np.testing.assert_array_equal(got, last.at[slots].set(tokens))
    assert int(got[3]) == 100
