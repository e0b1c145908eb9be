"""Scheduler: continuous batching, chunked prefill, preemption, abort, limits.

A fake model keeps a paged "KV cache" of token ids: each step it writes the
scheduled tokens into the slots their block tables map them to, then for each
sampling sequence reads its whole context back through the block table and
samples `next_token(context)`. Wrong block mapping, shared or prematurely
reused blocks, lost tokens or a wrong chunk all show up as a bad context read
or as outputs different from `expected_output`, which is derived from the
prompt alone, without the scheduler.
"""

import math
import random
from types import SimpleNamespace

import pytest

from jaxserve.core.block_manager import blocks_for_tokens
from kv_slots import slot_for_position
from jaxserve.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from jaxserve.core.sequence import Sequence, SequenceStatus

STOPPED = SequenceStatus.FINISHED_STOPPED
LENGTH = SequenceStatus.FINISHED_LENGTH


def next_token(context):
    acc = len(context)
    for i, t in enumerate(context):
        acc = (acc * 31 + t * (i + 1)) % 1_000_003
    return 3 + acc % 997


def is_stop(token):
    return token % 37 == 0


def expected_output(prompt, max_tokens, use_stop):
    tokens, out = list(prompt), []
    while len(out) < max_tokens:
        t = next_token(tokens)
        out.append(t)
        tokens.append(t)
        if use_stop and is_stop(t):
            break
    return out


def make_seq(rid, prompt, max_tokens):
    return Sequence(rid, list(prompt), SimpleNamespace(max_tokens=max_tokens))


def config(**kw):
    base = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                block_size=4, num_blocks=1 + 64)
    base.update(kw)
    return SchedulerConfig(**base)


