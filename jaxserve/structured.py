"""Structured output in the engine loop: grammars compile off the engine thread, constrained
requests wait outside the scheduler (holding no slot or block) until theirs is ready and the
masked step programs are compiled, and each step's constrained sampling rows get their grammar
states (the runner writes the bitmasks). The engine calls `submit`, `admit`, `rows` and
`forget`; nothing else of it knows about grammars.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
from collections.abc import Callable
from typing import NamedTuple

from jaxserve.core.grammar import GrammarCompiler
from jaxserve.core.request_state import RequestState
from jaxserve.core.request_table import RequestTable
from jaxserve.core.scheduler import SchedulerOutput
from jaxserve.core.sequence import Sequence
from jaxserve.core.step_plan import GrammarRows
from jaxserve.core.structured_outputs import StructuredOutputs

log = logging.getLogger("jaxserve")


class Waiting(NamedTuple):
    """A constrained request whose grammar is compiling."""

    state: RequestState
    seq: Sequence
    grammar: concurrent.futures.Future


class Admission(NamedTuple):
    """What `admit` found: requests whose grammar is ready (to schedule) and those whose
    grammar failed to compile, with the compiler's message."""

    ready: list[Waiting]
    failed: list[tuple[Waiting, str]]


class StructuredRequests:
    def __init__(self, compiler: GrammarCompiler):
        self.compiler = compiler
        self._compiling: dict[str, Waiting] = {}
        self._admitted: set[str] = set()  # admitted, unfinished, constrained
        # The masked step variants compile after warm-up, off the engine thread: constrained
        # requests wait for them as for their grammar, everything else is served.
        self._masked_ready: concurrent.futures.Future | None = None

    @property
    def num_compiling(self) -> int:
        return len(self._compiling)

    @property
    def active(self) -> bool:
        """Whether an admitted constrained request is unfinished (steps may be masked)."""
        return bool(self._admitted)

    def compile_masked_programs(self, job: Callable[[], float]) -> None:
        """Runs the runner's masked warm-up `job` on a thread of its own; constrained
        requests are admitted once it returns."""
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxserve-masked")
        try:
            self._masked_ready = pool.submit(_low_priority, job)
        finally:
            pool.shutdown(wait=False)  # the thread ends with the job

    def submit(self, state: RequestState, seq: Sequence, spec: StructuredOutputs) -> None:
        """Starts compiling a request's grammar; it waits here until `admit` finds it ready."""
        self._compiling[state.request_id] = Waiting(state, seq, self.compiler.submit(spec))

    def admit(self, idle: bool) -> Admission:
        """The waiting requests whose grammar is ready (started on it: schedule them) or failed.
        idle: the engine has nothing else to do, so wait a little instead of spinning."""
        if not self._compiling or not self._masked_programs_ready(wait=idle):
            return Admission([], [])
        if idle:
            concurrent.futures.wait([w.grammar for w in self._compiling.values()], timeout=0.05,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        ready, failed = [], []
        for rid, waiting in list(self._compiling.items()):
            future = waiting.grammar
            if not future.done():
                continue
            del self._compiling[rid]
            if future.exception() is not None:
                failed.append((waiting, str(future.exception())))
                continue
            waiting.state.start_grammar(future.result())
            self._admitted.add(rid)
            ready.append(waiting)
        return Admission(ready, failed)

    def forget(self, request_id: str) -> None:
        """The request ended (or was aborted while its grammar compiled)."""
        self._compiling.pop(request_id, None)
        self._admitted.discard(request_id)

    def rows(self, out: SchedulerOutput, requests: RequestTable) -> GrammarRows | None:
        """The step's constrained rows that sample, for the plan (None when there are none)."""
        if not self._admitted:
            return None
        owner, found = requests.owner, {}
        for item in out.scheduled:
            state = owner[item.seq.request_id]
            if state.constrained and item.is_last_chunk:
                found[item.request_id] = state.matcher_of(item.request_id)
        return GrammarRows(found, self.compiler.fill) if found else None

    def wait_until_warm(self, timeout: float | None = None) -> bool:
        """Waits for the masked step programs; returns whether they are ready."""
        if self._masked_ready is not None:
            concurrent.futures.wait([self._masked_ready], timeout=timeout)
        return self._masked_programs_ready(wait=False)

    def _masked_programs_ready(self, wait: bool) -> bool:
        future = self._masked_ready
        if future is None:
            return True
        if not future.done():
            if wait:
                concurrent.futures.wait([future], timeout=0.05)
            if not future.done():
                return False
        self._masked_ready = None
        if future.exception() is not None:  # they will compile when first needed instead
            log.warning("compiling the structured-output step variants failed (%s); they "
                        "compile when first needed", future.exception())
        else:
            log.info("structured-output step variants compiled in %.1fs", future.result())
        return True


# Niceness of the background compile thread (Linux: per thread, inherited by threads it starts).
BACKGROUND_NICENESS = 19


def _low_priority(job: Callable[[], float]) -> float:
    """Runs `job` with this thread's CPU priority lowered: the compile then takes the CPUs the
    engine's steps leave. With it at equal priority, SmolLM2's batch-1 decode on 2 CPUs took
    16-25 ms per token until the compile ended, 10-13 ms with it lowered (7.5 ms after)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICENESS)
    except (AttributeError, OSError):  # not Linux, or not allowed: run at the usual priority
        pass
    return job()
