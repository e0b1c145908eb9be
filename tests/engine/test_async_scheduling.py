"""Asynchronous scheduling gives the synchronous loop's outputs, token for token.

With `async_scheduling` the engine schedules and launches step N+1 before it fetches step N's
ids (a placeholder stands for each id step N samples), so outputs come back one `step()` call
later and a sequence that stopped runs one extra token, which is dropped. The same workload run
both ways, with the same seeds, must give the same token ids, finish reasons, logprobs and
texts. Sampling draws are keyed by (seed, position) and argmax is stable on these fp32 models,
so different batching or preemption between the two runs cannot change a token. Logprobs are
compared to 1e-5 (1e-4 on the real model): they move in the last float32 bits with the batch a
row runs in (the same request alone and inside a workload differ so in either mode), and the
two modes batch differently (a stopped sequence runs one extra, dropped token in async).
"""

import math

import pytest

from compile_guard import count_compiles
from jaxserve import EngineConfig, LLMEngine, SamplingParams
from jaxserve.core.sequence import PLACEHOLDER
from jaxserve.testing.tiny_chat import tiny_chat_model

EOS = 0  # the tiny tokenizer's <|endoftext|>
STOP_IDS = tuple(range(40, 56))  # 16 ids: a 256-token random model samples one soon enough
PREFIX = [17, 33, 94, 120, 8, 61, 202, 45, 77, 150, 9, 230, 64, 5, 99, 180, 27, 140]


@pytest.fixture(scope="module")
def model():
    return tiny_chat_model(seed=3)


def make_engine(model, async_scheduling, **kw):
    kw = dict(block_size=16, max_num_seqs=6, max_model_len=96, max_num_batched_tokens=48,
              warmup=False, seed=11) | kw
    return LLMEngine(EngineConfig(model="tiny-chat", async_scheduling=async_scheduling, **kw),
                     model=model)


def kv_memory(model, num_tokens):
    """A KV budget of `num_tokens` token slots (the cache's null block comes out of it)."""
    return num_tokens * model.config.kv_bytes_per_token(4)


def workload():
    """(arrival call, request id, prompt, params, abort after this many output tokens or None)."""
    sampled = dict(temperature=0.9, top_p=0.9, top_k=50)
    reqs = [
        (0, "greedy", PREFIX + [3, 4, 5], SamplingParams(temperature=0, max_tokens=20,
                                                          ignore_eos=True), None),
        (0, "seeded", PREFIX + [6], SamplingParams(**sampled, seed=7, max_tokens=24,
                                                    logprobs=2), None),
        (0, "one", [9, 8, 7], SamplingParams(temperature=0, max_tokens=1), None),
        (1, "two", [1, 2, 3, 4], SamplingParams(temperature=1.0, seed=3, max_tokens=2), None),
        (1, "stop-ids", PREFIX[:10] + [11], SamplingParams(temperature=1.0, seed=5,
                                                           max_tokens=40, stop_token_ids=STOP_IDS,
                                                           logprobs=1), None),
        (2, "stop-str", [70, 71, 72, 73, 74], SamplingParams(temperature=1.0, seed=9,
                                                             max_tokens=40, stop=["e", "o"],
                                                             ignore_eos=True),
         None),
        (2, "penalties", PREFIX + [200], SamplingParams(
            temperature=0.8, seed=13, max_tokens=24, repetition_penalty=1.3,
            presence_penalty=0.4, frequency_penalty=0.3, min_tokens=6,
            stop_token_ids=STOP_IDS[:4]), None),
        (3, "aborted", [50, 60, 70, 80, 90], SamplingParams(temperature=0, max_tokens=30,
                                                            ignore_eos=True), 5),
        (3, "n3", PREFIX + [1], SamplingParams(n=3, temperature=1.0, seed=21, max_tokens=12,
                                               logprobs=1), None),
        (4, "beam", [101, 102, 103, 104], SamplingParams(use_beam_search=True, beam_width=3,
                                                         n=2, max_tokens=8, ignore_eos=True),
         None),
        (5, "late", PREFIX + [3, 4, 5], SamplingParams(**sampled, seed=31, max_tokens=16,
                                                       min_tokens=16), None),
        (9, "later", [5, 4, 3, 2, 1], SamplingParams(temperature=0, max_tokens=18), None),
        (10, "chunked", [(7 * i) % 250 + 3 for i in range(60)],  # > the 48-token budget
         SamplingParams(temperature=0.7, seed=17, max_tokens=10), None),
    ]
    return reqs


