"""Speculative decoding at batch 1: time per engine step by kind (verify rows vs plain decodes).

    .venv/bin/python scripts/spec_step_times.py [K] [EngineConfig overrides key=value ...]

Runs bench_speculative.py's grounded prompts through SmolLM2 float32 with n-gram drafting of K
tokens (default 8), twice, and prints for the second round, per prompt and step kind
(num_prefill_seqs, num_decode_seqs, tokens, num_sampled) -- `(1, 0, 9, 1)` is a verify row of
8 drafts, `(0, 1, 1, 1)` a plain decode -- the count and the median wall, schedule, device,
postprocess and wait ms (StepStats). Overrides are strings: `layer_loop=unrolled`,
`linear_backend=xla`. The machine must be quiet for the figures to mean anything.
"""

from __future__ import annotations

import os
import statistics
import sys

import bench_speculative as bs
from jaxserve import LLM, SamplingParams
from jaxserve.telemetry.step_stats import timed_steps
from models import load_model


def main(argv: list[str]) -> None:
    k = int(argv[0]) if argv else 8
    overrides = dict(a.split("=", 1) for a in argv[1:])
    model = load_model("smollm2-135m", dtype="float32")
    llm = LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": k,
                                         "prompt_lookup_max": 4, "prompt_lookup_min": 2},
              max_num_seqs=1, max_model_len=512, max_num_batched_tokens=256, warmup=False,
              **overrides)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=64)
    print("prompt (prefill seqs, decode seqs, tokens, sampled) steps | median ms: wall "
          "schedule device postprocess wait")
    for rnd in range(2):  # the first round compiles what warmup=False left
        for i, prompt in enumerate(bs.GROUNDED):
            engine.add_request(f"r{rnd}-{i}", prompt, params)
            times: dict[tuple, list] = {}
            for wall, s in timed_steps(engine):
                key = (s.num_prefill_seqs, s.num_decode_seqs, s.num_tokens, s.num_sampled)
                times.setdefault(key, []).append(
                    (wall, s.schedule_s, s.device_s, s.postprocess_s, s.wait_s))
            if rnd == 1:
                for key, rows in sorted(times.items(), key=lambda kv: -len(kv[1])):
                    med = " ".join(f"{1e3 * statistics.median(c):.1f}" for c in zip(*rows))
                    print(i, key, len(rows), "|", med)
    print("load average:", os.getloadavg())


if __name__ == "__main__":
    main(sys.argv[1:])
