"""The runner's two ways of gathering a step's rows: the general loop (`_rows`) and the
columns of steady decoding (`_decode_rows`) agree on the rows and on the page table."""

import types

import numpy as np

from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.scheduler import ScheduledSeq
from jaxserve.core.sequence import PLACEHOLDER, Sequence
from jaxserve.runtime import step_layout
from jaxserve.runtime.runner import ModelRunner


def _runner_state(seqs, bs):
    slot_of = {s.request_id: k for k, s in enumerate(reversed(seqs))}
    table = np.zeros((len(seqs) + 1, 8), np.int32)
    for s in seqs:  # the host table as an earlier step left it
        table[slot_of[s.request_id], :len(s.block_table)] = s.block_table
    return types.SimpleNamespace(slot_of=slot_of, block_size=bs, page_table=table)


def test_decode_columns_match_the_general_rows():
    bs = 4
    seqs = []
    for k, (prompt, out) in enumerate([(5, 0), (3, 2), (7, 4), (1, 0), (4, 9)]):
        params = SamplingParams(max_tokens=20, logprobs=2 if k == 2 else None)
        s = Sequence(f"s{k}", list(range(10, 10 + prompt)), params)
        for j in range(out):
            s.append_token(PLACEHOLDER if j == out - 1 and k % 2 else 100 + j)
        s.block_table = [20 + 8 * k + b for b in range(-(-s.num_tokens // bs))]
        s.num_computed_tokens = s.num_tokens - 1  # one token left: a decode
        seqs.append(s)
    items = [ScheduledSeq(s, 1, s.num_computed_tokens, False, True) for s in seqs]
    general, columns = _runner_state(seqs, bs), _runner_state(seqs, bs)
    # Copy-on-write replaced the block two of them write into since the last step.
    for s in (seqs[1], seqs[4]):
        s.block_table[-1] += 500
    rows, lens, want = ModelRunner._rows(general, items, new=set())
    cols, col_lens, col_want = ModelRunner._decode_rows(columns, items)
    assert isinstance(cols, step_layout.Columns)
    assert list(cols.slots) == [r.slot for r in rows]
    assert list(cols.starts) == [r.start for r in rows]
    assert list(cols.tokens) == [r.tokens[0] for r in rows] and all(len(r.tokens) == 1
                                                                     for r in rows)
    assert col_lens == lens == [1] * len(items) and col_want is want is True
    assert np.array_equal(columns.page_table, general.page_table)
    # Both wrote the replaced blocks (an independent check of the shared expectation).
    for s in (seqs[1], seqs[4]):
        assert columns.page_table[columns.slot_of[s.request_id], len(s.block_table) - 1] \
            == s.block_table[-1]
