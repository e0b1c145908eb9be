"""Property-based tests (hypothesis) of the scheduler + block manager + prefix cache.

A `RuleBasedStateMachine` drives a real `Scheduler` with random sequences of add / step /
abort / fork / finish (preemption happens by itself: the KV pool is small) and after every
rule checks it against an independent model kept here:

* a shadow KV cache (slot -> token id) written exactly as the runner would, copy-on-write
  pairs applied first: every computed position of every live sequence must still read back its
  own token. A block freed while still in use, shared without copy-on-write, or handed out of the
  prefix cache with other content is overwritten or wrong here;
* reference counts recomputed from the live sequences' block tables, no block twice in one
  table, no null block in a table, the free list and cached-free blocks disjoint from used ones,
  and used + free = usable;
* every request's tokens equal the tokens this model gave it (preemption loses nothing);
* when everything has ended (teardown drains the rest), every block is free.

CI runs the fixed `ci` profile (derandomized, bounded); JAXSERVE_HYPOTHESIS_PROFILE=deep runs
many more examples with fresh randomness.
"""

import os
from types import SimpleNamespace

from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jaxserve.core.block_manager import NULL_BLOCK
from jaxserve.core.scheduler import Scheduler, SchedulerConfig
from jaxserve.core.sequence import Sequence, SequenceStatus

