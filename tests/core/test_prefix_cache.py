"""Prefix caching, forks and copy-on-write in the block manager and scheduler (plain Python).

The fake model below keeps (position, token) in every KV slot and reads a sequence's whole
context back through its block table before "sampling": a block shared by sequences whose
prefixes differ, a cached block reused under the wrong prefix, a copy-on-write that did not copy
or a fork that sees a sibling's token shows up as a context different from the sequence's own
tokens, and as outputs different from `expected_output` (computed without the scheduler).
"""

import random
from types import SimpleNamespace

import pytest

from jaxserve.core.block_manager import BlockManager
from kv_slots import slot_for_position
from jaxserve.core.prefix_cache import block_hashes, hash_block
from jaxserve.core.scheduler import Scheduler, SchedulerConfig
from jaxserve.core.sequence import Sequence, SequenceStatus
from test_scheduler import expected_output, next_token


def make_seq(rid, prompt, max_tokens=8, salt=None):
    return Sequence(rid, list(prompt), SimpleNamespace(max_tokens=max_tokens), cache_salt=salt)


class ContentModel:
    """Fake KV cache of (position, token); copies blocks as the scheduler asks."""

    def __init__(self, cfg):
        self.bs = cfg.block_size
        self.cache = [None] * (cfg.num_blocks * cfg.block_size)

    def step(self, out, next_fn=next_token):
        bs = self.bs
        for src, dst in out.blocks_to_copy:
            self.cache[dst * bs:(dst + 1) * bs] = self.cache[src * bs:(src + 1) * bs]
        for item in out.scheduled:
            for pos, tok in zip(item.positions, item.token_ids, strict=True):
                self.cache[slot_for_position(item.seq.block_table, pos, bs)] = (pos, tok)
        sampled = {}
        for item in out.scheduled:
            if item.is_last_chunk:
                end = item.start_pos + item.num_new_tokens
                ctx = [self.cache[slot_for_position(item.seq.block_table, p, bs)]
                       for p in range(end)]
                assert ctx == list(enumerate(item.seq.all_token_ids[:end])), item.request_id
                sampled[item.request_id] = next_fn([t for _, t in ctx])
        return sampled


def config(**kw):
    base = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, block_size=4,
                num_blocks=1 + 40, enable_prefix_caching=True)
    base.update(kw)
    return SchedulerConfig(**base)


def computed(bm, seq, n=None):
    """Allocates and 'computes' n tokens of seq (a whole admission when it has no blocks)."""
    cached = bm.cached_prefix(seq) if not seq.block_table else None
    bm.allocate(seq, n, cached)
    seq.num_computed_tokens += n if n is not None else seq.num_uncomputed_tokens
    bm.register_computed(seq)
    bm.check_invariants()


# ---- hashing ----------------------------------------------------------------------------

def test_hash_chain_depends_on_parent_tokens_and_salt():
    h = hash_block(b"", [1, 2, 3, 4])
    assert len(h) == 32 and h == hash_block(b"", [1, 2, 3, 4])
    assert h != hash_block(b"", [1, 2, 3, 5])
    assert h != hash_block(b"", [1, 2, 3, 4], b"salt")
    assert hash_block(h, [5, 6, 7, 8]) != hash_block(hash_block(b"", [0, 2, 3, 4]), [5, 6, 7, 8])
    # Python's hash of small ints is the int itself: (1, 2) and (2, 1) must not be confusable.
    assert hash_block(b"", [1, 2]) != hash_block(b"", [2, 1])


def test_sequence_hashes_are_a_chain_over_full_blocks():
    seq = make_seq("a", range(10))
    hashes = block_hashes(seq, 4)
    assert len(hashes) == 2
    assert hashes[0] == hash_block(b"", [0, 1, 2, 3])
    assert hashes[1] == hash_block(hashes[0], [4, 5, 6, 7])
    seq.append_token(10), seq.append_token(11)
    assert block_hashes(seq, 4)[:2] == hashes and len(block_hashes(seq, 4)) == 3


