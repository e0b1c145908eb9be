"""The block manager's KV-cache event log (core/kv_events.py), driven directly (plain Python).

What the log says is checked against the hashes recomputed here with hash_block over the
prompt's own blocks, and against what the test made the cache do (fill, evict, reset).
"""

from types import SimpleNamespace

from jaxserve.core.block_manager import BlockManager
from jaxserve.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventLog
from jaxserve.core.prefix_cache import hash_block
from jaxserve.core.sequence import Sequence

BS = 4


def make_seq(rid, prompt):
    return Sequence(rid, list(prompt), SimpleNamespace(max_tokens=8))


def chain(tokens, bs=BS):
    """Hashes of the full blocks of `tokens`, computed independently of the sequence."""
    hashes, parent = [], b""
    for i in range(0, len(tokens) - len(tokens) % bs, bs):
        parent = hash_block(parent, tokens[i:i + bs])
        hashes.append(parent)
    return hashes


def admit(bm, seq):
    """Allocates and 'computes' the whole prompt, then registers its full blocks."""
    bm.allocate(seq, None, bm.cached_prefix(seq))
    seq.num_computed_tokens = seq.num_tokens
    bm.register_computed(seq)
    bm.check_invariants()


def manager(num_blocks=1 + 8, log=True):
    return BlockManager(num_blocks, BS, enable_caching=True,
                        events=KVEventLog() if log else None)


def test_registered_blocks_are_stored_with_their_tokens_and_parent():
    bm = manager()
    prompt = list(range(10, 21))  # 2 full blocks and a partial one
    admit(bm, make_seq("a", prompt))
    hashes = chain(prompt)
    assert bm.events.drain() == [BlockStored(tuple(hashes), None, tuple(prompt[:8]), BS)]
    # A prompt sharing the first block: only its second, new block is news, child of the first.
    other = prompt[:4] + [99, 98, 97, 96, 95]
    admit(bm, make_seq("b", other))
    assert bm.events.drain() == [BlockStored((chain(other)[1],), hashes[0], (99, 98, 97, 96),
                                             BS)]
    assert bm.events.drain() == []


def test_a_duplicate_block_is_not_stored_twice():
    bm = manager()
    prompt = list(range(8)) + [1]
    # Both admitted before either computed: b misses the cache and computes its own copy.
    a, b = make_seq("a", prompt), make_seq("b", prompt)
    for seq in (a, b):
        bm.allocate(seq, None, bm.cached_prefix(seq))
    for seq in (a, b):
        seq.num_computed_tokens = seq.num_tokens
        bm.register_computed(seq)
    # b's blocks hold content a's already named: one store, from a.
    assert bm.events.drain() == [BlockStored(tuple(chain(prompt)), None, tuple(prompt[:8]), BS)]


def test_evictions_are_removed_and_reset_clears():
    bm = manager(num_blocks=1 + 4)
    first = list(range(100, 108)) + [1]  # 2 full blocks + 1 partial: 3 blocks
    a = make_seq("a", first)
    admit(bm, a)
    stored = bm.events.drain()
    assert [e.block_hashes for e in stored] == [tuple(chain(first))]
    bm.free(a)  # both full blocks stay cached (evictable)
    b = make_seq("b", list(range(200, 212)) + [2])  # needs 4 blocks: evicts both
    admit(bm, b)
    events = bm.events.drain()
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert removed == [BlockRemoved(tuple(chain(first)[::-1]))]  # the tail was freed first
    assert events.index(removed[0]) == 0  # evicted while allocating, before b's blocks stored
    assert bm.cache.num_evictions == 2
    bm.free(b)
    assert bm.reset_prefix_cache() == 3
    assert bm.events.drain() == [AllBlocksCleared()]


def test_a_partial_reset_names_what_left():
    bm = manager()
    kept, dropped = make_seq("k", list(range(9))), make_seq("d", list(range(50, 59)))
    admit(bm, kept), admit(bm, dropped)
    bm.events.drain()
    bm.free(dropped)
    assert bm.reset_prefix_cache() == 2
    # Blocks a running request holds stay cached: not everything was cleared.
    assert bm.events.drain() == [BlockRemoved(tuple(chain(list(range(50, 59)))[::-1]))]


def test_no_log_no_events():
    bm = manager(log=False)
    admit(bm, make_seq("a", list(range(9))))
    assert bm.events is None and len(bm.cache) == 2


def test_an_adapters_blocks_are_stored_with_its_id_under_their_own_hashes():
    bm = manager()
    prompt = list(range(10, 18))
    admit(bm, make_seq("base", prompt))
    base = bm.events.drain()
    seq = Sequence("lora", prompt, SimpleNamespace(max_tokens=8), lora_id=7)
    admit(bm, seq)
    [stored] = bm.events.drain()
    # Same tokens, another adapter: new blocks (not a hit on the base's), tagged with the id.
    assert stored.lora_id == 7 and base[0].lora_id is None
    assert stored.token_ids == tuple(prompt) and not set(stored.block_hashes) & set(
        base[0].block_hashes)