def run(engine, reqs, check=True):
    """Runs `reqs` to the end; returns request id -> its last output's completions.

    A request with an abort count is aborted between step() calls as soon as its output holds
    that many tokens, which is the same point in both modes (async learns it one call later).
    """
    last, aborted, call = {}, set(), 0
    pending = sorted(reqs, key=lambda r: r[0])
    bm = engine.scheduler.block_manager
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= call:
            _, rid, prompt, params, _ = pending.pop(0)
            engine.add_request(rid, prompt, params)
        for out in engine.step():
            assert out.request_id not in aborted, f"{out.request_id} output after its abort"
            last[out.request_id] = out
        call += 1
        bm.check_invariants()
        for _, rid, _, _, abort_at in reqs:
            if abort_at is not None and rid not in aborted and rid in last and \
                    len(last[rid].outputs[0].token_ids) >= abort_at:
                assert engine.abort(rid)
                aborted.add(rid)
        assert call < 500, "the engine does not finish"
    stats = engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"], "blocks leaked"
    assert stats["running"] == stats["waiting"] == 0 and not engine.requests
    assert not engine.runner.slot_of, "runner slots leaked"
    assert not engine.has_unfinished_requests()
    assert {r[1] for r in reqs} <= set(last)
    return {rid: [(c.token_ids, c.finish_reason, c.stop_reason, c.text, c.logprobs,
                   c.cumulative_logprob) for c in out.outputs]
            for rid, out in last.items()}


def assert_same(got, want, tol=1e-5):
    """Token ids, finish and stop reasons and texts exactly; logprobs to float noise."""
    def close(a: float, b: float) -> bool:
        return math.isclose(a, b, rel_tol=tol, abs_tol=tol)

    assert got.keys() == want.keys()
    for rid in want:
        assert len(got[rid]) == len(want[rid]), rid
        for g, w in zip(got[rid], want[rid]):
            assert g[:4] == w[:4], rid
            assert close(g[5], w[5]), (rid, g[5], w[5])
            assert (g[4] is None) == (w[4] is None), rid
            for gp, wp in zip(g[4] or (), w[4] or ()):
                assert gp.keys() == wp.keys() and all(close(gp[t], wp[t]) for t in wp), rid


def check_workload_covered(result):
    """The workload exercises what it claims to: stops by id and string, both max_tokens."""
    (ids, reason, stop, *_), = result["stop-ids"]
    assert reason == "stop" and stop in STOP_IDS
    (ids, reason, stop, *_), = result["stop-str"]
    assert reason == "stop" and stop in ("e", "o")
    assert len(result["one"][0][0]) == 1 and len(result["two"][0][0]) == 2
    assert len(result["aborted"][0][0]) == 5
    assert len(result["n3"]) == 3 and len(result["beam"]) == 2
    assert len(result["late"][0][0]) == 16  # min_tokens = max_tokens: no early stop


@pytest.mark.parametrize("block_size,prefix_caching,kv_tokens", [
    (16, False, 2048), (16, True, 2048), (1, False, 2048), (1, True, 2048),
    (16, True, 112), (1, False, 110),
], ids=["bs16", "bs16-prefix", "bs1", "bs1-prefix", "bs16-prefix-preempt", "bs1-preempt"])
def test_async_matches_sync(model, block_size, prefix_caching, kv_tokens):
    results, stats = {}, {}
    for mode in (True, False):
        engine = make_engine(model, mode, block_size=block_size,
                             enable_prefix_caching=prefix_caching,
                             kv_cache_memory=kv_memory(model, kv_tokens))
        results[mode] = run(engine, workload())
        stats[mode] = engine.stats()
    check_workload_covered(results[False])
    assert_same(results[True], results[False])
    preempt = kv_tokens < 1000
    for mode in (True, False):
        assert (stats[mode]["num_preemptions"] > 0) == preempt, stats[mode]["num_preemptions"]
        if prefix_caching:
            assert stats[mode]["prefix_cache_hits_blocks"] > 0


