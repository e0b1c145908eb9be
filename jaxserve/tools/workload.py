"""Seeded synthetic workloads and a timed offline run through the engine.

Shared by `jaxserve bench`, scripts/bench_throughput.py and scripts/ablate_block_size.py, so
every benchmark draws the same requests from the same seed.
"""

from __future__ import annotations

import time

import numpy as np

TOKEN_RANGE = (100, 40000)  # random prompt ids: ordinary tokens of SmolLM2's vocabulary


def make_workload(seed: int, n: int, prompt_len, output_len,
                  token_range: tuple[int, int] = TOKEN_RANGE) -> list[dict]:
    """n requests: random ids, lengths uniform in the closed ranges; identical for every engine."""
    rng = np.random.default_rng(seed)
    plens = rng.integers(prompt_len[0], prompt_len[1] + 1, size=n)
    olens = rng.integers(output_len[0], output_len[1] + 1, size=n)
    return [{"prompt": rng.integers(*token_range, size=int(p)).tolist(), "max_tokens": int(o)}
            for p, o in zip(plens, olens)]


def run_workload(engine, requests: list[dict]) -> dict:
    """Submits every request at once (greedy, EOS ignored; a request's "lora_request", if any,
    picks its adapter) and steps until all finish.

    Returns wall seconds, token counts and throughput; preemptions and compiles are deltas
    over this run.
    """
    from jaxserve.core.sampling_params import SamplingParams
    before = engine.stats()
    compiled = engine.runner.num_compiled
    t0 = time.perf_counter()
    ids = []
    for r in requests:
        rid = engine.next_request_id()
        engine.add_request(rid, r["prompt"], SamplingParams(
            temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True),
            lora_request=r.get("lora_request"))
        ids.append(rid)
    generated = dict.fromkeys(ids, 0)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.request_id in generated:
                generated[out.request_id] = len(out.outputs[0].token_ids)
    seconds = time.perf_counter() - t0
    output_tokens = sum(generated.values())
    prompt_tokens = sum(len(r["prompt"]) for r in requests)
    return {"seconds": seconds, "num_requests": len(requests), "output_tokens": output_tokens,
            "prompt_tokens": prompt_tokens, "output_tok_s": output_tokens / seconds,
            "total_tok_s": (output_tokens + prompt_tokens) / seconds,
            "num_preemptions": engine.stats()["num_preemptions"] - before["num_preemptions"],
            "num_compiles": engine.runner.num_compiled - compiled}
