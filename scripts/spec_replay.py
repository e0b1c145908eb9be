"""Offline replay of n-gram speculation: the engine's drafter and switch-off over fixed outputs.

    .venv/bin/python scripts/spec_replay.py [--max-tokens 64] [--k 4 8 12] [--json PATH]

Greedy output does not depend on speculation, so the step sequence a speculating engine runs
(which rows verify, how many drafts each accepts, when the switch-off trips and resumes) follows
from the output tokens alone. This generates bench_speculative.py's grounded and free outputs
once (SmolLM2 float32, no speculation; or reads them from --json, written on the first run),
then replays each through Speculator and the n-gram proposer as the engine calls them per step
(score_off, propose, verify), and prints per prompt the verified and plain rows, acceptance,
tokens / verified row, tokens from verified rows and a decode speed-up estimated from a step
cost of --decode-ms plus --draft-ms per drafted token (defaults: the quiet k = 8 figures of
docs/speculative.md). Not modelled: a switched-off sequence's proposals lag one token behind
with asynchronous scheduling. Use it to compare drafters and switch-off rules in seconds; the
benchmark decides.
"""

from __future__ import annotations

import argparse
import json
import pathlib

from jaxserve.core.sequence import Sequence
from jaxserve.core.spec_decode.config import SpeculativeConfig
from jaxserve.core.spec_decode.speculator import Speculator
from jaxserve.spec_engine import ngram_batch_proposer


class _Params:
    def __init__(self, max_tokens):
        self.max_tokens = max_tokens


def greedy_outputs(max_tokens: int) -> dict:
    import bench_speculative as bs
    from jaxserve import LLM, SamplingParams
    from models import load_model
    llm = LLM(load_model("smollm2-135m", dtype="float32"), max_num_seqs=1, max_model_len=512,
              max_num_batched_tokens=256, warmup=False)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    found = {}
    for name, prompts in (("grounded", bs.GROUNDED), ("free", bs.FREE)):
        outs = llm.generate(prompts, params, use_tqdm=False)
        found[name] = [{"prompt": list(o.prompt_token_ids), "out": list(o.outputs[0].token_ids)}
                       for o in outs]
    return found


def replay(prompt: list[int], out: list[int], config: SpeculativeConfig) -> list[tuple[int, int]]:
    """(drafted, accepted) per step after the prefill's token; (0, 0) for a plain step."""
    spec = Speculator(config, ngram_batch_proposer(config), max_model_len=1 << 20,
                      score_while_off=True)
    seq = Sequence("r", list(prompt), _Params(len(out)))
    seq.append_token(out[0])  # the prefill's token
    seq.num_computed_tokens = len(prompt)
    rows = []
    while len(seq.output_token_ids) < len(out):
        spec.score_off()
        n = len(seq.output_token_ids)
        drafted = spec.propose([seq], budget=1 << 20).get("r", 0)
        a = spec.verify(seq, out[n:n + drafted + 1]) if drafted else 0
        rows.append((drafted, a))
        for t in out[n:n + a + 1]:
            seq.append_token(t)
        seq.num_computed_tokens = seq.num_tokens - 1
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, nargs="+", default=[4, 8, 12])
    ap.add_argument("--json", type=pathlib.Path, help="outputs to read, or to write if absent")
    ap.add_argument("--decode-ms", type=float, default=44.5)
    ap.add_argument("--draft-ms", type=float, default=2.0)
    ap.add_argument("--config", type=json.loads, default={}, metavar="JSON",
                    help="SpeculativeConfig fields besides k, e.g. '{\"disable_window\": 4}'")
    args = ap.parse_args(argv)
    if args.json and args.json.exists():
        data = json.loads(args.json.read_text())
    else:
        data = greedy_outputs(args.max_tokens)
        if args.json:
            args.json.write_text(json.dumps(data))
    cost = lambda rows: sum(args.decode_ms + args.draft_ms * d for d, _ in rows)  # noqa: E731
    for k in args.k:
        config = SpeculativeConfig(**{"prompt_lookup_min": 2, "prompt_lookup_max": 4,
                                      **args.config, "num_speculative_tokens": k})
        for name, items in data.items():
            rows = [(item, replay(item["prompt"], item["out"], config)) for item in items]
            verified = [r for _, rs in rows for r in rs if r[0]]
            tokens = sum(len(item["out"]) - 1 for item, _ in rows)
            emitted = sum(a + 1 for _, a in verified)
            drafted = sum(d for d, _ in verified)
            plain = sum(cost([(0, 0)] * (len(item["out"]) - 1)) for item, _ in rows)
            est = plain / sum(cost(rs) for _, rs in rows)
            per = " ".join(f"{sum(1 for r in rs if r[0])}v/{sum(1 for r in rs if not r[0])}p"
                           for _, rs in rows)
            print(f"k={k:2d} {name:8s} est. decode speed-up {est:.2f}  acceptance "
                  f"{sum(a for _, a in verified) / max(1, drafted):.0%}  tokens/verified row "
                  f"{emitted / max(1, len(verified)):.2f}  from verified rows "
                  f"{emitted / tokens:.0%}  per prompt (verified/plain rows): {per}")


if __name__ == "__main__":
    main()
