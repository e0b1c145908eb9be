"""Counts JAX traces and XLA compiles in a block: the steady-state recompile guard."""

import contextlib
import threading

import jax

_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/backend_compile_duration")


@contextlib.contextmanager
def count_compiles():
    """Yields a list that collects one entry per trace or backend compile inside the block, on
    the thread that runs it (the engine's steps). Work an engine hands to a thread of its own
    (the structured-output step variants compiled after warm-up) is not the step path; the
    engine counts those compiles as warm-up (`num_compiles_after_warmup`)."""
    events, me = [], threading.get_ident()

    def listener(event, duration, **kwargs):
        if event in _EVENTS and threading.get_ident() == me:
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
