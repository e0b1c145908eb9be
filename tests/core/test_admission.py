"""Admission control and priority: the waiting queue's order and bounds, whom preemption picks
(plain Python scheduler with the fake paged model of test_scheduler.py), and the engine's
refusal beyond max_waiting_requests / max_waiting_tokens (nothing queued)."""

import pytest

from jaxserve import EngineConfig, LLMEngine, SamplingParams
from jaxserve.core.admission import EngineOverloaded
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.sequence import SequenceStatus
from test_scheduler import FakeModel, config, make_seq

from models.random_init import random_model
from jaxserve.testing.tiny_models import TINY_GQA


def _seq(rid, prompt, max_tokens, priority):
    seq = make_seq(rid, prompt, max_tokens)
    seq.priority = priority
    return seq


def _step(sched, model):
    out = sched.schedule()
    sched.update(out, model.step(out))
    sched.block_manager.check_invariants()
    return out


def test_waiting_queue_orders_by_priority_then_arrival():
    sched = Scheduler(config())
    for rid, prio in [("a", 0), ("b", 5), ("c", -1), ("d", 5), ("e", 0), ("f", -1)]:
        sched.add(_seq(rid, [1, 2], 4, prio))
    assert [s.request_id for s in sched.waiting] == ["c", "f", "a", "e", "b", "d"]


def test_preemption_picks_the_highest_priority_value_not_the_newest():
    cfg = config(max_num_seqs=3, block_size=4, num_blocks=1 + 6, max_model_len=24)
    sched, model = Scheduler(cfg), FakeModel(cfg)
    a, b, c = (_seq(r, [1, 2, 3, 4], 10, p) for r, p in [("a", 0), ("b", 5), ("c", 0)])
    for s in (a, b, c):
        sched.add(s)
    for _ in range(5):  # each holds 2 blocks; all 6 in use
        assert not _step(sched, model).preempted
    out = sched.schedule()  # a needs a third block: b (priority 5) goes, not c (newest)
    assert out.preempted == ["b"] and b.status is SequenceStatus.PREEMPTED
    assert [it.request_id for it in out.decodes] == ["a", "c"]
    # Back in the queue ahead of nobody with a lower priority value.
    assert list(sched.waiting) == [b]


def test_sequence_that_preempts_itself_lets_the_next_one_run():
    cfg = config(max_num_seqs=2, block_size=4, num_blocks=1 + 4, max_model_len=16)
    sched, model = Scheduler(cfg), FakeModel(cfg)
    a, b = _seq("a", [1, 2, 3, 4], 10, 9), _seq("b", [5, 6, 7, 8], 10, 0)
    sched.add(a)
    _step(sched, model)
    sched.add(b)  # running order: a, then b
    out = _step(sched, model)
    while not out.preempted:
        out = _step(sched, model)
    # a ran out of blocks first and is its own victim (priority 9): b still runs this step.
    assert out.preempted == ["a"] and [it.request_id for it in out.decodes] == ["b"]


@pytest.fixture(scope="module")
def model():
    return random_model(TINY_GQA, seed=3)


def _engine(model, **kw):
    kw = dict(block_size=4, max_num_seqs=2, max_model_len=64, max_num_batched_tokens=32,
              warmup=False, kv_cache_memory=40 * 4 * TINY_GQA.kv_bytes_per_token(4)) | kw
    return LLMEngine(EngineConfig(model="tiny", **kw), model=model)


def test_engine_refuses_beyond_max_waiting_requests(model):
    engine = _engine(model, max_waiting_requests=2)
    p = SamplingParams(max_tokens=2, temperature=0)
    engine.add_request("a", [1, 2, 3], p)
    engine.add_request("b", [1, 2, 3], p)
    with pytest.raises(EngineOverloaded, match="max_waiting_requests=2") as e:
        engine.add_request("c", [1, 2, 3], p)
    assert e.value.limit == "max_waiting_requests"
    assert "c" not in engine.requests and engine.scheduler.num_waiting == 2
    engine.step()  # both admitted (2 slots): the queue has room again
    engine.add_request("c", [1, 2, 3], p)


def test_engine_refuses_beyond_max_waiting_tokens_and_checks_priority(model):
    engine = _engine(model, max_waiting_tokens=10)
    p = SamplingParams(max_tokens=2, temperature=0)
    engine.add_request("a", list(range(1, 9)), p)  # 8 tokens queued
    with pytest.raises(EngineOverloaded, match="max_waiting_tokens=10"):
        engine.add_request("b", [1, 2, 3], p)
    engine.add_request("b", [1, 2], p)  # 10: at the bound, not over
    with pytest.raises(ValueError, match="priority must be an integer"):
        engine.add_request("c", [1], p, priority="high")
    assert set(engine.requests) == {"a", "b"}


def test_lower_priority_value_runs_first(model):
    engine = _engine(model, max_num_seqs=1)
    p = SamplingParams(max_tokens=2, temperature=0)
    engine.add_request("late", [1, 2, 3], p, priority=5)
    engine.add_request("urgent", [4, 5, 6], p, priority=-1)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["urgent", "late"]


def test_llm_generate_takes_priorities(model):
    from jaxserve import LLM
    llm = LLM(model, block_size=4, max_num_seqs=1, max_model_len=64, max_num_batched_tokens=32,
              warmup=False, kv_cache_memory=40 * 4 * TINY_GQA.kv_bytes_per_token(4))
    p = SamplingParams(max_tokens=2, temperature=0)
    with pytest.raises(ValueError, match="got 1 priorities for 2 prompts"):
        llm.generate([[1, 2], [3, 4]], p, use_tqdm=False, priority=[0])
    outs = llm.generate([[1, 2], [3, 4]], p, use_tqdm=False, priority=[3, -3])
    assert [o.prompt_token_ids for o in outs] == [[1, 2], [3, 4]]  # input order kept
    assert outs[1].metrics.finished_time < outs[0].metrics.finished_time  # -3 ran first