# No example database: derandomized runs need none, and it would write .hypothesis/ into the tree.
settings.register_profile("ci", max_examples=80, stateful_step_count=50, derandomize=True,
                          database=None, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("deep", max_examples=2000, stateful_step_count=80, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
PROFILE = os.environ.get("JAXSERVE_HYPOTHESIS_PROFILE", "ci")

MAX_MODEL_LEN = 24
# Shared prompt heads so that admissions hit the prefix cache (and its own blocks after a
# preemption); the vocabulary is tiny for the same reason.
HEADS = ([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5])
TOKENS = st.integers(min_value=0, max_value=3)


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(block_size=st.sampled_from([4, 2, 1]), extra_blocks=st.integers(0, 6),
                budget=st.sampled_from([4, 7, 32]), caching=st.booleans(),
                chunked=st.booleans())
    def setup(self, block_size, extra_blocks, budget, caching, chunked):
        if not chunked:
            budget = MAX_MODEL_LEN
        # The fewest blocks the config accepts plus a few: preemption is common.
        num_blocks = 1 + -(-MAX_MODEL_LEN // block_size) + extra_blocks
        self.sched = Scheduler(SchedulerConfig(
            max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=MAX_MODEL_LEN,
            block_size=block_size, num_blocks=num_blocks, enable_chunked_prefill=chunked,
            enable_prefix_caching=caching))
        self.bs = block_size
        self.kv: dict[int, int] = {}  # shadow KV cache: flat slot -> token id
        self.tokens: dict[str, list[int]] = {}  # the model's view of every live request
        self.seqs: dict[str, Sequence] = {}
        self.next_id = 0

    # ---- rules ----------------------------------------------------------

    @rule(head=st.sampled_from(HEADS), tail=st.lists(TOKENS, max_size=8),
          max_tokens=st.integers(1, 14), slots=st.integers(1, 2), salt=st.sampled_from([None, "s"]))
    def add(self, head, tail, max_tokens, slots, salt):
        prompt = (head + tail)[:MAX_MODEL_LEN - max_tokens]
        rid = f"r{self.next_id}"
        self.next_id += 1
        seq = Sequence(rid, prompt, SimpleNamespace(max_tokens=max_tokens), cache_salt=salt)
        seq.num_reserved_slots = slots
        self.sched.add(seq)
        self.seqs[rid], self.tokens[rid] = seq, list(prompt)

    @rule(data=st.data(), repeat=st.integers(1, 4))
    def step(self, data, repeat):
        for _ in range(repeat):
            self._step(data)

    def _step(self, data):
        out = self.sched.schedule()
        for src, dst in out.blocks_to_copy:  # copy-on-write, before the step's writes
            for off in range(self.bs):
                if src * self.bs + off in self.kv:
                    self.kv[dst * self.bs + off] = self.kv[src * self.bs + off]
        sampled, finished = {}, {}
        for item in out.scheduled:
            assert item.token_ids == self.tokens[item.request_id][item.start_pos:
                                                                   item.start_pos + item.num_new_tokens]
            for pos, tok in zip(item.positions, item.token_ids):
                slot = item.seq.block_table[pos // self.bs] * self.bs + pos % self.bs
                self.kv[slot] = tok
            if item.is_last_chunk:
                sampled[item.request_id] = data.draw(TOKENS, label="sampled")
                if data.draw(st.integers(0, 9), label="stop") == 0:
                    finished[item.request_id] = SequenceStatus.FINISHED_STOPPED
        done = self.sched.update(out, sampled, finished)
        for rid, tok in sampled.items():
            if self.seqs[rid].status is not SequenceStatus.FINISHED_ABORTED:
                self.tokens[rid].append(tok)
        for seq in done:
            assert seq.all_token_ids == self.tokens[seq.request_id]
            self._forget(seq.request_id)
        # As the engine does for n > 1: branches fork off right after the prompt's last chunk.
        for item in out.scheduled:
            if (item.is_last_chunk and item.seq in self._forkable()
                    and data.draw(st.booleans(), label="fork now")):
                self._fork(item.seq)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), how=st.sampled_from(["abort", "finish"]))
    def end(self, data, how):
        rid = data.draw(st.sampled_from(sorted(self.seqs)), label=how)
        if how == "abort":
            assert self.sched.abort(rid)
        else:
            self.sched.finish(self.seqs[rid], SequenceStatus.FINISHED_STOPPED)
        self._forget(rid)

    @precondition(lambda self: any(self._forkable()))
    @rule(data=st.data())
    def fork(self, data):
        self._fork(data.draw(st.sampled_from(self._forkable()), label="fork"))

    def _fork(self, parent):
        rid = f"r{self.next_id}"
        self.next_id += 1
        child = Sequence(rid, parent.prompt_token_ids, parent.sampling_params,
                         cache_salt=parent.cache_salt, output_token_ids=parent.output_token_ids)
        self.sched.fork(parent, child, parent.num_computed_tokens)
        self.seqs[rid], self.tokens[rid] = child, list(self.tokens[parent.request_id])

    def _forkable(self):
        # The engine forks a branch off a parent whose prompt is computed (its last token
        # waits), exactly like here.
        return [s for s in self.seqs.values() if s.num_reserved_slots >= 2
                and s in self.sched.running and s.num_uncomputed_tokens == 1]

    def _forget(self, rid):
        del self.seqs[rid], self.tokens[rid]

    # ---- invariants -----------------------------------------------------

    @invariant()
    def kv_holds_every_computed_token(self):
        for rid, seq in self.seqs.items():
            assert seq.all_token_ids == self.tokens[rid], rid
            assert seq.num_computed_tokens <= len(seq.block_table) * self.bs
            for pos in range(seq.num_computed_tokens):
                slot = seq.block_table[pos // self.bs] * self.bs + pos % self.bs
                assert self.kv.get(slot) == self.tokens[rid][pos], (rid, pos, seq)

    @invariant()
    def refcounts_match_tables(self):
        bm = self.sched.block_manager
        refs = [0] * bm.num_blocks
        for seq in self.seqs.values():
            assert len(set(seq.block_table)) == len(seq.block_table), seq
            assert NULL_BLOCK not in seq.block_table, seq
            if seq in self.sched.waiting:
                assert not seq.block_table, seq  # waiting (or preempted) holds nothing
            for block in seq.block_table:
                refs[block] += 1
        assert [bm.ref_count(b) for b in range(bm.num_blocks)] == refs
        used = {b for b in range(1, bm.num_blocks) if refs[b]}
        free = set(bm._free)
        cached_free = set(bm.cache.evictable)
        assert len(free) == len(bm._free), "a block is on the free list twice"
        assert not free & used and not cached_free & used and not free & cached_free
        assert len(used) + len(free) + len(cached_free) == bm.num_usable_blocks, "leak"
        assert bm.num_used_blocks == len(used)
        assert set(bm.cache.hash_of) <= used | cached_free
        assert len(self.sched.running) + len(self.sched.waiting) == len(self.seqs)
        assert sum(s.num_reserved_slots for s in self.sched.running) <= 4

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        # Run what is left to its end (every request has a bounded max_tokens), then check
        # that nothing holds a block.
        for _ in range(10 * MAX_MODEL_LEN * max(1, len(self.seqs))):
            if not self.sched.has_unfinished():
                break
            out = self.sched.schedule()
            sampled = {i.request_id: 0 for i in out.scheduled if i.is_last_chunk}
            self.sched.update(out, sampled)
        assert not self.sched.has_unfinished(), "requests never finished"
        bm = self.sched.block_manager
        assert bm.num_used_blocks == 0
        assert all(bm.ref_count(b) == 0 for b in range(bm.num_blocks))
        assert bm.num_free_blocks == bm.num_usable_blocks


SchedulerMachine.TestCase.settings = settings.get_profile(PROFILE)
test_scheduler_state_machine = SchedulerMachine.TestCase
