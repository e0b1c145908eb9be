"""Speculative decoding's host pieces: config, n-gram drafter, acceptance, block truncation.

The n-gram drafter is checked against a brute-force scan of the whole sequence; the block
manager's truncation against its own invariant checker and the prefix cache's contents.
"""

import json
import random

import pytest

from jaxserve.config import EngineConfig
from jaxserve.core.block_manager import BlockManager
from jaxserve.core.sequence import PLACEHOLDER, Sequence
from jaxserve.core.spec_decode.acceptance import AcceptanceWindow, accepted_length
from jaxserve.core.spec_decode.config import SpeculativeConfig
from jaxserve.core.spec_decode.ngram import NgramProposer
from jaxserve.core.spec_decode.speculator import Speculator


def test_config_forms_and_errors():
    want = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    assert EngineConfig(speculative_config={"method": "ngram",
                                            "num_speculative_tokens": 3}).speculative_config == want
    assert SpeculativeConfig.parse(json.dumps({"num_speculative_tokens": 3})) == want
    assert SpeculativeConfig.parse({"model": "x"}).method == "draft_model"
    for bad, word in [({"method": "eagle"}, "method"), ({"num_speculative_tokens": 0}, ">= 1"),
                      ({"prompt_lookup_min": 5, "prompt_lookup_max": 2}, "<="),
                      ({"method": "draft_model"}, "model"), ({"k": 2}, "unknown keys"),
                      ("{not json", "JSON"), ({"num_speculative_tokens": 16}, "<= 15")]:
        with pytest.raises(ValueError, match=word):
            EngineConfig(speculative_config=bad)


def brute_force(tokens, min_n, max_n, k):
    """The proposal by definition: what followed the longest suffix n-gram's latest earlier
    occurrence, copied token by token from the sequence extended by the copy (LZ77)."""
    last = len(tokens) - 1
    for n in range(min(max_n, last), min_n - 1, -1):
        suffix = tokens[last - n + 1:]
        for end in range(last - 1, n - 2, -1):  # latest occurrence ending before the last
            if tokens[end - n + 1:end + 1] == suffix:
                ext = list(tokens)
                for i in range(k):
                    ext.append(ext[end + 1 + i])
                return ext[len(tokens):]
    return []


@pytest.mark.parametrize("tokens,min_n,max_n,k,want", [
    ([9, 1, 2, 3, 1, 2, 3], 2, 3, 5, [1, 2, 3, 1, 2]),  # a loop of period 3 drafts k = 5
    ([9, 5, 1, 2, 1, 2], 2, 2, 4, [1, 2, 1, 2]),  # period 2
    ([4, 7, 7, 7], 1, 1, 3, [7, 7, 7]),  # period 1
    ([8, 1, 2, 3, 4, 1, 2], 2, 2, 6, [3, 4, 1, 2, 3, 4]),  # 4 known tokens, then its own
    ([1, 2, 3, 4, 5, 1, 2], 2, 4, 2, [3, 4]),  # room enough: the known tokens only
    ([1, 2, 3, 4], 2, 4, 3, []),  # no earlier occurrence
])
def test_ngram_draft_continues_from_itself_in_loops(tokens, min_n, max_n, k, want):
    # Hand-written: a repetition loop shorter than k still drafts k tokens.
    assert NgramProposer(min_n, max_n).propose(Sequence("s", tokens, None), k) == want


@pytest.mark.parametrize("min_n,max_n", [(1, 1), (1, 3), (2, 4), (3, 5)])
def test_ngram_matches_brute_force_as_tokens_grow(min_n, max_n):
    rng = random.Random(min_n * 10 + max_n)
    proposer = NgramProposer(min_n, max_n)
    found = 0
    for trial in range(6):
        seq = Sequence(str(trial), [rng.randrange(5) for _ in range(3)], None)
        for _ in range(60):  # incremental: one index per sequence, extended step by step
            k = rng.randrange(1, 6)
            tokens = seq.all_token_ids
            got = proposer.propose(seq, k)
            assert got == brute_force(tokens, min_n, max_n, k), (tokens, k)
            found += bool(got)
            seq.append_token(rng.randrange(5) if rng.random() < 0.7 else tokens[-3])
    assert found > 50  # the test exercises matches, not only misses


