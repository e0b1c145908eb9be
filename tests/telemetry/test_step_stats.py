"""tools/step_stats.timed_steps: the step loop the step-timing scripts share."""

from jaxserve.telemetry.step_stats import timed_steps


class FakeEngine:
    """Three step() calls; the first records nothing (as a first async call that only
    launches), the next two record "a" then "b"."""

    def __init__(self):
        self.calls, self.last_step = 0, None

    def has_unfinished_requests(self):
        return self.calls < 3

    def step(self):
        self.calls += 1
        self.last_step = {1: None, 2: "a", 3: "b"}[self.calls]


def test_timed_steps_yields_each_recorded_step_with_its_wall_time():
    engine = FakeEngine()
    got = list(timed_steps(engine))
    assert [s for _, s in got] == ["a", "b"]
    assert all(wall >= 0 for wall, _ in got)
    assert engine.calls == 3  # stepped until nothing was unfinished
