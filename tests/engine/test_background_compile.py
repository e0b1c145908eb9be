"""The structured-output variants compile on a background thread at the lowest CPU priority
(jaxserve/structured.py), so that the engine's steps keep the CPUs while it runs."""

import os
import sys
import threading

import pytest

from jaxserve.structured import BACKGROUND_NICENESS, StructuredRequests


def niceness() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness: Linux")
def test_the_masked_compile_job_runs_at_background_priority():
    seen = []

    def job() -> float:  # records the niceness its own thread runs at
        seen.append(niceness())
        return 0.0

    mine = niceness()
    requests = StructuredRequests(compiler=None)  # the compiler serves requests, not this
    requests.compile_masked_programs(job)
    assert requests.wait_until_warm(timeout=30)
    # Niceness only goes up for an unprivileged thread; the caller's own is left as it was.
    assert seen == [max(mine, BACKGROUND_NICENESS)] and mine < BACKGROUND_NICENESS
    assert niceness() == mine
