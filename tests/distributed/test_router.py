"""The replica router (jaxserve/distributed/router.py) and the pool's stats sum: plain Python."""

from __future__ import annotations

import pytest

from jaxserve.core.prefix_cache import block_hashes
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.sequence import Sequence
from jaxserve.distributed.pool import pool_stats
from jaxserve.distributed.router import ReplicaRouter, prompt_hashes

BLOCK = 4


def _prompt(seed: int, n: int, prefix=()) -> list[int]:
    return list(prefix) + [(seed * 31 + 7 * i) % 97 + 3 for i in range(n)]


@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_prompt_hashes_are_the_replica_prefix_cache_hashes(salt):
    ids = _prompt(1, 3 * BLOCK + 2)
    seq = Sequence("r", ids, SamplingParams(), cache_salt=salt)
    assert prompt_hashes(ids, BLOCK, salt) == block_hashes(seq, BLOCK)
    assert len(prompt_hashes(ids, BLOCK, salt)) == 3
    assert prompt_hashes(ids, BLOCK, salt) != prompt_hashes(ids, BLOCK, "other")


def test_a_shared_prefix_goes_where_it_went_before():
    r = ReplicaRouter(["a", "b"], "prefix", BLOCK, slack=4)
    sys_x, sys_y = _prompt(1, 4 * BLOCK), _prompt(2, 4 * BLOCK)
    home_x = r.choose([_prompt(10, 3, sys_x)])
    r.done(home_x)
    home_y = r.choose([_prompt(11, 3, sys_y)])  # nothing cached: the other, by rotation
    r.done(home_y)
    assert home_x != home_y
    for user in range(6):
        for sys_prompt, home in ((sys_x, home_x), (sys_y, home_y)):
            got = r.choose([_prompt(20 + user, 3, sys_prompt)])
            r.done(got)
            assert got == home


def test_a_hot_prefix_spills_over_when_its_replica_is_too_loaded():
    r = ReplicaRouter(["a", "b"], "prefix", BLOCK, slack=2)
    hot = _prompt(1, 4 * BLOCK)
    homes = [r.choose([_prompt(u, 2, hot)]) for u in range(6)]  # none finishes
    # The home takes requests until it is `slack` ahead of the idle one, then both share.
    assert homes[:3] == [homes[0]] * 3 and set(homes) == {"a", "b"}
    loads = {n: s["load"] for n, s in r.snapshot().items()}
    assert abs(loads["a"] - loads["b"]) <= 2


def test_round_robin_and_least_loaded():
    rr = ReplicaRouter(["a", "b", "c"], "round_robin", BLOCK)
    assert [rr.choose([[1, 2]]) for _ in range(6)] == ["a", "b", "c"] * 2
    ll = ReplicaRouter(["a", "b"], "least_loaded", BLOCK)
    first = ll.choose([[1]])
    second = ll.choose([[1]])
    assert {first, second} == {"a", "b"}
    ll.done(first)
    assert ll.choose([[1]]) == first  # the only one with nothing in flight


def test_down_replicas_get_nothing_and_a_restart_forgets_its_cache():
    r = ReplicaRouter(["a", "b"], "prefix", BLOCK)
    sys_prompt = _prompt(3, 4 * BLOCK)
    home = r.choose([sys_prompt])
    r.done(home)
    other = "b" if home == "a" else "a"
    r.mark_down(home)
    assert {r.choose([sys_prompt]) for _ in range(4)} == {other}
    r.mark_down(other)
    assert r.choose([sys_prompt]) is None
    r.mark_up(home, fresh=True)
    assert r.snapshot()[home]["indexed_blocks"] == 0
    r.mark_up(other)
    assert r.snapshot()[other]["indexed_blocks"] == 4  # it cached the prompt meanwhile


def test_the_index_forgets_past_the_replica_block_count():
    r = ReplicaRouter(["a"], "prefix", BLOCK)
    r.set_capacity("a", 6)
    for seed in range(5):
        r.done(r.choose([_prompt(seed, 4 * BLOCK)]))
    assert r.snapshot()["a"]["indexed_blocks"] == 6


def test_bad_router_settings_are_refused_with_the_choices():
    with pytest.raises(ValueError, match="prefix, round_robin, least_loaded"):
        ReplicaRouter(["a"], "random")
    with pytest.raises(ValueError, match="at least one replica"):
        ReplicaRouter([], "prefix")


def test_pool_stats_sum_counters_and_keep_shared_settings():
    one = {"running": 2, "waiting": 1, "kv_blocks_total": 100, "kv_blocks_free": 60,
           "block_size": 16, "prefix_caching": True, "prefix_cache_hits_blocks": 5,
           "step_totals": {"num_steps": 9}, "last_step": None}
    two = dict(one, running=1, waiting=0, kv_blocks_free=100, prefix_cache_hits_blocks=7)
    s = pool_stats({"r0": one, "r1": two})
    assert (s["running"], s["waiting"]) == (3, 1)
    assert (s["kv_blocks_total"], s["kv_blocks_free"]) == (200, 160)
    assert s["prefix_cache_hits_blocks"] == 12
    assert s["block_size"] == 16 and s["prefix_caching"] is True
    assert "step_totals" not in s and s["replicas"] == {"r0": one, "r1": two}
    assert pool_stats({})["running"] == 0  # before the first poll: zeros, not a KeyError