def test_no_compiles_after_warmup(model):
    results = {}
    for mode in (True, False):
        engine = make_engine(model, mode, max_num_seqs=4, max_num_batched_tokens=32,
                             enable_prefix_caching=True, warmup=True,
                             kv_cache_memory=kv_memory(model, 112))
        with count_compiles() as events:
            results[mode] = run(engine, workload())
        assert events == []
        assert engine.stats()["num_compiles_after_warmup"] == 0
        assert engine.stats()["num_preemptions"] > 0
    assert_same(results[True], results[False])


def test_id_reused_right_after_abort(model):
    """An aborted request's in-flight step must not feed its id to a new request that took
    the same request id before that step's ids arrived."""
    first = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    second = SamplingParams(temperature=1.0, seed=8, max_tokens=6, ignore_eos=True, logprobs=1)
    results = {}
    for mode in (True, False):
        engine = make_engine(model, mode)
        engine.add_request("x", [1, 2, 3, 4], first)
        seen = 0
        while seen < 3:
            seen = max([len(o.outputs[0].token_ids) for o in engine.step()] + [seen])
        assert engine.abort("x")
        engine.add_request("x", [9, 9, 9], second)
        results[mode] = run(engine, [])
    assert_same(results[True], results[False])
    assert len(results[False]["x"][0][0]) == 6


# ---- the async path really overlaps ---------------------------------------------------------

def spy_schedule(engine):
    """Records, at every schedule(), the running sequences whose last token is a placeholder."""
    seen = []
    schedule = engine.scheduler.schedule

    def spy():
        seen.append({s.request_id for s in engine.scheduler.running
                     if s.output_token_ids and s.output_token_ids[-1] == PLACEHOLDER})
        return schedule()

    engine.scheduler.schedule = spy
    return seen


def test_outputs_come_one_call_later(model):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    per_call = {}
    for mode in (True, False):
        engine = make_engine(model, mode)
        seen = spy_schedule(engine)
        engine.add_request("r", [5, 6, 7, 8], params)
        calls = []
        while engine.has_unfinished_requests():
            calls.append([len(o.outputs[0].token_ids) for o in engine.step()])
        per_call[mode] = calls, seen
    (async_calls, async_seen), (sync_calls, sync_seen) = per_call[True], per_call[False]
    assert sync_calls == [[1], [2], [3], [4], [5], [6]]
    # The first call only launches; each later one returns the previous step's ids.
    assert async_calls == [[]] + sync_calls
    # Calls 2..7 scheduled while the step before them ran: "r" held a placeholder.
    assert async_seen[1:] == [{"r"}] * 6 and not any(sync_seen)


def test_beam_steps_go_synchronous(model):
    """A beam decides on its ids, so the step after one of its steps is scheduled only once
    they are known (no placeholder anywhere then); a plain request beside it is async again
    once the beam is done, and all outputs match the synchronous loop."""
    reqs = [(0, "beam", [101, 102, 103, 104], SamplingParams(
                use_beam_search=True, beam_width=2, max_tokens=5, ignore_eos=True), None),
            (0, "plain", [1, 2, 3], SamplingParams(temperature=0, max_tokens=14,
                                                   ignore_eos=True), None)]
    results, seen = {}, {}
    for mode in (True, False):
        engine = make_engine(model, mode)
        seen[mode] = spy_schedule(engine)
        results[mode] = run(engine, reqs)
    assert_same(results[True], results[False])
    assert not any(seen[False])
    beam_calls = 6  # prefill + 5 decodes; beams' steps are scheduled after their ids
    assert not any(seen[True][:beam_calls])
    assert {"plain"} in seen[True][beam_calls:]


