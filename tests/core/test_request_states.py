"""The request-state contract (jaxserve/core/decision.py) without an engine: a state answers a
step's results with a Decision and leaves the scheduler's sequences as they are."""

import itertools

from jaxserve.core.beam_search import BeamRequestState, search_params
from jaxserve.core.decision import Decision, Fork
from jaxserve.core.outputs import SampleResult
from jaxserve.core.request_state import RequestState
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.scheduler import ScheduledSeq
from jaxserve.core.sequence import PLACEHOLDER, Sequence, SequenceStatus


def ids():
    counter = itertools.count(1)
    return lambda request_id: f"{request_id}#{next(counter)}"


def snapshot(seq):
    return (list(seq.output_token_ids), seq.num_computed_tokens, seq.num_reserved_slots,
            seq.status, list(seq.block_table))


def test_branches_fork_once_the_prompt_ran():
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=4, ignore_eos=True)
    seq = Sequence("r", [1, 2, 3, 4, 5], params)
    state = RequestState(seq, None, None, 1, 0.0, set())
    assert state.num_slots == 3
    before = snapshot(seq)
    d = state.on_sampled(ScheduledSeq(seq, 5, 0, True, True), SampleResult(9, -0.5, None), ids())
    assert snapshot(seq) == before
    assert d.tokens == {"r": 9} and not d.finished and not d.hold
    assert [(f.parent, f.child.request_id, f.num_computed_tokens) for f in d.forks] == [
        (seq, "r#1", 4), (seq, "r#2", 4)]  # each child recomputes the last prompt token
    assert all(f.child.prompt_token_ids == seq.prompt_token_ids for f in d.forks)
    assert not d.reserve and not d.append and not d.free
    assert state.on_updated([], ids()) == Decision()


def test_stop_token_finishes_a_branch():
    params = SamplingParams(temperature=0, max_tokens=4, stop_token_ids=(9,))
    seq = Sequence("r", [1, 2], params)
    state = RequestState(seq, None, None, 0, 0.0, set())
    d = state.on_sampled(ScheduledSeq(seq, 2, 0, True, True), SampleResult(9, -0.1, None), ids())
    assert d.tokens == {"r": 9} and d.finished == {"r": SequenceStatus.FINISHED_STOPPED}


def test_min_tokens_counts_a_committed_placeholder_once():
    """Asynchronous scheduling: a committed step's PLACEHOLDER is still on the sequence when its
    id arrives (Scheduler.update writes the id over it), so it stands for the token being
    counted; min_tokens gates a stop token at the same output count either way."""
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=3, stop_token_ids=(9,))
    for committed in (False, True):
        seq = Sequence("r", [1, 2], params)
        state = RequestState(seq, None, None, 0, 0.0, set())
        finished = []
        for pos in range(4):  # outputs 1..4, every one the stop token
            if committed:
                seq.output_token_ids.append(PLACEHOLDER)  # what Scheduler.commit appended
            d = state.on_sampled(ScheduledSeq(seq, 1, 2 + pos, False, True),
                                 SampleResult(9, -0.1, None), ids())
            finished.append(bool(d.finished))
            if committed:
                seq.output_token_ids[-1] = 9  # Scheduler.update(committed=True)
            else:
                seq.output_token_ids.append(9)
        assert finished == [False, False, True, True], committed  # the 3rd token may stop


def test_beam_group_returns_forks_appends_and_frees_without_touching_sequences():
    params = SamplingParams(use_beam_search=True, beam_width=2, n=2, max_tokens=4,
                            ignore_eos=True)
    seq = Sequence("r", [1, 2, 3], search_params(params))
    state = BeamRequestState(seq, None, None, params, 0.0, set())
    assert state.num_slots == 2
    top = {5: -0.1, 6: -0.5, 7: -2.0, 8: -3.0}
    d = state.on_sampled(ScheduledSeq(seq, 3, 0, True, True), SampleResult(5, -0.1, top), ids())
    assert d == Decision(hold={"r"})  # held: no token until the group has its candidates
    seq.num_computed_tokens = 3  # what Scheduler.update does for the held beam
    before = snapshot(seq)
    d = state.on_updated([], ids())
    assert snapshot(seq) == before
    assert d.reserve == [(seq, 2)] and d.append == [(seq, 5)] and not d.free
    [fork] = d.forks
    assert fork == Fork(parent=seq, child=fork.child, num_computed_tokens=3)
    assert fork.child.request_id == "r#1" and fork.child.output_token_ids == [6]
    # Next round: the child's candidates beat the parent's, so the parent is freed.
    child = fork.child
    seq.append_token(5)
    for beam, cands in ((seq, {7: -9.0, 8: -9.5}), (child, {7: -0.1, 8: -0.2})):
        state.on_sampled(ScheduledSeq(beam, 1, 3, False, True),
                         SampleResult(7, cands[7], cands), ids())
    d = state.on_updated([], ids())
    assert d.free == [(seq, SequenceStatus.FINISHED_ABORTED)]
    assert d.reserve == [(child, 2)] and d.append == [(child, 7)]
    assert [f.child.output_token_ids for f in d.forks] == [[6, 8]]
    assert seq.status is not SequenceStatus.FINISHED_ABORTED  # the engine applies it


def test_merge_keeps_order_and_unions():
    a, b = Sequence("a", [1], None), Sequence("b", [1], None)
    d = Decision(tokens={"a": 1}, hold={"x"}, append=[(a, 1)])
    d.merge(Decision(tokens={"b": 2}, hold={"y"}, append=[(b, 2)]))
    assert d.tokens == {"a": 1, "b": 2} and d.hold == {"x", "y"}
    assert d.append == [(a, 1), (b, 2)]


def test_on_sampled_adds_into_the_step_decision():
    """The engine gathers one Decision per step (`into=`) instead of merging one per sequence:
    the gathered one is what merging the separate answers gives."""
    params = SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=4, stop_token_ids=(9,))
    beam_params = SamplingParams(use_beam_search=True, beam_width=2, n=2, max_tokens=4)

    def answers(into):
        a, b = Sequence("a", [1, 2], params), Sequence("b", [3], search_params(beam_params))
        states = [(RequestState(a, None, None, 1, 0.0, set()), a, SampleResult(9, -0.1, None)),
                  (BeamRequestState(b, None, None, beam_params, 0.0, set()), b,
                   SampleResult(5, -0.1, {5: -0.1, 6: -0.2}))]
        out = []
        for state, seq, result in states:
            item = ScheduledSeq(seq, seq.num_tokens, 0, seq.num_tokens > 1, True)
            d = state.on_sampled(item, result, ids(), into=into)
            assert into is None or d is into
            out.append(d)
        return out

    merged = Decision()
    for d in answers(None):
        merged.merge(d)
    into = Decision()
    answers(into)
    assert into.tokens == merged.tokens == {"a": 9}
    assert into.finished == merged.finished == {"a": SequenceStatus.FINISHED_STOPPED}
    assert into.hold == merged.hold == {"b"}
    assert [f.child.request_id for f in into.forks] == [f.child.request_id for f in merged.forks]
    assert len(into.forks) == 1 and not into.reserve and not into.append and not into.free
