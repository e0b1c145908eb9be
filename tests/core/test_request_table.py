"""The engine's request table (jaxserve/core/request_table.py) and the questions request states
answer for the step loop (waits_for_ids, speculates), without an engine."""

import itertools

from jaxserve.core.beam_search import BeamRequestState, search_params
from jaxserve.core.outputs import SampleResult
from jaxserve.core.request_state import RequestState
from jaxserve.core.request_table import RequestTable
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.scheduler import ScheduledSeq
from jaxserve.core.sequence import Sequence
from jaxserve.core.structured_outputs import StructuredOutputs

PROMPT = [1, 2, 3, 4]


def state(rid: str, **params) -> RequestState:
    p = SamplingParams(max_tokens=4, ignore_eos=True, **params)
    return RequestState(Sequence(rid, PROMPT, p), None, None, 1, 0.0, set())


def beams(rid: str) -> BeamRequestState:
    p = SamplingParams(use_beam_search=True, beam_width=2, max_tokens=4, ignore_eos=True)
    return BeamRequestState(Sequence(rid, PROMPT, search_params(p)), None, None, p, 0.0, set())


def row(rid: str) -> ScheduledSeq:
    return ScheduledSeq(Sequence(rid, PROMPT, SamplingParams()), 1, 3, False, True)


def test_requests_and_their_sequences():
    table, a = RequestTable(), state("a", n=2, temperature=1.0, seed=3)
    table.add(a)
    assert "a" in table and len(table) == 1 and list(table) == ["a"]
    table.add_sequence("a#1", of="a")
    assert table.owner["a#1"] is a and table.sequences_of(a) == ["a", "a#1"]
    assert table.in_use("a#1") and table.in_use("a") and not table.in_use("b")
    assert table.forget("a") is a and "a" not in table
    assert table.in_use("a#1")  # sequences leave as the engine ends them, not with forget
    table.drop_sequence("a")
    table.drop_sequence("a#1")
    assert not table.in_use("a") and not table.owner and table.forget("a") is None


def test_only_requests_that_wait_for_ids_are_kept_and_they_leave_once_forked():
    table = RequestTable()
    plain, forking, beam = state("plain"), state("n2", n=2, temperature=1.0, seed=3), beams("bm")
    for s in (plain, forking, beam):
        table.add(s)
    assert table.waiting_for_ids() == {"n2", "bm"}
    assert not table.waits_for_ids([row("plain")])
    assert table.waits_for_ids([row("plain"), row("n2")]) and table.waits_for_ids([row("bm")])
    # The prompt ran: branch 1 forks, and the request no longer waits for ids.
    forking.on_sampled(ScheduledSeq(forking.seq, 4, 0, True, True), SampleResult(9, -0.1, None),
                       lambda rid, c=itertools.count(1): f"{rid}#{next(c)}")
    assert not forking.waits_for_ids and forking.speculates
    assert table.may_wait_for_ids() and table.waiting_for_ids() == {"bm"}
    table.forget("bm")
    assert not table.may_wait_for_ids() and table.waiting_for_ids() == set()


def test_states_answer_the_loops_questions():
    plain, forking = state("p"), state("n2", n=2, temperature=1.0, seed=3)
    constrained = state("c", structured_outputs=StructuredOutputs(regex="[ab]+"))
    beam = beams("b")
    assert (plain.waits_for_ids, plain.speculates, plain.acts_on_every_update) == (
        False, True, False)
    assert (forking.waits_for_ids, forking.speculates) == (True, False)
    assert (constrained.waits_for_ids, constrained.speculates, constrained.constrained) == (
        True, False, True)
    assert (beam.waits_for_ids, beam.speculates, beam.constrained,
            beam.acts_on_every_update) == (True, False, False, True)
    assert plain.matcher_of("p") is None and beam.matcher_of("b") is None