def test_n_branches_fork_synchronously_then_run_async(model):
    reqs = [(0, "n2", [7, 7, 7, 7], SamplingParams(n=2, temperature=1.0, seed=4, max_tokens=6,
                                                   ignore_eos=True), None)]
    results, seen = {}, {}
    for mode in (True, False):
        engine = make_engine(model, mode)
        seen[mode] = spy_schedule(engine)
        results[mode] = run(engine, reqs)
    assert_same(results[True], results[False])
    # The prefill forks the branches on its ids: the step after it waits for them; the
    # branches' own decodes then overlap.
    assert seen[True][1] == set()
    assert any(len(s) == 2 for s in seen[True][2:])


# ---- the real model -------------------------------------------------------------------------

def test_real_model_async_matches_sync(smollm2_fp32):
    model = smollm2_fp32
    tok = model.tokenizer
    prompts = {"a": "The capital of France is", "b": "Once upon a time",
               "c": "1, 2, 3, 4,", "d": "def add(a, b):\n    return"}
    newline = tok.encode("\n")[-1]
    reqs = [
        (0, "a", tok.encode(prompts["a"]), SamplingParams(temperature=0, max_tokens=14,
                                                          stop=["."]), None),
        (0, "b", tok.encode(prompts["b"]), SamplingParams(temperature=0.8, top_p=0.9, seed=2,
                                                          max_tokens=14, logprobs=1), None),
        (1, "c", tok.encode(prompts["c"]), SamplingParams(temperature=0, max_tokens=14), 4),
        (2, "d", tok.encode(prompts["d"]), SamplingParams(temperature=1.0, seed=5,
                                                          max_tokens=14,
                                                          stop_token_ids=(newline,)), None),
    ]
    per_token = model.config.kv_bytes_per_token(4)
    results, stats = {}, {}
    for mode in (True, False):
        engine = LLMEngine(EngineConfig(
            model=model.source, dtype=model.dtype, async_scheduling=mode, warmup=False,
            block_size=8, max_num_seqs=4, max_model_len=40, max_num_batched_tokens=32,
            kv_cache_memory=6 * 8 * per_token), model=model)  # 5 blocks: max_model_len's
        results[mode] = run(engine, reqs)
        stats[mode] = engine.stats()
    assert_same(results[True], results[False], tol=1e-4)
    want = results[False]
    assert want["a"][0][1:3] == ("stop", ".") and want["d"][0][1:3] == ("stop", newline)
    assert len(want["c"][0][0]) == 4
    for mode in (True, False):
        assert stats[mode]["num_preemptions"] > 0


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_requests_that_wait_for_ids_are_forgotten_when_they_end(model, async_scheduling):
    """The registry behind _can_commit's fast path (beams, forks, grammars) holds its requests
    while they may wait for ids and none once they end, in both loops: the synchronous loop
    never asks _can_commit, and a stale entry would keep a request's state and token lists
    alive as long as the engine."""
    engine = make_engine(model, async_scheduling)
    engine.add_request("n2", [5, 6, 7], SamplingParams(n=2, temperature=1.0, seed=1,
                                                       max_tokens=6, ignore_eos=True))
    engine.add_request("beam", [8, 9], SamplingParams(use_beam_search=True, beam_width=2,
                                                      max_tokens=4, ignore_eos=True))
    assert engine.requests.waiting_for_ids() == {"n2", "beam"}
    finished = set()
    while engine.has_unfinished_requests():
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert finished == {"n2", "beam"}
    assert engine.requests.waiting_for_ids() == set()


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_an_aborted_sequence_gives_its_slot_back(model, async_scheduling):
    """The runner frees slots only as the engine hands them over: with a step in flight the
    aborted sequence keeps its slot until the next plan (that step still writes it); with none
    in flight it is freed at once, so an idle engine holds no slot."""
    engine = make_engine(model, async_scheduling)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], params)
    engine.add_request("b", [8, 9], params)
    engine.step()
    assert set(engine.runner.slot_of) == {"a", "b"}
    engine.abort("a")
    assert set(engine.runner.slot_of) == ({"a", "b"} if async_scheduling else {"b"})
    engine.step()  # the next plan carries the release
    assert set(engine.runner.slot_of) == {"b"}
    engine.abort("b")
    while engine.has_unfinished_requests():
        engine.step()
    assert not engine.runner.slot_of
