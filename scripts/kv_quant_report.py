"""KV-cache quantization quality: next-token KL of int8 (and bf16) K/V against float32 K/V.

The float32 model with a float32 cache is the teacher. Each variant is the same float32 model
whose attention reads K and V as a cache of that dtype stores them: bf16-rounded, or int8 codes
times their per (token, KV head) scale (jaxserve/runtime/kv_quant.py's rule). The engine with
`kv_cache_dtype="int8"` computes exactly these logits up to float summation order: its greedy
tokens equal this dense model's (tests/kernels/test_kv_int8.py, on tiny models over every attention
path, and on SmolLM2 for the XLA path). Scored on the quality report's held-out text
(scripts/quant_heldout.txt): KL(float KV || variant) and top-1 agreement at every position,
perplexity, and KV bytes per token (scales included).

    .venv/bin/python scripts/kv_quant_report.py     # docs/kv_quant_report.*
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.quantization.calibration import from_text
from jaxserve.runtime import kv_quant
from jaxserve.runtime.kv_cache import bytes_per_token
from models.llama import Llama, dense_causal_attention
from quant_report import HELDOUT, batch_metrics, environment  # scripts/quant_report.py

REPO = pathlib.Path(__file__).resolve().parent.parent
KV_DTYPES = ("float32", "bfloat16", "int8")


def stored(x, kv_dtype: str):
    """K or V `[B, T, K, Dh]` as a cache of kv_dtype holds it, back in x's dtype."""
    if kv_dtype == "int8":
        return kv_quant.dequantize(*kv_quant.quantize(x), x.dtype)
    return x.astype(kv_dtype).astype(x.dtype)


def attention_reading(kv_dtype: str):
    def attention(q, k, v, cache, layer, meta, **kw):
        return dense_causal_attention(q, stored(k, kv_dtype), stored(v, kv_dtype), cache, layer,
                                      meta, **kw)
    return attention


def logits_fn(config, kv_dtype: str):
    module = Llama(config, attention=attention_reading(kv_dtype))

    @jax.jit
    def forward(params, tokens):  # tokens [B, T]
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        return module.apply({"params": params}, tokens, positions)[0]  # [B, T, V]
    return forward


def run_report(model, tokens: np.ndarray, batch: int = 2) -> dict:
    c = model.config
    batches = [jnp.asarray(tokens[i:i + batch]) for i in range(0, len(tokens), batch)]
    teacher_fwd = logits_fn(c, "float32")
    teacher = [teacher_fwd(model.params, b) for b in batches]
    n_pos, n_next = tokens.size, tokens.shape[0] * (tokens.shape[1] - 1)
    rows = []
    for kv_dtype in KV_DTYPES:
        fwd = logits_fn(c, kv_dtype)
        kl = agree = nll = 0.0
        for b, t in zip(batches, teacher):
            k, a, n = batch_metrics(t, fwd(model.params, b), b)
            kl, agree, nll = kl + float(k), agree + float(a), nll + float(n)
        rows.append({"kv_cache_dtype": kv_dtype, "kl": max(kl / n_pos, 0.0),
                     "top1": agree / n_pos, "ppl": float(np.exp(nll / n_next)),
                     "bytes_per_token": bytes_per_token(c, jnp.dtype(kv_dtype))})
    return {"model": pathlib.Path(model.source).name, "rows": rows, "heldout": list(tokens.shape),
            "config": {"num_layers": c.num_layers, "num_kv_heads": c.num_kv_heads,
                       "head_dim": c.head_dim}}


def markdown(report: dict, command: str, env: str) -> str:
    c = report["config"]
    lines = [
        "# KV-cache quantization quality", "",
        f"`{command}`", "", env, "",
        f"Model {report['model']} (float32 weights and activations). Held-out text "
        f"(scripts/quant_heldout.txt): {report['heldout'][0]} windows x "
        f"{report['heldout'][1]} tokens. KL(float32 KV || variant) and top-1 agreement "
        "averaged over every position; bytes per token = 2 x layers x KV heads x (head_dim x "
        f"element bytes + scale bytes) = 2 x {c['num_layers']} x {c['num_kv_heads']} x "
        f"({c['head_dim']} x b + s).", "",
        "| kv_cache_dtype | KL (nats/token) | top-1 agree | perplexity | KV bytes/token | "
        "vs float32 |", "|---|---|---|---|---|---|"]
    base = report["rows"][0]["bytes_per_token"]
    for r in report["rows"]:
        lines.append(f"| {r['kv_cache_dtype']} | {r['kl']:.2e} | {100 * r['top1']:.2f}% | "
                     f"{r['ppl']:.3f} | {r['bytes_per_token']:,} | "
                     f"{r['bytes_per_token'] / base:.3f}x |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--heldout", default=str(HELDOUT), help="held-out text file")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--heldout-seqs", type=int, default=4)
    ap.add_argument("--out", default=str(REPO / "docs" / "results" / "kv_quant_report"),
                    help="output prefix (.md, .json)")
    args = ap.parse_args(argv)
    from models import load_model
    model = load_model(args.model, "float32")
    text = pathlib.Path(args.heldout).read_text(encoding="utf-8")
    tokens = from_text(model.tokenizer, text, args.seq_len, args.heldout_seqs, "held-out").tokens
    start = time.perf_counter()
    report = run_report(model, tokens)
    report["seconds"] = time.perf_counter() - start
    command = "PYTHONPATH=$PWD .venv/bin/python scripts/kv_quant_report.py " + shlex.join(
        sys.argv[1:] if argv is None else argv)
    md = markdown(report, command.strip(), environment())
    out = pathlib.Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