# ---- block manager ----------------------------------------------------------------------

def test_hit_reuses_blocks_and_counts():
    bm = BlockManager(20, 4, enable_caching=True)
    a = make_seq("a", range(14))
    computed(bm, a)
    b = make_seq("b", list(range(9)) + [99, 98, 97])  # shares 2 full blocks (8 tokens) with a
    cached = bm.cached_prefix(b)
    assert cached == a.block_table[:2]
    assert bm.blocks_needed(b, None, cached) == 1  # only the third block is new
    bm.allocate(b, None, cached)
    assert b.num_computed_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    assert [bm.ref_count(x) for x in b.block_table] == [2, 2, 1]
    assert (bm.num_hit_blocks, bm.num_hit_tokens) == (2, 8)
    assert (bm.num_query_blocks, bm.num_query_tokens) == (3 + 3, 14 + 12)
    bm.check_invariants()


def test_salt_separates_caches():
    bm = BlockManager(20, 4, enable_caching=True)
    computed(bm, make_seq("a", range(12), salt="alice"))
    assert bm.cached_prefix(make_seq("b", range(12), salt="bob")) == []
    assert len(bm.cached_prefix(make_seq("c", range(12), salt="alice"))) == 2


@pytest.mark.parametrize("length,hits", [(12, 2), (13, 3), (11, 2), (4, 0), (5, 1)])
def test_last_token_is_never_a_hit(length, hits):
    bm = BlockManager(20, 4, enable_caching=True)
    computed(bm, make_seq("a", range(16)))
    seq = make_seq("b", range(length))
    assert len(bm.cached_prefix(seq)) == hits
    computed(bm, seq)  # the rest is computed: at least one token


def test_freed_blocks_stay_cached_and_are_evicted_lru_only_when_needed():
    bm = BlockManager(1 + 6, 2, enable_caching=True)  # 6 usable blocks of 2 tokens
    a, b = make_seq("a", [1, 2, 3, 4]), make_seq("b", [5, 6, 7, 8])
    computed(bm, a)
    computed(bm, b)
    a_blocks, b_blocks = list(a.block_table), list(b.block_table)
    bm.free(a)  # freed first: evicted first
    bm.free(b)
    assert bm.num_free_blocks == 6 and bm.num_cached_blocks == 4
    c = make_seq("c", [9, 9, 9, 9])  # takes the two never-cached blocks, evicts nothing
    computed(bm, c)
    assert bm.cache.num_evictions == 0 and bm.num_cached_blocks == 6
    bm.free(c)  # c's blocks are now the most recent
    d = make_seq("d", [0, 0, 0, 0, 0, 0])
    computed(bm, d)
    # a's blocks go first, tail before head (freed in reverse), then b's tail.
    assert d.block_table == [a_blocks[1], a_blocks[0], b_blocks[1]]
    assert bm.cache.num_evictions == 3
    assert bm.cached_prefix(make_seq("a2", [1, 2, 3, 4, 0])) == []
    assert bm.cached_prefix(make_seq("b2", [5, 6, 7, 8, 0])) == b_blocks[:1]


def test_reset_prefix_cache_forgets_only_unreferenced_blocks():
    bm = BlockManager(1 + 6, 2, enable_caching=True)
    a, b = make_seq("a", [1, 2, 3, 4]), make_seq("b", [5, 6, 7, 8])
    computed(bm, a)
    computed(bm, b)
    bm.free(a)  # a's 2 blocks: cached, unreferenced; b still holds its 2
    assert bm.reset_prefix_cache() == 2
    assert bm.num_cached_blocks == 2 and bm.num_free_blocks == 4
    assert bm.cached_prefix(make_seq("a2", [1, 2, 3, 4, 0])) == []
    assert bm.cached_prefix(make_seq("b2", [5, 6, 7, 8, 0])) == b.block_table
    bm.check_invariants()
    bm.free(b)
    assert bm.num_free_blocks == 6
    bm.check_invariants()


