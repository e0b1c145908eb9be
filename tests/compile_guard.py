"""Counts JAX traces and XLA compiles in a block: the steady-state recompile guard."""

import contextlib

import jax

_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/backend_compile_duration")


@contextlib.contextmanager
def count_compiles():
    """Yields a list that collects one entry per trace or backend compile inside the block."""
    events = []

    def listener(event, duration, **kwargs):
        if event in _EVENTS:
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