def test_accepted_length_and_window():
    assert accepted_length([1, 2, 3], [1, 2, 3, 9]) == 3
    assert accepted_length([1, 2, 3], [1, 5, 3, 9]) == 1
    assert accepted_length([1], [2, 4]) == 0
    w = AcceptanceWindow(window=2, threshold=0.25)
    assert not w.record(4, 0)  # not a full window yet
    assert w.record(4, 1)  # 1 of 8
    w = AcceptanceWindow(window=2, threshold=0.25)
    assert not any(w.record(4, 2) for _ in range(10))
    # The window holds rows, whatever their drafts: 4 rows of 8 drafted tokens are not a
    # full window of 8 rows (they were one of 32 drafted tokens).
    w = AcceptanceWindow(window=8, threshold=0.2)
    assert not any(w.record(8, 0) for _ in range(4))
    assert not any(w.record(8, 8) for _ in range(2))
    assert not any(w.record(8, 0) for _ in range(6))  # 16 of 64 (25%) in each full window
    assert w.record(8, 0)  # the first 8-accepted row left: 8 of 64 (12.5%)
    # ... and the oldest row leaves as a new one comes: 9 of 40 (22%), not 9 of 48.
    w = AcceptanceWindow(window=5, threshold=0.2)
    for d, a in [(8, 0), (8, 1), (8, 1), (8, 1), (8, 1)]:
        low = w.record(d, a)
    assert low and not w.record(8, 5)


def test_truncate_returns_tail_blocks_and_keeps_the_cache_clean():
    bm = BlockManager(num_blocks=16, block_size=4, enable_caching=True)
    seq = Sequence("a", list(range(10)), None)
    bm.allocate(seq)  # 10 tokens: 3 blocks
    seq.num_computed_tokens = 10
    bm.register_computed(seq)  # blocks 0, 1 are full and cached
    seq.output_token_ids.extend([50, 51, 52, 53, 54, 55])  # a drafted row's tokens
    bm.allocate(seq, 6)
    assert len(seq.block_table) == 4
    free = bm.num_free_blocks
    del seq.output_token_ids[-5:]  # 1 accepted: 11 tokens, 11 computed
    seq.num_computed_tokens = 11
    assert bm.truncate(seq) == 1
    assert len(seq.block_table) == 3 and bm.num_free_blocks == free + 1
    bm.register_computed(seq)
    bm.check_invariants()
    assert bm.num_cached_blocks == 2  # no block holding drafts was registered


def test_ngram_drafts_from_known_tokens_only():
    # With asynchronous scheduling the last id may still be on the device (PLACEHOLDER): the
    # drafter continues the known tokens (a switched-off sequence's proposals are scored so).
    seq = Sequence("s", [1, 2, 3, 1], None)
    seq.append_token(2)
    seq.append_token(PLACEHOLDER)
    assert NgramProposer(2, 2).propose(seq, 3) == [3, 1, 2]


class _Params:
    def __init__(self, max_tokens):
        self.max_tokens = max_tokens


@pytest.mark.parametrize("score_while_off", [True, False])
def test_switched_off_sequence_resumes_once_its_drafts_score_well(score_while_off):
    # The target's tokens are 100, 101, ...; the drafter is wrong (999s) until output position
    # 10, then right. k = 2, a window of 2 rows at threshold 0.5.
    def proposer(seqs, limits):
        out = []
        for seq, k in zip(seqs, limits):
            n = seq.num_known_tokens - 3  # output position the draft starts at
            out.append([100 + n + i for i in range(k)] if n >= 10 else [999] * k)
        return out
    config = SpeculativeConfig(num_speculative_tokens=2, disable_window=2,
                               disable_threshold=0.5)
    spec = Speculator(config, proposer, max_model_len=1000, score_while_off=score_while_off)
    seq = Sequence("s", [1, 2, 3], _Params(30))
    seq.append_token(100)  # the prefill's token
    seq.num_computed_tokens = 3
    rows = []  # (output position, drafted, accepted) of each verified row
    while len(seq.output_token_ids) < 20:  # the engine's steps
        spec.score_off()
        n = len(seq.output_token_ids)
        drafted = spec.propose([seq], budget=100).get("s", 0)
        a = 0
        if drafted:
            a = spec.verify(seq, [100 + n + i for i in range(drafted + 1)])
            rows.append((n, drafted, a))
        for _ in range(a + 1):
            seq.append_token(100 + len(seq.output_token_ids))
        seq.num_computed_tokens = seq.num_tokens - 1
    if not score_while_off:  # off after two wrong rows, for good
        assert rows == [(1, 2, 0), (2, 2, 0)]
        return
    # Off after the rows at 1 and 2; the proposals at 3..9 score 0 of 2 each; the one at 10
    # scores 2 of 2 once tokens 10 and 11 are known: back on at 12, where it drafts again.
    assert rows == [(1, 2, 0), (2, 2, 0), (12, 2, 2), (15, 2, 2), (18, 2, 2)]
    assert spec.totals.num_disabled == 1 and spec.totals.num_resumed == 1
    assert spec.totals.num_draft_tokens == 10  # proposals scored while off are not counted