def test_hit_revives_an_evictable_block_and_counts_against_free():
    bm = BlockManager(1 + 3, 2, enable_caching=True)
    a = make_seq("a", [1, 2, 3, 4, 5, 6])
    computed(bm, a)
    bm.free(a)
    b = make_seq("b", [1, 2, 3, 4, 7])
    cached = bm.cached_prefix(b)
    assert len(cached) == 2
    # 2 revived + 1 new of the 3 free blocks; one more token would need a 4th.
    assert bm.blocks_needed(b, None, cached) == 3 and bm.can_allocate(b, None, cached)
    bm.allocate(b, None, cached)
    assert bm.num_free_blocks == 0 and b.num_computed_tokens == 4
    bm.check_invariants()


def test_writing_into_a_cached_block_copies_it():
    bm = BlockManager(20, 4, enable_caching=True)
    a = make_seq("a", range(8))
    computed(bm, a)
    child = make_seq("child", range(8))
    bm.fork(a, child)
    child.num_computed_tokens = 7  # recompute the last token, as an n > 1 branch does
    copies = bm.allocate(child, 1)
    assert copies == [(a.block_table[1], child.block_table[1])]
    assert child.block_table[1] != a.block_table[1] and bm.num_cow_copies == 1
    bm.free(a)
    bm.free(child)
    assert bm.num_free_blocks == bm.num_usable_blocks
    assert all(bm.ref_count(b) == 0 for b in range(20))
    bm.check_invariants()


def test_invariant_checker_catches_a_stale_hash():
    bm = BlockManager(20, 4, enable_caching=True)
    a = make_seq("a", range(8))
    computed(bm, a)
    h = bm.cache.hash_of[a.block_table[0]]
    del bm.cache.block_of[h]
    with pytest.raises(Exception, match="maps disagree"):
        bm.check_invariants()


# ---- scheduler simulation ---------------------------------------------------------------

def run(cfg, requests, next_fn=next_token, forks=None, reserve=None):
    """requests: (arrival_step, rid, prompt, max_tokens). Returns (rid -> output, scheduler)."""
    sched, model = Scheduler(cfg), ContentModel(cfg)
    pending, seqs, step = sorted(requests, key=lambda r: r[0]), {}, 0
    while pending or sched.has_unfinished():
        while pending and pending[0][0] <= step:
            _, rid, prompt, max_tokens = pending.pop(0)
            seqs[rid] = make_seq(rid, prompt, max_tokens)
            seqs[rid].num_reserved_slots = (reserve or {}).get(rid, 1)
            sched.add(seqs[rid])
        out = sched.schedule()
        sampled = model.step(out, next_fn)
        if forks:
            forks(sched, out, seqs)
        sched.update(out, sampled)
        sched.block_manager.check_invariants()
        step += 1
        assert step < 5000
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks
    assert all(bm.ref_count(b) == 0 for b in range(cfg.num_blocks))
    return {rid: s.output_token_ids for rid, s in seqs.items()}, sched


def shared_prefix_workload(seed, n=30):
    rng = random.Random(seed)
    system = [rng.randrange(3, 1000) for _ in range(40)]
    reqs = []
    for i in range(n):
        k = rng.choice([0, 3, 4, 7, 8, 13, 16, 21, 40])  # aligned and not
        prompt = system[:k] + [rng.randrange(3, 1000) for _ in range(rng.randrange(1, 12))]
        reqs.append((rng.randrange(0, 40), f"r{i}", prompt, rng.randrange(1, 10)))
    return reqs


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("num_blocks", [1 + 16, 1 + 40])
def test_cached_outputs_equal_uncached_under_preemption_and_eviction(seed, num_blocks):
    reqs = shared_prefix_workload(seed)
    want = {rid: expected_output(p, m, use_stop=False) for _, rid, p, m in reqs}
    off, s_off = run(config(num_blocks=num_blocks, enable_prefix_caching=False), reqs)
    on, s_on = run(config(num_blocks=num_blocks), reqs)
    assert off == want and on == want
    bm = s_on.block_manager
    assert bm.num_hit_blocks > 0 and s_off.block_manager.num_hit_blocks == 0
    assert s_on.num_computed_prompt_tokens < s_off.num_computed_prompt_tokens
    if num_blocks == 17:  # the small cache really preempts and evicts
        assert s_on.num_preemptions > 0 and bm.cache.num_evictions > 0