class FakeModel:
    def __init__(self, cfg):
        self.bs = cfg.block_size
        self.cache = [None] * (cfg.num_blocks * cfg.block_size)

    def step(self, out):
        bs = self.bs
        for src, dst in out.blocks_to_copy:
            self.cache[dst * bs:(dst + 1) * bs] = self.cache[src * bs:(src + 1) * bs]
        for item in out.scheduled:
            table, rid = item.seq.block_table, item.request_id
            for pos, tok in zip(item.positions, item.token_ids, strict=True):
                assert table[pos // bs] != 0, "wrote into the null block"
                self.cache[slot_for_position(table, pos, bs)] = (rid, pos, tok)
        sampled = {}
        for item in out.scheduled:
            if item.is_last_chunk:
                end = item.start_pos + item.num_new_tokens
                context = []
                for pos in range(end):
                    entry = self.cache[slot_for_position(item.seq.block_table, pos, bs)]
                    assert entry is not None and entry[:2] == (item.request_id, pos), (
                        f"{item.request_id} pos {pos}: cache holds {entry}")
                    context.append(entry[2])
                assert context == item.seq.all_token_ids[:end]
                sampled[item.request_id] = next_token(context)
        return sampled


def num_batched_tokens(out):
    return sum(item.num_new_tokens for item in out.scheduled)


def check_step(sched, out, waiting_before, running_before):
    cfg, bm = sched.config, sched.block_manager
    items = out.scheduled
    assert len(sched.running) <= cfg.max_num_seqs
    assert len(items) <= cfg.max_num_seqs
    assert num_batched_tokens(out) <= cfg.max_num_batched_tokens
    rids = [it.request_id for it in items]
    assert len(rids) == len(set(rids))
    for it in items:
        seq = it.seq
        assert seq.status is SequenceStatus.RUNNING and seq in sched.running
        assert it.num_new_tokens >= 1
        assert it.start_pos == seq.num_computed_tokens
        assert it.start_pos + it.num_new_tokens <= seq.num_tokens
        assert it.is_last_chunk == (it.start_pos + it.num_new_tokens == seq.num_tokens)
        assert it.is_prefill_chunk == (seq.num_uncomputed_tokens > 1)
        assert len(seq.block_table) >= blocks_for_tokens(it.start_pos + it.num_new_tokens,
                                                         cfg.block_size)
        if not cfg.enable_chunked_prefill:
            assert it.is_last_chunk
    for it in out.decodes:
        assert it.num_new_tokens == 1 and not it.is_prefill_chunk and it.is_last_chunk
    for it in out.prefills:
        assert it.is_prefill_chunk
    # Decodes are never starved: every running decode-state sequence got its token.
    decode_ids = {it.request_id for it in out.decodes}
    for seq in sched.running:
        if not seq.is_prefill:
            assert seq.request_id in decode_ids
    for rid in out.preempted:
        seq = next(s for s in sched.waiting if s.request_id == rid)
        assert seq.status is SequenceStatus.PREEMPTED
        assert seq.block_table == [] and seq.num_computed_tokens == 0
        assert rid in running_before
    # FCFS: the admitted sequences are a prefix of the waiting queue.
    admitted = [s.request_id for s in sched.running if s.request_id not in running_before]
    assert admitted == waiting_before[:len(admitted)]
    if out.preempted:
        assert not admitted
    # Work conserving: if someone still waits, something really blocked them.
    if sched.waiting and not out.preempted:
        head, left = sched.waiting[0], cfg.max_num_batched_tokens - num_batched_tokens(out)
        n = min(head.num_uncomputed_tokens, left)
        blocked = (len(sched.running) == cfg.max_num_seqs or left == 0
                   or (not cfg.enable_chunked_prefill and head.num_uncomputed_tokens > left)
                   or not bm.can_allocate(head, n))
        assert blocked, "a free slot was not refilled"
    bm.check_invariants()


def simulate(cfg, requests, use_stop=True, max_steps=20_000, on_step=None):
    """requests: (arrival_step, rid, prompt, max_tokens). Returns rid -> (output, status).

    `on_step(step, sched, out)` runs after each schedule(), before update().
    """
    sched, model = Scheduler(cfg), FakeModel(cfg)
    pending = sorted(requests, key=lambda r: r[0])
    seqs, step = {}, 0
    while pending or sched.has_unfinished():
        while pending and pending[0][0] <= step:
            _, rid, prompt, max_tokens = pending.pop(0)
            seqs[rid] = make_seq(rid, prompt, max_tokens)
            sched.add(seqs[rid])
        waiting_before = [s.request_id for s in sched.waiting]
        running_before = {s.request_id for s in sched.running}
        out = sched.schedule()
        check_step(sched, out, waiting_before, running_before)
        if on_step:
            on_step(step, sched, out)
        if sched.has_unfinished():
            assert not out.is_empty, "scheduler stalled"
        sampled = model.step(out)
        finished = {rid: STOPPED for rid, t in sampled.items() if use_stop and is_stop(t)}
        sched.update(out, sampled, finished)
        sched.block_manager.check_invariants()
        # Only the newest running sequence may be mid-prefill (decodes rely on it).
        assert all(not s.is_prefill for s in sched.running[:-1])
        step += 1
        assert step < max_steps, "no progress"
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks == cfg.num_blocks - 1
    assert sched.num_running == sched.num_waiting == 0
    return {rid: (s.output_token_ids, s.status) for rid, s in seqs.items()}, sched


def expected_results(requests, use_stop=True):
    res = {}
    for _, rid, prompt, max_tokens in requests:
        out = expected_output(prompt, max_tokens, use_stop)
        res[rid] = (out, STOPPED if use_stop and is_stop(out[-1]) else LENGTH)
    return res


def prompt_of(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


# ---- continuous batching ---------------------------------------------------

def test_finished_slot_refilled_next_step():
    cfg = config(max_num_seqs=2, max_num_batched_tokens=64)
    sched = Scheduler(cfg)
    a, b, c = make_seq("a", [5, 6], 2), make_seq("b", [7, 8], 10), make_seq("c", [9, 9, 9], 3)
    for s in (a, b, c):
        sched.add(s)
    model = FakeModel(cfg)

    out0 = sched.schedule()
    assert [it.request_id for it in out0.prefills] == ["a", "b"] and sched.num_waiting == 1
    sched.update(out0, model.step(out0))
    out1 = sched.schedule()
    assert [it.request_id for it in out1.decodes] == ["a", "b"] and not out1.prefills
    done = sched.update(out1, model.step(out1))
    assert [s.request_id for s in done] == ["a"] and a.status is LENGTH
    assert a.output_token_ids == expected_output([5, 6], 2, False)
    out2 = sched.schedule()  # a's slot goes to c right away
    assert [it.request_id for it in out2.decodes] == ["b"]
    assert [(it.request_id, it.num_new_tokens, it.is_last_chunk) for it in out2.prefills] == [
        ("c", 3, True)]
    assert sched.num_running == 2 and sched.num_waiting == 0


@pytest.mark.parametrize("max_num_seqs", [1, 2, 3, 8])
def test_max_num_seqs_and_budget_every_step(max_num_seqs):
    cfg = config(max_num_seqs=max_num_seqs, max_num_batched_tokens=max(max_num_seqs, 12),
                 num_blocks=1 + 200)
    reqs = [(i // 3, f"r{i}", prompt_of(i, 1 + (7 * i) % 30), 10 + (5 * i) % 20)
            for i in range(15)]
    peak = []
    res, _ = simulate(cfg, reqs, use_stop=False,
                      on_step=lambda s, sched, out: peak.append(sched.num_running))
    assert max(peak) == max_num_seqs  # the limit is reached, and (checked per step) never exceeded
    assert res == expected_results(reqs, use_stop=False)


# ---- chunked prefill ---------------------------------------------------------

def test_chunked_prefill_splits_long_prompt():
    cfg = config(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=128, num_blocks=1 + 32)
    prompt = prompt_of(1, 100)
    chunks, samples = [], []

    def record(step, sched, out):
        for it in out.scheduled:
            if it.is_prefill_chunk:
                chunks.append((it.start_pos, it.num_new_tokens, it.is_last_chunk))
            if it.is_last_chunk:
                samples.append(step)

    res, _ = simulate(cfg, [(0, "long", prompt, 5)], use_stop=False, on_step=record)
    assert chunks == [(0, 32, False), (32, 32, False), (64, 32, False), (96, 4, True)]
    assert samples == [3, 4, 5, 6, 7]  # nothing sampled before the last chunk
    assert res["long"] == (expected_output(prompt, 5, False), LENGTH)


def test_running_decode_and_prefill_chunk_share_budget():
    cfg = config(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64)
    sched, model = Scheduler(cfg), FakeModel(cfg)
    short, long = make_seq("short", [1, 2, 3], 20), make_seq("long", prompt_of(2, 30), 3)
    sched.add(short)
    _step(sched, model)
    sched.add(long)
    sizes = []
    while long.status is SequenceStatus.WAITING or long.is_prefill:
        out = _step(sched, model)
        assert [it.request_id for it in out.decodes] == ["short"]
        sizes += [it.num_new_tokens for it in out.prefills]
    assert sizes == [7, 7, 7, 7, 2]
    assert long.output_token_ids == expected_output(long.prompt_token_ids, 1, False)


def test_long_prefill_blocks_admission_until_done():
    cfg = config(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64)
    sched, model = Scheduler(cfg), FakeModel(cfg)
    long, short = make_seq("long", prompt_of(2, 20), 3), make_seq("short", [1, 2, 3], 20)
    sched.add(long)
    sched.add(short)
    got = [[(it.request_id, it.num_new_tokens) for it in _step(sched, model).scheduled]
           for _ in range(4)]
    # FCFS: the older prompt gets the budget first; short fills what is left.
    assert got == [[("long", 8)], [("long", 8)], [("long", 4), ("short", 3)],
                   [("long", 1), ("short", 1)]]


def test_sampled_token_before_last_chunk_rejected():
    cfg = config(max_num_batched_tokens=8)
    sched = Scheduler(cfg)
    sched.add(make_seq("a", list(range(20)), 2))
    out = sched.schedule()
    with pytest.raises(ValueError, match="before its last prefill chunk"):
        sched.update(out, {"a": 1})


def test_missing_sample_rejected():
    sched = Scheduler(config())
    sched.add(make_seq("a", [1, 2], 2))
    out = sched.schedule()
    with pytest.raises(ValueError, match="no sampled token"):
        sched.update(out, {})


def test_without_chunking_prompts_run_whole():
    cfg = config(max_num_seqs=3, max_num_batched_tokens=64, max_model_len=64,
                 enable_chunked_prefill=False)
    reqs = [(0, f"r{i}", prompt_of(i, 20 + i), 10) for i in range(6)]
    sizes = []
    res, _ = simulate(cfg, reqs, on_step=lambda s, sched, out: sizes.extend(
        it.num_new_tokens for it in out.prefills))
    assert sorted(sizes) == sorted(20 + i for i in range(6))  # one chunk each
    assert res == expected_results(reqs)


# ---- preemption --------------------------------------------------------------

def test_preempts_newest_and_recomputes_everything():
    cfg = config(max_num_seqs=2, block_size=4, num_blocks=1 + 4, max_model_len=16)
    sched, model = Scheduler(cfg), FakeModel(cfg)
    a, b = make_seq("a", [1, 2, 3, 4], 10), make_seq("b", [5, 6, 7, 8], 10)
    c = make_seq("c", [9], 2)
    for s in (a, b, c):
        sched.add(s)
    for _ in range(5):  # positions 4..7 fit in each one's second block
        out = sched.schedule()
        assert not out.preempted
        sched.update(out, model.step(out))
    assert a.num_tokens == b.num_tokens == 9 and sched.block_manager.num_free_blocks == 0
    out = sched.schedule()  # both need a third block for position 8
    assert out.preempted == ["b"] and sched.num_preemptions == 1
    assert [it.request_id for it in out.decodes] == ["a"] and not out.prefills
    assert list(sched.waiting) == [b, c] and b.status is SequenceStatus.PREEMPTED
    assert b.output_token_ids == expected_output(b.prompt_token_ids, 5, False)
    sched.update(out, model.step(out))
    while a.status is SequenceStatus.RUNNING:
        out = sched.schedule()
        assert [it.request_id for it in out.scheduled] == ["a"]
        sched.update(out, model.step(out))
    out = sched.schedule()  # the recompute prefill covers prompt + all 5 outputs
    assert [(it.request_id, it.start_pos, it.num_new_tokens, it.is_last_chunk)
            for it in out.prefills] == [("b", 0, 9, True)]
    # A one-token prompt has a single uncomputed token, so it runs as a decode.
    assert [(it.request_id, it.start_pos) for it in out.decodes] == [("c", 0)]
    sched.update(out, model.step(out))
    assert b.output_token_ids == expected_output(b.prompt_token_ids, 6, False)


def test_preempts_newest_of_several():
    cfg = config(max_num_seqs=3, block_size=4, num_blocks=1 + 6, max_model_len=24)
    sched, model = Scheduler(cfg), FakeModel(cfg)
    seqs = [make_seq(r, [1, 2, 3, 4], 10) for r in "abc"]
    for s in seqs:
        sched.add(s)
    for _ in range(5):  # each holds 2 blocks; all 6 in use
        out = _step(sched, model)
        assert not out.preempted
    out = sched.schedule()  # a needs a third block: c goes, b keeps running
    assert out.preempted == ["c"]
    assert [it.request_id for it in out.decodes] == ["a", "b"]
    assert sched.running == seqs[:2] and list(sched.waiting) == [seqs[2]]


def test_newest_preempts_itself():
    cfg = config(max_num_seqs=2, block_size=4, num_blocks=1 + 4, max_model_len=16)
    sched, model = Scheduler(cfg), FakeModel(cfg)
    a, b = make_seq("a", list(range(1, 9)), 4), make_seq("b", [5, 6, 7, 8], 4)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()  # 2 + 1 blocks
    sched.update(out, model.step(out))
    out = sched.schedule()  # a takes the last block for position 8; b has nobody newer
    assert out.preempted == ["b"]
    assert [it.request_id for it in out.decodes] == ["a"]
    assert sched.running == [a] and list(sched.waiting) == [b]


@pytest.mark.parametrize("block_size, num_blocks", [(1, 1 + 40), (2, 1 + 20), (4, 1 + 10)])
def test_preemption_loses_nothing(block_size, num_blocks):
    tight = config(max_num_seqs=6, max_num_batched_tokens=16, max_model_len=40,
                   block_size=block_size, num_blocks=num_blocks)
    reqs = [(i % 3, f"r{i}", prompt_of(10 + i, 4 + (3 * i) % 11), 25) for i in range(8)]
    got, sched = simulate(tight, reqs, use_stop=False)
    assert sched.num_preemptions > 0
    roomy = config(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=40,
                   block_size=block_size, num_blocks=1 + 8 * 40)
    free_run, free_sched = simulate(roomy, reqs, use_stop=False)
    assert free_sched.num_preemptions == 0
    assert got == free_run == expected_results(reqs, use_stop=False)


# ---- abort -------------------------------------------------------------------

def _abort_setup():
    cfg = config(max_num_seqs=2, max_num_batched_tokens=8, block_size=4, num_blocks=1 + 6,
                 max_model_len=24)
    return Scheduler(cfg), FakeModel(cfg), cfg


def _step(sched, model):
    out = sched.schedule()
    sched.update(out, model.step(out))
    return out


def _assert_aborted(sched, seq):
    assert sched.abort(seq.request_id) is True
    assert seq.status is SequenceStatus.FINISHED_ABORTED and seq.block_table == []
    assert seq not in sched.running and seq not in sched.waiting
    assert sched.abort(seq.request_id) is False
    sched.block_manager.check_invariants()


def test_abort_waiting():
    sched, model, _ = _abort_setup()
    seq = make_seq("w", [1, 2, 3], 4)
    sched.add(seq)
    _assert_aborted(sched, seq)
    assert not sched.has_unfinished()
    sched.add(make_seq("w", [1], 1))  # the id is free again


def test_abort_mid_prefill():
    sched, model, cfg = _abort_setup()
    seq = make_seq("p", list(range(20)), 3)
    sched.add(seq)
    _step(sched, model)
    assert seq.num_computed_tokens == 8 and seq.is_prefill
    assert sched.block_manager.num_used_blocks == 2
    _assert_aborted(sched, seq)
    assert sched.block_manager.num_free_blocks == cfg.num_blocks - 1


def test_abort_running_and_between_schedule_and_update():
    sched, model, cfg = _abort_setup()
    a, b = make_seq("a", [1, 2, 3], 6), make_seq("b", [4, 5, 6], 6)
    sched.add(a)
    sched.add(b)
    _step(sched, model)
    _assert_aborted(sched, a)
    out = sched.schedule()
    sampled = model.step(out)
    _assert_aborted(sched, b)  # the step already ran; update must skip b
    assert sched.update(out, sampled) == []
    assert b.output_token_ids == expected_output([4, 5, 6], 1, False)
    assert sched.block_manager.num_free_blocks == cfg.num_blocks - 1


def test_abort_preempted():
    cfg = config(max_num_seqs=2, block_size=4, num_blocks=1 + 4, max_model_len=16)
    sched, model = Scheduler(cfg), FakeModel(cfg)
    a, b = make_seq("a", list(range(1, 9)), 4), make_seq("b", [5, 6, 7, 8], 4)
    sched.add(a)
    sched.add(b)
    _step(sched, model)
    out = _step(sched, model)
    assert out.preempted == ["b"] and b.status is SequenceStatus.PREEMPTED
    _assert_aborted(sched, b)
    while sched.has_unfinished():
        _step(sched, model)
    assert a.output_token_ids == expected_output(a.prompt_token_ids, 4, False)
    assert sched.block_manager.num_free_blocks == 4


def test_abort_unknown():
    sched = Scheduler(config())
    assert sched.abort("nope") is False


# ---- validation ----------------------------------------------------------------

def test_add_rejects_bad_requests():
    sched = Scheduler(config(max_model_len=16))
    with pytest.raises(ValueError, match=r"prompt \(10 tokens\) \+ max_tokens \(7\) = 17 "
                                         r"exceeds max_model_len \(16\).*<= 6"):
        sched.add(make_seq("long", range(10), 7))
    with pytest.raises(ValueError, match="empty prompt"):
        sched.add(make_seq("empty", [], 3))
    with pytest.raises(ValueError, match="max_tokens must be a positive integer"):
        sched.add(make_seq("zero", [1], 0))
    sched.add(make_seq("dup", [1, 2], 3))
    with pytest.raises(ValueError, match="'dup' is already in use"):
        sched.add(make_seq("dup", [3], 1))
    assert sched.num_waiting == 1
    sched.add(make_seq("exact", range(10), 6))  # exactly max_model_len is fine


@pytest.mark.parametrize("kw, message", [
    (dict(max_num_seqs=0), "max_num_seqs must be a positive integer"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens must be a positive integer"),
    (dict(max_model_len=-1), "max_model_len must be a positive integer"),
    (dict(block_size=3), "power of 2 between 1 and 256"),
    (dict(block_size=512), "power of 2 between 1 and 256"),
    (dict(max_num_seqs=8, max_num_batched_tokens=4), r"must be >= max_num_seqs \(8\)"),
    (dict(enable_chunked_prefill=False, max_num_batched_tokens=32, max_model_len=64),
     "without chunked prefill"),
    (dict(max_model_len=64, block_size=16, num_blocks=4),
     r"needs 4 blocks of 16 tokens .* num_blocks >= 5; got num_blocks=4, room for 48 tokens"),
    (dict(max_model_len=65, block_size=16, num_blocks=5), "num_blocks >= 6"),
])
def test_config_validation(kw, message):
    # The engine's path: EngineConfig validates the fields it holds, SchedulerConfig what the
    # engine derives (max_model_len, num_blocks).
    from jaxserve.config import EngineConfig
    engine_kw = dict(max_num_seqs=4, max_num_batched_tokens=64, block_size=4)
    derived = dict(max_model_len=64, num_blocks=1 + 64)
    for k, v in kw.items():
        (derived if k in derived else engine_kw)[k] = v
    with pytest.raises(ValueError, match=message):
        EngineConfig(**engine_kw).scheduler_config(**derived)


def test_config_is_frozen_and_keyword_only():
    cfg = config()
    with pytest.raises(AttributeError):
        cfg.max_num_seqs = 9
    with pytest.raises(TypeError):
        SchedulerConfig(4, 64, 64, 4, 65)


def test_smallest_valid_cache_runs():
    cfg = config(max_model_len=64, block_size=16, num_blocks=5, max_num_seqs=3,
                 max_num_batched_tokens=16)
    reqs = [(0, f"r{i}", prompt_of(i, 30), 34) for i in range(3)]
    got, sched = simulate(cfg, reqs, use_stop=False)
    assert got == expected_results(reqs, use_stop=False)


def test_update_rejects_unfinished_reason():
    sched = Scheduler(config())
    sched.add(make_seq("a", [1], 3))
    out = sched.schedule()
    with pytest.raises(ValueError, match="FINISHED_"):
        sched.update(out, {"a": 5}, {"a": SequenceStatus.RUNNING})


def test_held_sequence_extend_reserve_and_error_abort():
    """The scheduler side of a request state's Decision (decision.py)."""
    sched = Scheduler(config())
    seq = make_seq("a", [1, 2, 3], 5)
    seq.num_reserved_slots = 2
    sched.add(seq)
    out = sched.schedule()
    assert sched.update(out, {}, hold={"a"}) == [] and seq.num_uncomputed_tokens == 0
    assert sched.schedule().is_empty  # held: nothing to compute
    sched.set_reserved_slots(seq, 1)
    sched.extend(seq, 7)
    out = sched.schedule()
    assert [(i.request_id, i.token_ids) for i in out.decodes] == [("a", [7])]
    with pytest.raises(ValueError, match="num_slots"):
        sched.set_reserved_slots(seq, 0)
    assert sched.abort("a", SequenceStatus.FINISHED_ERROR)
    assert seq.status is SequenceStatus.FINISHED_ERROR and not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_usable_blocks
    with pytest.raises(ValueError, match="not a live sequence"):
        sched.extend(seq, 8)


def test_empty_schedule_when_idle():
    out = Scheduler(config()).schedule()
    assert isinstance(out, SchedulerOutput) and out.is_empty and num_batched_tokens(out) == 0


# ---- randomized stress -----------------------------------------------------------

def _random_case(seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 16, 256])
    max_model_len = rng.choice([16, 40, 64]) if block_size < 256 else rng.choice([64, 300, 512])
    need = math.ceil(max_model_len / block_size)
    num_blocks = 1 + need + rng.choice([0, 0, 1, need // 2, 3 * need])
    max_num_seqs = rng.randint(1, 6)
    chunked = rng.random() < 0.8
    low = max_num_seqs if chunked else max_model_len
    budget = rng.randint(low, max(low, rng.choice([8, 32, 128])))
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                          max_model_len=max_model_len, block_size=block_size,
                          num_blocks=num_blocks, enable_chunked_prefill=chunked)
    reqs = []
    for i in range(rng.randint(1, 10)):
        n_prompt = rng.randint(1, max_model_len - 1)
        max_tokens = rng.randint(1, min(30, max_model_len - n_prompt))
        reqs.append((rng.randint(0, 15), f"q{i}",
                     [rng.randrange(3, 1000) for _ in range(n_prompt)], max_tokens))
    return cfg, reqs


@pytest.mark.parametrize("seed", range(60))
def test_random_stress(seed):
    cfg, reqs = _random_case(seed)
    got, _ = simulate(cfg, reqs)
    unconstrained = SchedulerConfig(
        max_num_seqs=len(reqs), max_num_batched_tokens=cfg.max_model_len * len(reqs),
        max_model_len=cfg.max_model_len, block_size=cfg.block_size,
        num_blocks=1 + len(reqs) * math.ceil(cfg.max_model_len / cfg.block_size))
    free_run, free_sched = simulate(unconstrained, reqs)
    assert free_sched.num_preemptions == 0
    assert got == free_run == expected_results(reqs)


def test_random_stress_exercises_preemption():
    """Guard against the stress cases silently becoming too easy."""
    total = sum(simulate(*_random_case(seed))[1].num_preemptions for seed in range(60))
    assert total > 0


def test_committed_update_writes_each_id_over_its_placeholder():
    """Asynchronous scheduling: commit advances the step and appends a PLACEHOLDER per sampled
    token (the next step is planned on it); update(committed=True) puts the real id in its
    place, advancing nothing twice, and a sequence aborted since keeps what it had."""
    from jaxserve.core.sequence import PLACEHOLDER
    s = Scheduler(config())
    a, b = make_seq("a", [1, 2, 3], 8), make_seq("b", [4, 5], 8)
    s.add(a)
    s.add(b)
    first = s.schedule()
    s.commit(first)
    assert a.output_token_ids == [PLACEHOLDER] and a.num_computed_tokens == 3
    second = s.schedule()  # each decodes its placeholder (the device supplies the id)
    assert [(i.request_id, i.start_pos) for i in second.decodes] == [("a", 3), ("b", 2)]
    s.abort("b")
    done = s.update(first, {"a": 11, "b": 12}, committed=True)
    assert done == [] and a.output_token_ids == [11] and a.num_computed_tokens == 3
    assert b.output_token_ids == []  # aborted since commit: its placeholder dropped
    s.commit(second)
    s.update(second, {"a": 13}, committed=True)
    assert a.output_token_ids == [11, 13] and a.num_computed_tokens == 4


def test_a_sequence_ended_before_its_committed_id_arrives_drops_the_placeholder():
    """A request failed or aborted inside a step, after commit and before update: its output
    ends with what it had, not with the PLACEHOLDER of a token that will not be applied."""
    from jaxserve.core.sequence import PLACEHOLDER
    s = Scheduler(config())
    a = make_seq("a", [1, 2, 3], 8)
    s.add(a)
    first = s.schedule()
    s.update(first, {"a": 11})
    second = s.schedule()
    s.commit(second)
    assert a.output_token_ids == [11, PLACEHOLDER]
    s.abort("a", SequenceStatus.FINISHED_ERROR)
    assert a.output_token_ids == [11] and a.status is SequenceStatus.FINISHED_ERROR
    assert s.update(second, {"a": 12}, committed=True) == [] and a.output_token_ids == [11]
