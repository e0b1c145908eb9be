"""Fingerprint the engine's outputs, token for token, to compare two checkouts (before / after a
refactor of the engine internals).

    PYTHONPATH=$PWD .venv/bin/python scripts/output_fingerprint.py --out before.json
    (change the code, or run from another checkout with its own PYTHONPATH)
    PYTHONPATH=$PWD .venv/bin/python scripts/output_fingerprint.py --out after.json
    .venv/bin/python scripts/output_fingerprint.py --compare before.json after.json

Every case runs the real default model (smollm2-135m, float32 on CPU) through the public API
(`LLM`, `SamplingParams`, `LLMEngine`, `EngineConfig`, and `StructuredOutputs` for constrained
requests) and records, per request and completion: the prompt ids, the generated token ids, the
finish and stop reasons, the text, and (where asked for) the logprobs and cumulative logprob
rounded to 4 decimals. Sampled cases give every request its own seed, and every case starts
with an empty prefix cache, so a case's outputs depend neither on the run nor on the cases run
before it. A few engine counters (preemptions, prefix-cache hits, drafted tokens) are recorded
as well, to show that a case exercises what it names (`checks`, verified at capture); a
comparison reports counters that differ as notes, not as output differences. They are not
fixed run to run where a case holds constrained requests: each is admitted when its grammar,
compiled on a thread, is ready, so whether it hits a prefix another request is computing in the
same step depends on timing (its tokens do not: three runs gave equal outputs).

`--compare A B` prints one line per case (equal, or the first differing token of the first
request that differs) and exits 1 when any case's outputs differ, or a case is missing.

Which checkout is measured: a script run as `python scripts/x.py` imports `jaxserve` from
wherever the virtualenv's editable install points (the main checkout), not from the checkout
the script sits in. This script does not change sys.path; it refuses to run unless `jaxserve`
and `models` come from its own checkout (set PYTHONPATH to the checkout's root), and records
the paths and the git commit it measured. `--any-checkout` lifts the refusal.

The project imports stay inside functions: nothing of the project is imported at module level.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import platform
import subprocess
import sys
import time
from typing import Callable

REPO = pathlib.Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m"
# K and V bytes per token of smollm2-135m in float32 (30 layers x 3 KV heads x 64 x 2 x 4):
# sizes the preemption case's KV pool. Checked against the engine's own block count below.
KV_BYTES_PER_TOKEN_F32 = 46080
ROUND = 4

# ---- engines (EngineConfig fields; warmup off: compile only the shapes a case meets) -------

BASE = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, warmup=False)
ENGINES = {
    "base": BASE,
    "sync": BASE | dict(async_scheduling=False),
    "ngram": BASE | dict(speculative_config={"method": "ngram", "num_speculative_tokens": 4}),
    "draft": BASE | dict(speculative_config={"method": "draft_model", "model": MODEL,
                                             "num_speculative_tokens": 3}),
    # Steps of 16 tokens: a 100-token prompt prefills over 7 steps, beside decoding rows.
    "chunked": dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=256, warmup=False),
    # 8 blocks of 16 tokens (7 usable) for 4 sequences of up to ~45 tokens: preemption.
    "preempt": dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=96, warmup=False,
                    kv_cache_memory=8 * 16 * KV_BYTES_PER_TOKEN_F32),
}

# ---- prompts ---------------------------------------------------------------------------------

PLAIN = ["The capital of France is", "Once upon a time", "def add(a, b):\n    return",
         "Q: What is 2 + 2?\nA:"]
CODE = "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n"
REPETITIVE = [f"Repeat this code exactly:\n{CODE}\nRepeated:\n",
              "Copy the list: apples, pears, plums, figs. Copy: apples, pears,",
              "1, 2, 3, 4, 5, 6,", "The quick brown fox jumps over the lazy dog. The quick brown"]
LONG = ("Here is a short story about a lighthouse keeper. Every night the keeper climbed the "
        "one hundred and twelve steps of the tower, trimmed the wick, polished the great lens "
        "and watched the ships pass far out at sea. One winter a storm broke the glass of the "
        "lantern room, and the keeper had to decide whether to")
SYSTEM_PREFIX = ("You are a careful assistant. You answer in one short sentence, you never use "
                 "lists, you do not repeat the question, and you always end with a full stop. "
                 "Question: ")
PREFIX_SUFFIXES = ["Why is the sky blue?", "What do bees make?", "Where do penguins live?"]
CHAT_JSON = "Give me a JSON object with a person's name and age."
# Greedy, these end with EOS after 8 to 13 tokens: min_tokens=16 holds them longer.
CHAT_SHORT = ["What is 2+2? Reply with the number only.", "Say OK.", "Yes or no: is the sun hot?"]
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def chat(llm, text: str) -> str:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])


# ---- cases -----------------------------------------------------------------------------------
# A case is one generate() call on one engine: its requests, built from the loaded LLM (for the
# chat template), and the engine counters that must have moved for it to test what it names.

@dataclasses.dataclass
class Case:
    name: str
    engine: str
    requests: Callable  # (llm, SamplingParams, StructuredOutputs) -> [(prompt, params)]
    checks: tuple[str, ...] = ()  # engine counters that must have moved during the case
    record_logprobs: bool = False


def _seeded(SP, i, **kw):
    return SP(temperature=0.8, top_p=0.9, seed=1000 + i, **kw)


def cases() -> list[Case]:
    greedy = lambda SP, **kw: SP(temperature=0.0, **kw)  # noqa: E731
    out = [
        Case("greedy_async", "base",
             lambda llm, SP, SO: [(p, greedy(SP, max_tokens=24)) for p in PLAIN]),
        Case("greedy_sync", "sync",
             lambda llm, SP, SO: [(p, greedy(SP, max_tokens=24)) for p in PLAIN]),
        Case("seeded_async", "base",
             lambda llm, SP, SO: [(p, _seeded(SP, i, max_tokens=24)) for i, p in enumerate(PLAIN)]),
        Case("seeded_sync", "sync",
             lambda llm, SP, SO: [(p, _seeded(SP, i, max_tokens=24)) for i, p in enumerate(PLAIN)]),
        Case("seeded_filters_penalties", "base",
             lambda llm, SP, SO: [(p, SP(temperature=0.7, top_k=40, min_p=0.05, seed=2000 + i,
                                         repetition_penalty=1.2, presence_penalty=0.5,
                                         frequency_penalty=0.3, max_tokens=24))
                                  for i, p in enumerate(PLAIN)]),
        Case("n3_seeded", "base",
             lambda llm, SP, SO: [(p, _seeded(SP, i, n=3, max_tokens=16))
                                  for i, p in enumerate(PLAIN[:3])]),
        Case("n3_seeded_sync", "sync",
             lambda llm, SP, SO: [(p, _seeded(SP, i, n=3, max_tokens=16))
                                  for i, p in enumerate(PLAIN[:3])]),
        Case("logprobs3_greedy", "base",
             lambda llm, SP, SO: [(p, greedy(SP, logprobs=3, max_tokens=16)) for p in PLAIN],
             record_logprobs=True),
        Case("logprobs3_seeded", "base",
             lambda llm, SP, SO: [(p, _seeded(SP, i, logprobs=3, max_tokens=16))
                                  for i, p in enumerate(PLAIN)], record_logprobs=True),
        Case("beam_width3", "base",
             lambda llm, SP, SO: [(p, SP(use_beam_search=True, beam_width=3, n=3, max_tokens=16))
                                  for p in PLAIN[:3]], record_logprobs=True),
        Case("beam_width3_sync", "sync",
             lambda llm, SP, SO: [(p, SP(use_beam_search=True, beam_width=3, n=3, max_tokens=16))
                                  for p in PLAIN[:2]], record_logprobs=True),
        Case("structured_json_greedy", "base",
             lambda llm, SP, SO: [(chat(llm, CHAT_JSON),
                                   greedy(SP, max_tokens=32, structured_outputs=SO(json=PERSON)))]),
        Case("structured_json_seeded", "base",
             lambda llm, SP, SO: [(chat(llm, CHAT_JSON),
                                   _seeded(SP, i, max_tokens=32,
                                           structured_outputs=SO(json=PERSON)))
                                  for i in range(2)]),
        Case("structured_regex_choice", "base",
             lambda llm, SP, SO: [
                 (chat(llm, "Give me a phone number."),
                  greedy(SP, max_tokens=16, structured_outputs=SO(regex=r"[0-9]{3}-[0-9]{4}"))),
                 (chat(llm, "Give me a phone number."),
                  _seeded(SP, 1, max_tokens=16, structured_outputs=SO(regex=r"[0-9]{3}-[0-9]{4}"))),
                 (chat(llm, "Is the sea salty? Answer yes, no or maybe."),
                  greedy(SP, max_tokens=8, structured_outputs=SO(choice=["yes", "no", "maybe"]))),
                 (chat(llm, "Pick a colour."),
                  _seeded(SP, 2, max_tokens=8, structured_outputs=SO(choice=["red", "green",
                                                                            "blue"]))),
                 # a free request in the same batch as the constrained ones
                 (PLAIN[0], greedy(SP, max_tokens=16))]),
        Case("structured_mixed_sync", "sync",
             lambda llm, SP, SO: [
                 (chat(llm, CHAT_JSON),
                  greedy(SP, max_tokens=32, structured_outputs=SO(json=PERSON))),
                 (chat(llm, "Is the sea salty? Answer yes, no or maybe."),
                  greedy(SP, max_tokens=8, structured_outputs=SO(choice=["yes", "no", "maybe"]))),
                 (PLAIN[1], _seeded(SP, 3, max_tokens=16))]),
        Case("spec_ngram_k4_greedy", "ngram",
             lambda llm, SP, SO: [(p, greedy(SP, max_tokens=24)) for p in REPETITIVE],
             checks=("spec_draft_tokens",)),
        Case("spec_ngram_k4_seeded", "ngram",
             lambda llm, SP, SO: [(p, _seeded(SP, i, max_tokens=24))
                                  for i, p in enumerate(REPETITIVE)],
             checks=("spec_draft_tokens",)),
        Case("spec_ngram_k4_logprobs", "ngram",
             lambda llm, SP, SO: [(p, greedy(SP, max_tokens=16, logprobs=2))
                                  for p in REPETITIVE[:2]],
             checks=("spec_draft_tokens",), record_logprobs=True),
        Case("spec_draft_self_k3_greedy", "draft",
             lambda llm, SP, SO: [(p, greedy(SP, max_tokens=24))
                                  for p in REPETITIVE[:2] + PLAIN[:2]],
             checks=("spec_draft_tokens",)),
        Case("chunked_prefill_greedy", "chunked",
             lambda llm, SP, SO: [(LONG, greedy(SP, max_tokens=20)),
                                  (PLAIN[0], greedy(SP, max_tokens=20)),
                                  (LONG + " leave", greedy(SP, max_tokens=20))],
             checks=("prompt_longer_than_step",)),
        Case("chunked_prefill_seeded_logprobs", "chunked",
             lambda llm, SP, SO: [(LONG, _seeded(SP, 0, max_tokens=20, logprobs=2)),
                                  (PLAIN[1], _seeded(SP, 1, max_tokens=20, logprobs=2))],
             checks=("prompt_longer_than_step",), record_logprobs=True),
        Case("preemption_greedy", "preempt",
             lambda llm, SP, SO: [(p, greedy(SP, max_tokens=24, ignore_eos=True))
                                  for p in REPETITIVE],
             checks=("num_preemptions",)),
        Case("preemption_seeded", "preempt",
             lambda llm, SP, SO: [(p, _seeded(SP, i, max_tokens=24, ignore_eos=True))
                                  for i, p in enumerate(REPETITIVE)],
             checks=("num_preemptions",)),
        Case("preemption_n2_seeded", "preempt",
             lambda llm, SP, SO: [(p, _seeded(SP, i, n=2, max_tokens=20, ignore_eos=True))
                                  for i, p in enumerate(REPETITIVE[1:])],
             checks=("num_preemptions",)),
        Case("stop_strings_and_ids", "base",
             lambda llm, SP, SO: [
                 (PLAIN[0], greedy(SP, max_tokens=24, stop=["."])),
                 (PLAIN[1], greedy(SP, max_tokens=24, stop=["city", "town"])),
                 (PLAIN[0], greedy(SP, max_tokens=24, stop_token_ids=[198])),  # "\n"
                 (PLAIN[2], _seeded(SP, 0, max_tokens=24, stop=["\n"], stop_token_ids=[28]))]),
        Case("min_tokens", "base",
             lambda llm, SP, SO: [
                 (chat(llm, t), greedy(SP, max_tokens=24, min_tokens=16)) for t in CHAT_SHORT]
             + [(chat(llm, t), greedy(SP, max_tokens=24)) for t in CHAT_SHORT]  # without
             + [(PLAIN[0], greedy(SP, max_tokens=24, min_tokens=8, stop_token_ids=[198])),
                (PLAIN[3], _seeded(SP, 3, max_tokens=24, min_tokens=16))]),
    ]
    return out


def prefix_case_requests(llm, SP):
    """Two rounds: the first fills the cache with the shared prefix (the chat header and
    SYSTEM_PREFIX: 3 blocks), the second hits it."""
    first = [(chat(llm, SYSTEM_PREFIX + PREFIX_SUFFIXES[0]), SP(temperature=0.0, max_tokens=20))]
    second = [(chat(llm, SYSTEM_PREFIX + s), SP(temperature=0.0, max_tokens=20))
              for s in PREFIX_SUFFIXES]
    second += [(chat(llm, SYSTEM_PREFIX + PREFIX_SUFFIXES[1]), _seeded(SP, 7, max_tokens=20))]
    return [first, second]


# ---- recording -------------------------------------------------------------------------------

def _r(x) -> float:
    return round(float(x), ROUND)


def completion_record(c, with_logprobs: bool) -> dict:
    rec = {"index": c.index, "token_ids": [int(t) for t in c.token_ids],
           "finish_reason": c.finish_reason, "stop_reason": c.stop_reason, "text": c.text}
    if with_logprobs:
        rec["cumulative_logprob"] = _r(c.cumulative_logprob)
        rec["logprobs"] = (None if c.logprobs is None else
                           [sorted([int(t), _r(lp)] for t, lp in step.items())
                            for step in c.logprobs])
    return rec


def request_record(out, with_logprobs: bool) -> dict:
    return {"prompt_token_ids": [int(t) for t in out.prompt_token_ids],
            "error": out.error,
            "outputs": [completion_record(c, with_logprobs)
                        for c in sorted(out.outputs, key=lambda c: c.index)]}


def counters(llm) -> dict:
    st = llm.stats()
    spec = st.get("speculation") or {}
    return {"num_preemptions": st["num_preemptions"],
            "prefix_cache_hits_tokens": st["prefix_cache_hits_tokens"],
            "prompt_tokens_computed": st["prompt_tokens_computed"],
            "tokens_computed": st["tokens_computed"],
            "spec_draft_tokens": spec.get("num_draft_tokens", 0),
            "spec_accepted_tokens": spec.get("num_accepted_tokens", 0)}


def delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def check(name: str, d: dict, engine: str, longest_prompt: int) -> bool:
    if name == "prompt_longer_than_step":  # so it was prefilled in chunks
        return longest_prompt > ENGINES[engine]["max_num_batched_tokens"]
    return d[name] > 0


def run_case(llm, case: Case, SP, SO) -> dict:
    llm.reset_prefix_cache()
    before = counters(llm)
    reqs = case.requests(llm, SP, SO)
    outs = llm.generate([p for p, _ in reqs], [sp for _, sp in reqs], use_tqdm=False)
    d = delta(counters(llm), before)
    longest = max(len(o.prompt_token_ids) for o in outs)
    return {"engine": case.engine,
            "params": [_params_text(sp) for _, sp in reqs],
            "requests": [request_record(o, case.record_logprobs) for o in outs],
            "counters": d,
            "checks": {c: check(c, d, case.engine, longest) for c in case.checks}}


def run_prefix_case(llm, SP) -> dict:
    llm.reset_prefix_cache()
    before = counters(llm)
    records, params = [], []
    for round_ in prefix_case_requests(llm, SP):
        outs = llm.generate([p for p, _ in round_], [sp for _, sp in round_], use_tqdm=False)
        records += [request_record(o, False) for o in outs]
        params += [_params_text(sp) for _, sp in round_]
    d = delta(counters(llm), before)
    return {"engine": "base", "params": params, "requests": records, "counters": d,
            "checks": {"prefix_cache_hits_tokens": d["prefix_cache_hits_tokens"] > 0}}


def run_stream_case(LLMEngine, EngineConfig, SP, SO, RequestOutputKind) -> dict:
    """LLMEngine stepped by hand, DELTA outputs, a mixed batch (greedy, seeded, n=2, beam,
    constrained) added together: the concatenated deltas and the final outputs."""
    engine = LLMEngine(EngineConfig(model=MODEL, **BASE))
    D = RequestOutputKind.DELTA
    reqs = {
        "g": (PLAIN[0], SP(temperature=0.0, max_tokens=16, output_kind=D)),
        "s": (PLAIN[1], _seeded(SP, 11, max_tokens=16, output_kind=D)),
        "n2": (PLAIN[2], _seeded(SP, 12, n=2, max_tokens=12, output_kind=D)),
        "beam": (PLAIN[3], SP(use_beam_search=True, beam_width=2, n=2, max_tokens=12,
                              output_kind=D)),
        "json": (engine.model.tokenizer.apply_chat_template(
            [{"role": "user", "content": CHAT_JSON}]),
            SP(temperature=0.0, max_tokens=32, output_kind=D,
               structured_outputs=SO(json=PERSON))),
    }
    for rid, (prompt, sp) in reqs.items():
        engine.add_request(rid, prompt, sp)
    streamed: dict[str, dict[int, list[int]]] = {rid: {} for rid in reqs}
    texts: dict[str, dict[int, str]] = {rid: {} for rid in reqs}
    final: dict[str, dict] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                streamed[out.request_id].setdefault(c.index, []).extend(
                    int(t) for t in c.token_ids)
                texts[out.request_id][c.index] = texts[out.request_id].get(c.index, "") + c.text
            if out.finished:
                final[out.request_id] = {
                    "finish_reasons": {c.index: c.finish_reason for c in out.outputs}}
    records = []
    for rid in reqs:
        records.append({
            "request_id": rid, "prompt_token_ids": None,
            "outputs": [{"index": i, "token_ids": streamed[rid][i], "text": texts[rid][i],
                         "finish_reason": final.get(rid, {}).get("finish_reasons", {}).get(i)}
                        for i in sorted(streamed[rid])]})
    return {"engine": "base (LLMEngine, DELTA)", "params": [_params_text(sp)
                                                         for _, sp in reqs.values()],
            "requests": records, "counters": {}, "checks": {}}


def _params_text(sp) -> str:
    d = dataclasses.asdict(sp)
    d["output_kind"] = str(sp.output_kind)
    so = sp.structured_outputs
    d["structured_outputs"] = None if so is None else repr(so.key)
    return json.dumps(d, sort_keys=True, default=str)


# ---- capture ---------------------------------------------------------------------------------

def check_checkout(allow_other: bool) -> dict:
    import jaxserve
    import models
    paths = {"jaxserve": str(pathlib.Path(jaxserve.__file__).resolve().parent),
             "models": str(pathlib.Path(models.__file__).resolve().parent)}
    foreign = [p for p in paths.values() if REPO not in pathlib.Path(p).parents]
    if foreign and not allow_other:
        sys.exit(f"output_fingerprint: this script sits in {REPO} but imports {foreign}; "
                 f"run it with PYTHONPATH={REPO} (or pass --any-checkout)")
    return paths


def git_state() -> dict:
    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                                  check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return None
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(status) if status is not None
            else None}


def capture(out_path: str, only: list[str] | None, allow_other: bool) -> None:
    paths = check_checkout(allow_other)
    import jax
    from jaxserve import LLM, EngineConfig, LLMEngine, RequestOutputKind, SamplingParams
    from jaxserve.core.structured_outputs import StructuredOutputs

    SP, SO = SamplingParams, StructuredOutputs
    all_cases = cases()
    names = [c.name for c in all_cases] + ["prefix_caching_shared", "stream_delta_mixed"]
    if only:
        unknown = sorted(set(only) - set(names))
        if unknown:
            sys.exit(f"unknown cases {unknown}; known: {names}")
    wanted = lambda name: not only or name in only  # noqa: E731
    result = {"meta": {"model": MODEL, "checkout": str(REPO), **git_state(), "imports": paths,
                       "jax": jax.__version__, "backend": jax.default_backend(),
                       "python": platform.python_version(), "engines": {
                           k: {f: (v if not isinstance(v, dict) else json.dumps(v))
                               for f, v in cfg.items()} for k, cfg in ENGINES.items()}},
              "cases": {}}
    t_start = time.perf_counter()
    by_engine: dict[str, list[Case]] = {}
    for c in all_cases:
        if wanted(c.name):
            by_engine.setdefault(c.engine, []).append(c)
    if wanted("prefix_caching_shared"):
        by_engine.setdefault("base", [])
    failed_checks = []
    timings = {}
    for engine_name in ENGINES:
        if engine_name not in by_engine:
            continue
        t0 = time.perf_counter()
        llm = LLM(MODEL, **ENGINES[engine_name])
        timings[f"load:{engine_name}"] = round(time.perf_counter() - t0, 1)
        if engine_name == "preempt":  # the pool is as small as intended: 7 usable blocks
            blocks = llm.stats()["kv_blocks_total"]
            if blocks > 8:
                sys.exit(f"preempt engine got {blocks} KV blocks; KV_BYTES_PER_TOKEN_F32 is "
                         "stale")
        todo = [(c.name, lambda c=c: run_case(llm, c, SP, SO)) for c in by_engine[engine_name]]
        if engine_name == "base" and wanted("prefix_caching_shared"):
            todo.append(("prefix_caching_shared", lambda: run_prefix_case(llm, SP)))
        for name, fn in todo:
            t0 = time.perf_counter()
            rec = fn()
            timings[name] = round(time.perf_counter() - t0, 1)
            result["cases"][name] = rec
            bad = [k for k, ok in rec["checks"].items() if not ok]
            failed_checks += [f"{name}: {k}" for k in bad]
            print(f"{name:34s} {timings[name]:6.1f}s  counters={rec['counters']}"
                  + (f"  CHECK FAILED: {bad}" if bad else ""), flush=True)
        del llm
    if wanted("stream_delta_mixed"):
        t0 = time.perf_counter()
        rec = run_stream_case(LLMEngine, EngineConfig, SP, SO, RequestOutputKind)
        timings["stream_delta_mixed"] = round(time.perf_counter() - t0, 1)
        result["cases"]["stream_delta_mixed"] = rec
        print(f"{'stream_delta_mixed':34s} {timings['stream_delta_mixed']:6.1f}s", flush=True)
    result["meta"]["seconds"] = round(time.perf_counter() - t_start, 1)
    result["meta"]["timings"] = timings
    result["meta"]["failed_checks"] = failed_checks
    pathlib.Path(out_path).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out_path}: {len(result['cases'])} cases in {result['meta']['seconds']}s")
    if failed_checks:
        sys.exit(f"cases that did not exercise what they name: {failed_checks}")


# ---- compare ---------------------------------------------------------------------------------

def first_diff(a: list, b: list) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_case(a: dict, b: dict) -> str | None:
    """None if the outputs are equal, else where they first differ."""
    if len(a["requests"]) != len(b["requests"]):
        return f"{len(a['requests'])} vs {len(b['requests'])} requests"
    for r, (ra, rb) in enumerate(zip(a["requests"], b["requests"])):
        if ra.get("prompt_token_ids") != rb.get("prompt_token_ids"):
            return f"request {r}: the prompt token ids differ (input, not output)"
        if ra.get("error") != rb.get("error"):
            return f"request {r}: error {ra.get('error')!r} vs {rb.get('error')!r}"
        if len(ra["outputs"]) != len(rb["outputs"]):
            return f"request {r}: {len(ra['outputs'])} vs {len(rb['outputs'])} completions"
        for ca, cb in zip(ra["outputs"], rb["outputs"]):
            where = f"request {r} completion {ca['index']}"
            i = first_diff(ca["token_ids"], cb["token_ids"])
            if i is not None:
                ta = ca["token_ids"][i] if i < len(ca["token_ids"]) else "<end>"
                tb = cb["token_ids"][i] if i < len(cb["token_ids"]) else "<end>"
                return (f"{where}: first differing token at position {i}: {ta} vs {tb} "
                        f"(lengths {len(ca['token_ids'])} vs {len(cb['token_ids'])})")
            for key in ("index", "finish_reason", "stop_reason", "text", "cumulative_logprob"):
                if ca.get(key) != cb.get(key):
                    return f"{where}: {key} {ca.get(key)!r} vs {cb.get(key)!r}"
            la, lb = ca.get("logprobs"), cb.get("logprobs")
            if la != lb:
                if la is None or lb is None or len(la) != len(lb):
                    return f"{where}: logprobs present/length differ"
                j = first_diff(la, lb)
                return f"{where}: logprobs differ at position {j}: {la[j]} vs {lb[j]}"
    return None


def compare(path_a: str, path_b: str) -> int:
    a, b = (json.loads(pathlib.Path(p).read_text()) for p in (path_a, path_b))
    for name, m in (("A", a["meta"]), ("B", b["meta"])):
        print(f"{name}: commit {m.get('commit')} dirty={m.get('dirty')} "
              f"imports {m.get('imports', {}).get('jaxserve')}")
    names = list(a["cases"]) + [n for n in b["cases"] if n not in a["cases"]]
    differ = 0
    for name in names:
        ca, cb = a["cases"].get(name), b["cases"].get(name)
        if ca is None or cb is None:
            print(f"{name:34s} MISSING in {'A' if ca is None else 'B'}")
            differ += 1
            continue
        why = compare_case(ca, cb)
        print(f"{name:34s} {'equal' if why is None else 'DIFFERENT: ' + why}")
        differ += why is not None
        if ca.get("params") != cb.get("params"):  # e.g. a new SamplingParams field
            print(f"{'':34s} note: the requests' SamplingParams differ in their fields")
        if ca.get("counters") != cb.get("counters"):
            print(f"{'':34s} note: counters differ: {ca.get('counters')} vs "
                  f"{cb.get('counters')}")
    print(f"{len(names) - differ} of {len(names)} cases equal")
    return 1 if differ else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--out", metavar="FILE.json", help="run every case and write the fingerprint")
    g.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"),
                   help="compare two fingerprints; exit 1 on any output difference")
    ap.add_argument("--cases", nargs="+", metavar="NAME", help="run only these cases")
    ap.add_argument("--any-checkout", action="store_true",
                    help="measure whichever jaxserve is imported, even from another checkout")
    args = ap.parse_args()
    if args.compare:
        sys.exit(compare(*args.compare))
    capture(args.out, args.cases, args.any_checkout)


if __name__ == "__main__":
    main()
