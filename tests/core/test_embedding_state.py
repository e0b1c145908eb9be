"""Embedding requests on the host, without an engine: the pool over a prompt's chunks
(core/embedding_state.py) and what the scheduler does for a prompt-only sequence."""

import numpy as np
import pytest

from jaxserve.core.embedding_state import EmbeddingState, embedding_sequence
from jaxserve.core.outputs import SampleResult
from jaxserve.core.pooling import PoolingParams
from jaxserve.core.sampling_params import SamplingParamError
from jaxserve.core.scheduler import ScheduledSeq, Scheduler, SchedulerConfig
from jaxserve.core.sequence import SequenceStatus

D = 4
rng = np.random.default_rng(0)
HIDDEN = rng.standard_normal((10, D)).astype(np.float32)  # a 10-token prompt's final states


def state_of(pooling, n=10, params=PoolingParams()):
    seq = embedding_sequence("r", list(range(1, n + 1)), pooling, arrival_time=0.0)
    return EmbeddingState(seq, None, pooling, params, 0.0), seq


def chunk(state, seq, start, n, pooling):
    """The runner's part for one chunk: its tokens' sum (mean) or the last token (last)."""
    item = ScheduledSeq(seq, n, start, True, start + n == len(seq.prompt_token_ids))
    if pooling == "mean":
        state.on_pooled(item, HIDDEN[start:start + n].sum(axis=0))
    elif item.is_last_chunk:
        state.on_pooled(item, HIDDEN[start + n - 1])
    return item


def finish(state, item):
    return state.on_sampled(item, SampleResult(7, -1.0, None), lambda r: r + "#")


def unit(v):
    return v / np.linalg.norm(v)


def test_mean_over_chunks():
    state, seq = state_of("mean")
    for start, n in [(0, 4), (4, 4)]:
        chunk(state, seq, start, n, "mean")
    assert not state.finished
    d = finish(state, chunk(state, seq, 8, 2, "mean"))
    assert d.tokens == {"r": 7} and d.finished == {"r": SequenceStatus.FINISHED_STOPPED}
    out = state.output()
    assert out.finished and out.error is None and out.prompt_token_ids == list(range(1, 11))
    np.testing.assert_allclose(out.outputs.embedding, unit(HIDDEN.mean(axis=0)), atol=1e-6)


def test_a_recompute_replaces_the_chunks_it_runs_again():
    """Preempted after two chunks, the sequence restarts at 0 with other chunk sizes: the sum
    is over the second run only (the first run's chunks would count positions twice)."""
    state, seq = state_of("mean")
    chunk(state, seq, 0, 4, "mean")
    chunk(state, seq, 4, 4, "mean")
    chunk(state, seq, 0, 6, "mean")  # the recompute
    item = chunk(state, seq, 6, 4, "mean")
    finish(state, item)
    np.testing.assert_allclose(state.output().outputs.embedding, unit(HIDDEN.mean(axis=0)),
                               atol=1e-6)


def test_chunks_that_do_not_cover_the_prompt_fail_the_request():
    state, seq = state_of("mean")
    chunk(state, seq, 0, 4, "mean")
    d = finish(state, chunk(state, seq, 6, 4, "mean"))  # positions 4 and 5 never pooled
    assert d.finished == {"r": SequenceStatus.FINISHED_ERROR}
    out = state.output()
    assert out.finished and out.outputs is None and "do not cover" in out.error


def test_last_token_and_unnormalised():
    state, seq = state_of("last", params=PoolingParams(normalize=False))
    chunk(state, seq, 0, 8, "last")  # a chunk before the last pools nothing
    finish(state, chunk(state, seq, 8, 2, "last"))
    np.testing.assert_allclose(state.output().outputs.embedding, HIDDEN[-1], atol=0)


def test_non_finite_hidden_states_fail_the_request():
    state, seq = state_of("last", n=2)
    item = ScheduledSeq(seq, 2, 0, True, True)
    state.on_pooled(item, np.array([1.0, np.nan, 0.0, 0.0], np.float32))
    assert finish(state, item).finished == {"r": SequenceStatus.FINISHED_ERROR}
    assert "non-finite" in state.output().error


def test_pooling_params():
    PoolingParams(dimensions=8).check(8)
    with pytest.raises(SamplingParamError, match="matryoshka") as e:
        PoolingParams(dimensions=4).check(8)
    assert e.value.param == "dimensions"
    for bad in (0, -1, 2.5, True):
        with pytest.raises(SamplingParamError):
            PoolingParams(dimensions=bad)


def scheduler(caching=True):
    return Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=16,
                                     block_size=4, num_blocks=20,
                                     enable_prefix_caching=caching))


def test_a_prompt_only_sequence_may_fill_max_model_len():
    s = scheduler()
    s.add(embedding_sequence("e", list(range(16)), "last", arrival_time=0.0))  # 16 = the limit
    with pytest.raises(ValueError, match=r"exceeds max_model_len \(16\)"):
        s.check(embedding_sequence("f", list(range(17)), "last", arrival_time=0.0))
    out = s.schedule()
    (item,) = out.scheduled
    assert item.num_new_tokens == 16 and item.is_last_chunk
    s.commit(out)  # the step's sample is its one "output" and it is not scheduled again
    assert s.schedule().is_empty
    (done,) = s.update(out, {"e": 7}, {"e": SequenceStatus.FINISHED_STOPPED}, committed=True)
    assert done.status is SequenceStatus.FINISHED_STOPPED and not s.has_unfinished()


@pytest.mark.parametrize("pooling,hit", [("last", 8), ("mean", 0)])
def test_mean_pooling_reads_nothing_from_the_prefix_cache(pooling, hit):
    s = scheduler()
    prompt = list(range(1, 11))
    first = embedding_sequence("a", prompt, pooling, arrival_time=0.0)
    s.add(first)
    out = s.schedule()
    s.update(out, {"a": 0}, {"a": SequenceStatus.FINISHED_STOPPED})  # its blocks stay cached
    queries = s.block_manager.num_query_tokens
    s.add(embedding_sequence("b", prompt, pooling, arrival_time=0.0))
    (item,) = s.schedule().scheduled
    assert item.start_pos == hit and item.num_new_tokens == len(prompt) - hit
    assert s.block_manager.num_hit_tokens == hit
    assert s.block_manager.num_query_tokens - queries == (len(prompt) if hit else 0)
