"""Speculative decoding benchmark: batch-1 tok/s with and without, SmolLM2, on this machine.

Two workloads of greedy, EOS-ignored requests, run one request at a time (batch 1):

- grounded: the output copies from the input ("repeat / edit this text or code" prompts);
- free: open-ended generation, where an n-gram drafter rarely finds anything to copy.

Ways: no speculation, n-gram drafting (`{"method": "ngram"}`), and a draft model (SmolLM2 itself
with W8A8 weights: on a CPU it costs about as much as the target, so it shows the mechanics and
acceptance, not a speed-up). Every way runs every workload once to compile, then the rounds
alternate the ways prompt by prompt, so load from other jobs falls on all of them alike; tok/s
is the median over rounds of generated tokens / wall time. The load average is printed with the table. It
also times the n-gram drafter alone per step at 1, 16 and 64 sequences.

    .venv/bin/python scripts/bench_speculative.py --md docs/results/bench_speculative.md \
        --out docs/results/bench_speculative.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import shlex
import statistics
import sys
import time

from jaxserve.tools.machine import describe

CODE = '''def merge_sorted(a, b):
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    return out + a[i:] + b[j:]
'''
TEXT = ("The committee met on Tuesday to review the budget for the new library. After a long "
        "discussion, the members agreed to fund the reading room, the children's section and "
        "the digital archive, but postponed the decision on the rooftop garden until spring.")
GROUNDED = [
    f"Rename the function merge_sorted to merge in this code.\n\n{CODE}\nThe same code with "
    f"the function renamed:\n\ndef merge(a, b):\n",
    f"Repeat the following text exactly.\n\nText: {TEXT}\n\nRepeated text: The committee",
    f"Copy this code without changes.\n\n{CODE}\nCopy:\n\ndef merge_sorted(a, b):\n",
]
FREE = ["Once upon a time, in a small village by the sea,", "The history of the Roman empire",
        "Here are some tips for learning to cook:"]
WAYS = {
    "none": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
              "prompt_lookup_min": 2},
    "draft_model": {"method": "draft_model", "model": "smollm2-135m",
                    "draft_quantization": "w8a8", "num_speculative_tokens": 3},
}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ways", default="none,ngram,draft_model",
                    help="comma-separated: none, ngram, ngram-kN (k = N), draft_model")
    ap.add_argument("--prompts", type=int, default=3, help="prompts per workload (<= 3)")
    ap.add_argument("--ngram", type=json.loads, default=None, metavar="JSON",
                    help="fields replacing the n-gram way's config, e.g. "
                         "'{\"num_speculative_tokens\": 8}'")
    ap.add_argument("--md", type=pathlib.Path)
    ap.add_argument("--out", type=pathlib.Path)
    return ap.parse_args(argv)


def proposer_cost(lengths=(1, 16, 64), seq_len=1024, steps=200) -> dict:
    """Seconds per step of the n-gram drafter alone (Speculator.propose over n sequences of
    `seq_len` tokens, one token appended to each per step), the median of `steps` steps."""
    from jaxserve.core.sequence import Sequence
    from jaxserve.core.spec_decode.config import SpeculativeConfig
    from jaxserve.core.spec_decode.speculator import Speculator
    from jaxserve.spec_engine import ngram_batch_proposer
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    out = {}
    rng = random.Random(0)
    for n in lengths:
        spec = Speculator(config, ngram_batch_proposer(config), max_model_len=1 << 20)
        seqs = []
        for i in range(n):
            toks = [rng.randrange(2000) for _ in range(seq_len // 2)]
            seq = Sequence(str(i), toks + toks[:seq_len // 2], _Params(1 << 20))
            seq.num_computed_tokens = seq.num_tokens - 1
            seqs.append(seq)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            spec.propose(seqs, budget=1 << 20)
            times.append(time.perf_counter() - t0)
            for seq in seqs:
                spec.strip(seq)
                seq.output_token_ids.append(rng.randrange(2000))
                seq.num_computed_tokens += 1
        out[n] = {"median_s": statistics.median(times), "first_s": times[0]}
    return out


class _Params:
    def __init__(self, max_tokens):
        self.max_tokens = max_tokens


def run_way(llm, prompts, max_tokens) -> dict:
    from jaxserve import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    before = dict(llm.stats()["speculation"] or {})
    t0 = time.perf_counter()
    tokens = 0
    decode_s = 0.0  # after each request's first token: what speculation can speed up
    for p in prompts:  # batch 1: one request at a time
        out = llm.generate([p], params, use_tqdm=False)[0]
        tokens += len(out.outputs[0].token_ids)
        decode_s += out.metrics.finished_time - out.metrics.first_token_time
    seconds = time.perf_counter() - t0
    after = llm.stats()["speculation"] or {}
    drafted = after.get("num_draft_tokens", 0) - before.get("num_draft_tokens", 0)
    accepted = after.get("num_accepted_tokens", 0) - before.get("num_accepted_tokens", 0)
    rows = after.get("num_drafts", 0) - before.get("num_drafts", 0)
    emitted = after.get("num_emitted_tokens", 0) - before.get("num_emitted_tokens", 0)
    return {"tokens": tokens, "seconds": seconds, "decode_s": decode_s, "drafted": drafted, "accepted": accepted,
            "rows": rows, "emitted": emitted}


def main(argv=None) -> dict:
    args = parse_args(argv)
    from jaxserve import LLM
    from models import load_model
    print("load average at start:", os.getloadavg(), flush=True)
    cost = proposer_cost()
    for n, c in cost.items():
        print(f"n-gram drafter, {n} sequences: {c['median_s'] * 1e6:.0f} us/step", flush=True)
    if args.ngram:
        WAYS["ngram"] = {**WAYS["ngram"], **args.ngram}
    for w in args.ways.split(","):  # "ngram-k8": the n-gram way drafting 8 tokens
        if w.startswith("ngram-k") and w not in WAYS:
            WAYS[w] = {**WAYS["ngram"], "num_speculative_tokens": int(w[len("ngram-k"):])}
    model = load_model(args.model, dtype="float32")
    workloads = {"grounded": GROUNDED[:args.prompts], "free": FREE[:args.prompts]}
    ways = args.ways.split(",")
    llms = {w: LLM(model, draft_model=model, speculative_config=WAYS[w], max_num_seqs=1,
                   max_model_len=512, max_num_batched_tokens=256, warmup=False) for w in ways}
    for w in ways:  # compile every shape each way meets
        for prompts in workloads.values():
            run_way(llms[w], prompts, args.max_tokens)
    # Each round runs every prompt once per way, the ways alternating prompt by prompt (and
    # reversed every other round), so a change of load falls on all ways alike.
    runs = {(w, name): [] for w in ways for name in workloads}
    for r in range(args.rounds):
        for name, prompts in workloads.items():
            parts = {w: [] for w in ways}
            for p in prompts:
                for w in (ways if r % 2 == 0 else ways[::-1]):
                    parts[w].append(run_way(llms[w], [p], args.max_tokens))
            for w, xs in parts.items():
                runs[(w, name)].append({key: sum(x[key] for x in xs) for key in xs[0]})
    load = os.getloadavg()
    print("load average at end:", load, flush=True)
    rows = []
    for name in workloads:
        base = statistics.median(x["tokens"] / x["seconds"] for x in runs[("none", name)]) \
            if "none" in ways else None
        # Decode rate: the tokens after each request's first over the time after it.
        base_dec = statistics.median((x["tokens"] - len(workloads[name])) / x["decode_s"]
                                     for x in runs[("none", name)]) if "none" in ways else None
        for w in ways:
            xs = runs[(w, name)]
            tps = statistics.median(x["tokens"] / x["seconds"] for x in xs)
            dec = statistics.median((x["tokens"] - len(workloads[name])) / x["decode_s"]
                                    for x in xs)
            drafted, accepted = sum(x["drafted"] for x in xs), sum(x["accepted"] for x in xs)
            nrows, emitted = sum(x["rows"] for x in xs), sum(x["emitted"] for x in xs)
            rows.append({"workload": name, "way": w, "tok_s": tps,
                         "speedup": tps / base if base else None,
                         "decode_tok_s": dec, "decode_speedup": dec / base_dec if base_dec else None,
                         "acceptance_rate": accepted / drafted if drafted else None,
                         "mean_accepted_length": emitted / nrows if nrows else None,
                         "drafted_tokens": drafted,
                         "verified_share": emitted / sum(x["tokens"] for x in xs)})
    result = {"command": "python " + shlex.join(["scripts/bench_speculative.py",
                                                 *(argv if argv is not None else sys.argv[1:])]),
              "machine": describe(),
              "load_average_end": load, "max_tokens": args.max_tokens, "rounds": args.rounds,
              "ways": {w: WAYS[w] for w in ways},
              "rows": rows, "ngram_drafter_cost": {str(k): v for k, v in cost.items()}}
    md = render(result)
    print(md)
    if args.md:
        args.md.write_text(md)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def render(result: dict) -> str:
    lines = [f"Command: `{result['command']}`; {result['machine']}; load average at the end "
             f"{', '.join(f'{x:.1f}' for x in result['load_average_end'])}; batch 1, greedy, "
             f"{result['max_tokens']} tokens per request, median of {result['rounds']} "
             "alternating rounds.", "",
             "tok/s counts every generated token over the request's wall time (prefill "
             "included); decode tok/s counts the tokens after the first over the time after it.",
             "", "| workload | way | tok/s | vs none | decode tok/s | vs none | acceptance | "
             "tokens / verified row | tokens from verified rows |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['workload']} | {r['way']} | {r['tok_s']:.1f} | "
                     f"{_fmt(r['speedup'], '.2f')}x | {_fmt(r.get('decode_tok_s'), '.1f')} | "
                     f"{_fmt(r.get('decode_speedup'), '.2f')}x | "
                     f"{_fmt(r['acceptance_rate'], '.0%')} | "
                     f"{_fmt(r['mean_accepted_length'], '.2f')} | "
                     f"{r['verified_share']:.0%} |")
    if "ways" in result:
        lines += ["", "Ways: " + "; ".join(f"{w}: `{json.dumps(c)}`"
                                           for w, c in result["ways"].items())]
    lines += ["", "N-gram drafter alone (host, per engine step, 1024-token sequences):", "",
              "| sequences | us / step |", "|---|---|"]
    for n, c in result["ngram_drafter_cost"].items():
        lines.append(f"| {n} | {c['median_s'] * 1e6:.0f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