def test_preempted_sequence_hits_its_own_blocks():
    cfg = config(num_blocks=1 + 8, max_num_seqs=2, max_model_len=32)
    sched, model = Scheduler(cfg), ContentModel(cfg)
    # a ends soon after preempting b, evicting only b's tail blocks (the LRU end).
    a, b = make_seq("a", range(3, 15), 10), make_seq("b", range(30, 42), 20)
    sched.add(a), sched.add(b)
    while not sched.num_preemptions:
        out = sched.schedule()
        sched.update(out, model.step(out))
    victim = sched.waiting[0]
    assert victim.block_table == [] and victim.num_tokens > 12
    hits_before = sched.block_manager.num_hit_blocks
    while victim.status is not SequenceStatus.RUNNING or victim.num_computed_tokens == 0:
        out = sched.schedule()
        sched.update(out, model.step(out))
    assert sched.block_manager.num_hit_blocks > hits_before


def test_forked_branches_diverge_without_seeing_each_other():
    """Each branch samples with its own function: a leaked sibling token breaks the context check."""
    cfg = config(max_num_seqs=8, num_blocks=1 + 60, max_model_len=48)
    branch_of = {}

    def next_fn(ctx):  # the branch id is smuggled in as the first output token
        return next_token(ctx) + 1000 * branch_of.get(ctx[len(prompt)] if len(ctx) > len(prompt)
                                                      else None, 0)

    prompt = list(range(3, 13))  # 10 tokens: the tail block (8..11) is partly filled

    def forks(sched, out, seqs):
        for item in out.scheduled:
            if item.request_id == "p" and item.is_last_chunk and item.seq.num_output_tokens == 0:
                for i in range(1, 4):
                    child = make_seq(f"p{i}", prompt, 12)
                    child.output_token_ids = [5000 + i]  # a distinct first token per branch
                    sched.fork(item.seq, child, len(prompt))
                    branch_of[5000 + i] = i
                    seqs[child.request_id] = child

    seqs_out, sched = run(cfg, [(0, "p", prompt, 12)], next_fn, forks, reserve={"p": 4})
    outs = [seqs_out[r] for r in ("p1", "p2", "p3")]
    for i, out in enumerate(outs, start=1):
        ctx = prompt + out[:1]
        for tok in out[1:]:
            assert tok == next_token(ctx) + 1000 * i
            ctx.append(tok)
    assert len({tuple(o) for o in outs}) == 3
    assert sched.block_manager.num_cow_copies >= 3  # every branch wrote into the shared tail


def test_fork_needs_a_reserved_slot():
    sched = Scheduler(config())
    a = make_seq("a", range(5))
    sched.add(a)
    out = sched.schedule()
    with pytest.raises(ValueError, match="no reserved slot"):
        sched.fork(a, make_seq("b", range(5)), 4)
    sched.update(out, {"a": 7})


def test_reserved_slots_bound_admission():
    sched = Scheduler(config(max_num_seqs=4))
    a, b = make_seq("a", range(5)), make_seq("b", range(6))
    a.num_reserved_slots = 3
    b.num_reserved_slots = 2
    sched.add(a), sched.add(b)
    out = sched.schedule()
    assert [i.request_id for i in out.scheduled] == ["a"]  # 3 + 2 > 4
    big = make_seq("c", range(5))
    big.num_reserved_slots = 5
    with pytest.raises(ValueError, match="batch slots"):
        sched.add(big)
