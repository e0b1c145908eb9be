"""Multi-host serving: every process runs the same programs; process 0 schedules.

JAX is multi-controller: each host runs this Python program and every jitted step must be
launched by all of them with identical inputs. Only process 0 takes requests and runs the
scheduler; before each model step it broadcasts what the step needs: a fixed-size header (command
and the step's bucketed shape), then the step's input arrays, which the other processes receive
into a template of exactly that shape (`ModelRunner._idle_inputs`) and run. They keep no
scheduler, block manager or request state of their own, so there is nothing to drift out of sync.
"""

from __future__ import annotations

import logging

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxserve.runtime.sampler import SamplingTensors

log = logging.getLogger("jaxserve")

_STOP, _RUN = 0, 1


def initialize(coordinator_address: str, num_processes: int, process_id: int) -> None:
    """`jax.distributed.initialize` before any device is touched (CPU collectives over gloo)."""
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process_id must be in [0, {num_processes}), got {process_id}")
    # Host (CPU) programs have no cross-process collectives unless one is chosen; GPUs use NCCL.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id)
    log.info("process %d of %d: %d local / %d global devices", jax.process_index(),
             jax.process_count(), jax.local_device_count(), jax.device_count())


def is_leader() -> bool:
    return jax.process_index() == 0


def agree(value: int) -> int:
    """Process 0's value on every process (e.g. the KV block count planned from its memory)."""
    return int(multihost_utils.broadcast_one_to_all(np.int64(value)))


def attach(runner) -> StepChannel | None:
    """A multi-process run's channel; on process 0 the runner broadcasts before each step."""
    if jax.process_count() == 1:
        return None
    channel = StepChannel(runner)
    if is_leader():
        runner.before_step = channel.send
    return channel


def _broadcast_like(template):
    out = multihost_utils.broadcast_one_to_all(template)
    # The broadcast is a psum: bools come back as integers. Restore the template's dtypes.
    return jax.tree.map(lambda t, x: np.asarray(x, np.asarray(t).dtype), template, out)


class StepChannel:
    """Process 0 `send`s each step before running it; the others `follow` until `stop`."""

    def __init__(self, runner):
        self.runner = runner

    def send(self, inp, st) -> None:
        rows, tokens = inp.tokens.shape
        meta = inp.meta
        width = meta.ragged.shape[1] if meta.ragged is not None else meta.page_table.shape[1]
        _broadcast_like(np.array([_RUN, rows, tokens, width], np.int32))
        _broadcast_like((inp, st))

    def stop(self) -> None:
        if jax.process_count() > 1:
            _broadcast_like(np.array([_STOP, 0, 0, 0], np.int32))

    def follow(self) -> int:
        """Runs process 0's steps until it stops; returns how many ran."""
        runner, steps = self.runner, 0
        while True:
            cmd, rows, tokens, width = _broadcast_like(np.zeros(4, np.int32)).tolist()
            if cmd == _STOP:
                return steps
            template = (runner._idle_inputs(rows, tokens, width),
                        SamplingTensors.from_params([], [], [], size=rows))
            inp, st = _broadcast_like(template)
            runner.cache, _ = runner._step(runner.model.params, runner.cache, inp, st)
            steps += 1
