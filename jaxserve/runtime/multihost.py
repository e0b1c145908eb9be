"""Multi-host serving: every process runs the same programs; process 0 schedules.

JAX is multi-controller: each host runs this Python program and every jitted step must be
launched by all of them with identical inputs. Only process 0 takes requests and runs the
scheduler; before each device call (`ModelRunner.run`: a model step, or a batch of
copy-on-write block copies) it broadcasts what the call needs: a fixed-size header (command and
the call's bucketed shape), then the call's arrays, which the other processes receive into a
template of exactly that shape (`ModelRunner.step_template` / `slots_template` /
`copy_template`) and pass to the
same `ModelRunner.run`. They keep no scheduler, block manager or request state of their own, so
there is nothing to drift out of sync.
"""

from __future__ import annotations

import logging

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxserve.runtime.step_call import CopyCall, StepCall
from jaxserve.runtime.slot_state import SlotsCall

log = logging.getLogger("jaxserve")

_STOP, _STEP, _COPY, _SLOTS = 0, 1, 2, 3
HEADER = 5  # cmd, the call's shape (one int), and a step's masked, pooled, scored flags


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
    """A multi-process run's channel; on process 0 the runner broadcasts before each call."""
    if jax.process_count() == 1:
        return None
    channel = StepChannel(runner)
    if is_leader():
        runner.before_call = channel.send
    return channel


def _broadcast_like(template):
    out = multihost_utils.broadcast_one_to_all(template)
    # The broadcast is a psum: bools come back as integers. Restore the template's dtypes.
    return jax.tree.map(lambda t, x: np.asarray(x, np.asarray(t).dtype), template, out)


class StepChannel:
    """Process 0 `send`s each device call before running it; the others `follow` until `stop`."""

    def __init__(self, runner):
        self.runner = runner

    def send(self, call: StepCall | SlotsCall | CopyCall) -> None:
        cmd = _COPY if isinstance(call, CopyCall) else _SLOTS if isinstance(call, SlotsCall) \
            else _STEP
        masked = int(getattr(call, "masked", False))  # a step's bitmask variant
        pooled = int(getattr(call, "pools", False))  # a step's embedding variant
        scored = int(getattr(call, "scores_prompt", False))  # its prompt-logprobs variant
        _broadcast_like(np.array([cmd, *call.shape, masked, pooled, scored][:HEADER],
                                 np.int32))
        _broadcast_like(call)

    def stop(self) -> None:
        if jax.process_count() > 1:
            _broadcast_like(np.zeros(HEADER, np.int32))  # _STOP

    def follow(self) -> dict[str, int]:
        """Runs process 0's calls until it stops; returns how many of each kind ran."""
        runner, ran = self.runner, {"steps": 0, "slots": 0, "copies": 0}
        while True:
            cmd, *shape = _broadcast_like(np.zeros(HEADER, np.int32)).tolist()
            if cmd == _STOP:
                return ran
            if cmd == _COPY:
                template, kind = runner.copy_template(), "copies"
                if template.pairs.shape[0] != shape[0]:
                    raise RuntimeError(f"process 0 copies {shape[0]} block pairs per call, this "
                                       f"process {template.pairs.shape[0]}: configs differ")
            elif cmd == _SLOTS:
                template, kind = runner.slots_template(shape[0]), "slots"
            else:
                template, kind = runner.step_template(shape[0], bool(shape[1]),
                                                      pooled=bool(shape[2]),
                                                      scored=bool(shape[3])), "steps"
            runner.run(_broadcast_like(template))
            ran[kind] += 1
