"""Quantization quality report: RTN, GPTQ and AWQ at int4 and int8, and W8A8, against float32.

The float32 model (SmolLM2's GGUF weights, dequantized) is the teacher. Every variant is scored
on held-out text that is not the calibration text (scripts/quant_heldout.txt; calibration uses
the built-in text of jaxserve/quantization/calibration_text.py): KL(teacher || variant) of the
next-token distributions and top-1 agreement at every position, perplexity, weight memory, and
CPU decode tokens/s through the engine; plus the relative output error of every linear of every
layer, ||X W - X W_hat|| / ||X W||, with X the float model's inputs of that linear on held-out
text (for AWQ, W is the scale-folded float kernel it rounds: the same function of X).

    PYTHONPATH=$PWD .venv/bin/python scripts/quant_report.py           # docs/quant_report.*
    PYTHONPATH=$PWD .venv/bin/python scripts/quant_report.py --quick   # a fast check

Logits of quantized variants come from the float forward with dequantized kernels (the served
int4/int8 kernels compute the same products up to float summation order); W8A8 additionally
rounds every linear's input to int8 per token (symmetric), as the W8A8 path does at run time.
The PNG needs matplotlib (optional dependency group `report`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import pathlib
import shlex
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.quantization import QuantSpec, dequantize_weight, is_quantized
from jaxserve.quantization.awq import awq_scale
from jaxserve.quantization.calibration import Calibration, from_text, load_calibration
from jaxserve.quantization.gptq import GPTQConfig, gptq_quantize
from jaxserve.quantization.layerwise import (LINEARS, LayerForward, embed, layer_slice,
                                             rtn_params, spec_for)
from jaxserve.tools.machine import describe
from models.llama import Llama, dense_linear

REPO = pathlib.Path(__file__).resolve().parent.parent
HELDOUT = REPO / "scripts" / "quant_heldout.txt"
INT4 = QuantSpec(4, "group", 128)               # asymmetric, zero point per group
INT8 = QuantSpec(8, "channel", symmetric=True)  # what int8 x int8 dots want (no zero point)
LINEAR_NAMES = [name for _, name in LINEARS]


@dataclasses.dataclass
class Variant:
    name: str
    method: str
    spec: QuantSpec | None
    params: dict              # what is served: float kernels or quantized pytrees
    reference: dict           # the float params it approximates (AWQ: scales folded in)
    act8: bool = False        # W8A8: linear inputs rounded to int8 per token
    fmt: str = "float32"      # the served format, for the decode-speed run
    seconds: float = 0.0      # time to quantize


# ---- building the variants --------------------------------------------------------------------

def build_variants(model, calibration: Calibration, progress: bool = True,
                   int8_methods: bool = True) -> list[Variant]:
    """float32, then RTN/GPTQ/AWQ at int4 g128 (and GPTQ with act-order) and int8 per channel,
    then W8A8. int8_methods=False (--quick) keeps RTN alone at int8 and skips act-order: each
    GPTQ or AWQ run costs minutes.
    """
    base = model.params
    out = [Variant("float32", "-", None, base, base)]
    for spec, fmt in ((INT4, "int4"), (INT8, "int8")):
        tag = f"int{spec.bits} " + ("g128" if spec.granularity == "group" else "per-channel")
        start = time.perf_counter()
        out.append(Variant(f"RTN {tag}", "rtn", spec, rtn_params(base, spec), base, fmt=fmt,
                           seconds=time.perf_counter() - start))
        if fmt == "int8" and not int8_methods:
            continue
        start = time.perf_counter()
        params = gptq_quantize(model, spec, calibration, progress=progress)
        out.append(Variant(f"GPTQ {tag}", "gptq", spec, params, base, fmt=fmt,
                           seconds=time.perf_counter() - start))
        if spec.granularity == "group" and int8_methods:  # act-order: static groups
            start = time.perf_counter()
            params = gptq_quantize(model, spec, calibration, GPTQConfig(act_order=True),
                                   progress=progress)
            out.append(Variant(f"GPTQ {tag} act-order", "gptq", spec, params, base, fmt=fmt,
                               seconds=time.perf_counter() - start))
        start = time.perf_counter()
        folded, _ = awq_scale(model, spec, calibration, progress=progress)
        params = rtn_params(folded, spec)
        out.append(Variant(f"AWQ {tag}", "awq", spec, params, folded, fmt=fmt,
                           seconds=time.perf_counter() - start))
    rtn8 = next(v for v in out if v.name == "RTN int8 per-channel")
    out.append(Variant("W8A8 (RTN int8 per-channel, int8 act. per token)", "rtn", INT8,
                       rtn8.params, base, act8=True, fmt="w8a8"))
    return out


# ---- evaluation -------------------------------------------------------------------------------

def fake_quant_per_token(x):
    """Symmetric int8 rounding of each row of x [..., K] (scale max|x| / 127 per token)."""
    s = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / 127.0
    s = jnp.where(s == 0, 1.0, s)
    return jnp.clip(jnp.round(x / s), -127, 127) * s


def eval_linear(act8: bool):
    def linear(x, w, parallel=None):
        if is_quantized(w):
            w = dequantize_weight(w)
        return dense_linear(fake_quant_per_token(x) if act8 else x, w)
    return linear


@functools.lru_cache(maxsize=None)  # one jitted forward per (config, act8), across variants
def logits_fn(config, act8: bool):
    module = Llama(config, linear=eval_linear(act8))

    @jax.jit
    def forward(params, tokens):  # tokens [B, T]
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        return module.apply({"params": params}, tokens, positions)[0]  # [B, T, V]
    return forward


@jax.jit
def batch_metrics(teacher, student, tokens):
    """Sums over positions of KL(teacher || student), top-1 agreement, and next-token NLL."""
    lt, ls = jax.nn.log_softmax(teacher, -1), jax.nn.log_softmax(student, -1)  # [B, T, V]
    kl = jnp.sum(jnp.exp(lt) * (lt - ls), axis=-1)  # [B, T]
    agree = jnp.argmax(teacher, -1) == jnp.argmax(student, -1)  # [B, T]
    nll = -jnp.take_along_axis(ls[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]  # [B, T-1]
    return jnp.sum(kl), jnp.sum(agree), jnp.sum(nll)


def evaluate(config, variants: list[Variant], tokens: np.ndarray, batch: int = 2) -> dict:
    """{variant name: {kl, top1, ppl}} over all positions of the held-out windows [S, T]."""
    teacher_fwd = logits_fn(config, False)
    batches = [jnp.asarray(tokens[i:i + batch]) for i in range(0, len(tokens), batch)]
    teacher = [teacher_fwd(variants[0].params, b) for b in batches]
    n_pos, n_next = tokens.size, tokens.shape[0] * (tokens.shape[1] - 1)
    out = {}
    for v in variants:
        fwd = logits_fn(config, v.act8)
        kl = agree = nll = 0.0
        for b, t in zip(batches, teacher):
            k, a, n = batch_metrics(t, fwd(v.params, b), b)
            kl, agree, nll = kl + float(k), agree + float(a), nll + float(n)
        out[v.name] = {"kl": max(kl / n_pos, 0.0), "top1": agree / n_pos,
                       "ppl": float(np.exp(nll / n_next))}
    return out


def layer_errors(fwd: LayerForward, v: Variant, tokens: np.ndarray) -> list[list[float]]:
    """[L][7] relative output error of each linear on the float inputs of held-out windows."""
    config = fwd.config
    x, positions = embed(v.reference, tokens)
    rows = []
    for i in range(config.num_layers):
        lp = layer_slice(v.reference, i)
        inputs, x = fwd.linear_inputs(lp, x, positions)
        row = []
        for block, name in LINEARS:
            w = lp[block][name]["kernel"]
            wq = jax.tree.map(lambda a: a[i], v.params["layers"][block][name]["kernel"])
            w_hat = dequantize_weight(wq) if is_quantized(wq) else wq
            xin = inputs[name]
            ref = dense_linear(xin, w)
            got = dense_linear(fake_quant_per_token(xin) if v.act8 else xin, w_hat)
            row.append(float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref)))
        rows.append(row)
    return rows


def weight_bytes(params: dict) -> tuple[int, int]:
    """(bytes of the decoder's linear kernels, bytes of all params)."""
    linear = sum(leaf.nbytes for block, name in LINEARS
                 for leaf in jax.tree.leaves(params["layers"][block][name]["kernel"]))
    return linear, sum(leaf.nbytes for leaf in jax.tree.leaves(params))


def decode_speed(model, params, quantization: str | None, new_tokens: int) -> float:
    """Batch-1 greedy tokens/s through the engine (second run; the first one compiles)."""
    from jaxserve import LLM, SamplingParams
    kw = {"quantization": quantization} if quantization else {}
    llm = LLM(dataclasses.replace(model, params=params), max_num_seqs=1, max_model_len=256,
              kv_cache_memory=1 << 26, warmup=False, **kw)
    prompt = [list(range(100, 116))]
    sp = SamplingParams(max_tokens=new_tokens, ignore_eos=True, temperature=0.0)
    llm.generate(prompt, sp, use_tqdm=False)
    start = time.perf_counter()
    out = llm.generate(prompt, sp, use_tqdm=False)
    return len(out[0].outputs[0].token_ids) / (time.perf_counter() - start)


def decode_speeds(model, variants: list[Variant], new_tokens: int) -> dict:
    """tokens/s per served format (methods of one format run the same kernels); None when this
    tree has no engine path for it, with the reason."""
    speeds = {}
    by_fmt = {}
    for v in variants:
        by_fmt.setdefault(v.fmt, v)
    for fmt, v in by_fmt.items():
        try:
            if fmt == "w8a8":  # served by the engine's own W8A8 path (quantizes at load)
                speeds[fmt] = decode_speed(model, model.params, "w8a8", new_tokens)
            else:
                speeds[fmt] = decode_speed(model, v.params, None, new_tokens)
        except Exception as e:  # noqa: BLE001 - a missing engine path is reported, not fatal
            speeds[fmt] = None
            speeds[f"{fmt}_error"] = f"{type(e).__name__}: {str(e)[:120]}"
    return speeds


# ---- the report -------------------------------------------------------------------------------

def run_report(model, calibration: Calibration, heldout: np.ndarray, *, decode_tokens: int = 0,
               progress: bool = True, error_windows: int = 4, int8_methods: bool = True) -> dict:
    c = model.config
    variants = build_variants(model, calibration, progress, int8_methods)
    metrics = evaluate(c, variants, heldout)
    speeds = decode_speeds(model, variants, decode_tokens) if decode_tokens else {}
    base_ppl = metrics["float32"]["ppl"]
    rows = []
    for v in variants:
        lin, total = weight_bytes(v.params)
        m = metrics[v.name]
        rows.append({"variant": v.name, "method": v.method, "format": v.fmt,
                     "kl": m["kl"], "top1": m["top1"], "ppl": m["ppl"],
                     "ppl_delta": m["ppl"] - base_ppl, "linear_bytes": lin, "total_bytes": total,
                     "decode_tok_s": speeds.get(v.fmt), "quantize_s": v.seconds})
    fwd = LayerForward(c)
    errors = {v.name: layer_errors(fwd, v, heldout[:error_windows]) for v in variants[1:]}
    groups = {}
    for block, name in LINEARS:
        k = int(model.params["layers"][block][name]["kernel"].shape[1])
        groups[name] = {"K": k, "int4_group": spec_for(k, INT4).group_size}
    return {
        "model": model.source, "config": {"layers": c.num_layers, "hidden": c.hidden_size,
                                          "intermediate": c.intermediate_size},
        "calibration": {"source": calibration.source, "windows": list(calibration.tokens.shape)},
        "heldout": {"windows": list(heldout.shape), "error_windows": min(error_windows,
                                                                         len(heldout))},
        "rows": rows, "layer_errors": errors, "linears": LINEAR_NAMES, "groups": groups,
        "decode": {"new_tokens": decode_tokens, "batch": 1,
                   **{k: v for k, v in speeds.items() if k.endswith("_error")}},
    }


def _fmt_speed(x):
    return "n/a" if x is None else f"{x:.1f}"


def markdown(report: dict, command: str, env: str) -> str:
    mib = 1 << 20
    lines = [
        "# Quantization quality report", "",
        f"Command: `{command}`  ", f"Environment: {env}  ",
        f"Model: `{report['model']}`; teacher: its float32 weights (GGUF, dequantized).  ",
        f"Calibration: {report['calibration']['source']}, "
        f"{report['calibration']['windows'][0]} windows x {report['calibration']['windows'][1]}"
        " tokens.  ",
        f"Held-out (scripts/quant_heldout.txt, not used to calibrate): "
        f"{report['heldout']['windows'][0]} windows x {report['heldout']['windows'][1]} tokens; "
        "KL(float32 || variant) and top-1 agreement averaged over every position; perplexity "
        "of the next token.  ",
        "int4 g128 = asymmetric, one scale and zero point per group of 128 input rows, or the "
        "largest of 64/32 dividing K: "
        + ", ".join(f"{n} K={g['K']}: g{g['int4_group']}" for n, g in report["groups"].items())
        + ". int8 per-channel = symmetric, one scale per output column. Embedding / LM head "
        "stay float32.", "",
        "| variant | KL (nats/token) | top-1 agree | perplexity | Δ ppl | linear weights MiB | "
        "all weights MiB | decode tok/s | quantize s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        lines.append(f"| {r['variant']} | {r['kl']:.4f} | {100 * r['top1']:.1f}% | "
                     f"{r['ppl']:.3f} | {r['ppl_delta']:+.3f} | {r['linear_bytes'] / mib:.1f} | "
                     f"{r['total_bytes'] / mib:.1f} | {_fmt_speed(r['decode_tok_s'])} | "
                     f"{r['quantize_s']:.0f} |")
    dec = report["decode"]
    lines += ["", f"Decode: batch 1, 16-token prompt, {dec['new_tokens']} new tokens, greedy, "
              "through the engine (XLA backends), second run; every method of one format runs "
              "the same kernels, so they share one measurement."]
    for k, v in dec.items():
        if k.endswith("_error"):
            lines.append(f"{k[:-6]}: not measured ({v}).")
    names = report["linears"]
    lines += ["", "## Relative output error per linear (mean over layers)", "",
              "||X W - X W_hat|| / ||X W|| with X the float model's inputs on "
              f"{report['heldout']['error_windows']} held-out windows.", "",
              "| variant | " + " | ".join(names) + " | mean |",
              "|---|" + "---:|" * (len(names) + 1)]
    for name, errs in report["layer_errors"].items():
        e = np.asarray(errs)
        lines.append(f"| {name} | " + " | ".join(f"{x:.4f}" for x in e.mean(0))
                     + f" | {e.mean():.4f} |")
    for name, errs in report["layer_errors"].items():
        if not name.endswith("int4 g128"):
            continue
        lines += ["", f"### {name}: per layer", "",
                  "| layer | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
        for i, row in enumerate(errs):
            lines.append(f"| {i} | " + " | ".join(f"{x:.4f}" for x in row) + " |")
    lines += ["", "Per-layer errors of the int8 and W8A8 variants are in the JSON file."]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: pathlib.Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 4.5))
    rows = [r for r in report["rows"] if r["variant"] != "float32"]
    ax1.bar(range(len(rows)), [max(r["kl"], 1e-8) for r in rows],
            color=["C0" if "int4" in r["variant"] else "C1" for r in rows])
    ax1.set_xticks(range(len(rows)), [r["variant"].split(" (")[0] for r in rows], rotation=30,
                   ha="right", fontsize=8)
    ax1.set_yscale("log")
    ax1.set_ylabel("KL(float32 || variant), nats/token")
    ax1.set_title("Next-token KL on held-out text")
    for name, errs in report["layer_errors"].items():
        e = np.asarray(errs).mean(1)
        ax2.plot(range(len(e)), e, "-" if "int4" in name else "--", label=name.split(" (")[0])
    ax2.set_yscale("log")
    ax2.set_xlabel("layer")
    ax2.set_ylabel("mean relative output error of the 7 linears")
    ax2.set_title("Per-layer error")
    ax2.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_outputs(report: dict, prefix: pathlib.Path, command: str, env: str) -> list[pathlib.Path]:
    prefix.parent.mkdir(parents=True, exist_ok=True)
    written = [prefix.with_suffix(".json"), prefix.with_suffix(".md")]
    prefix.with_suffix(".json").write_text(json.dumps(dict(report, command=command, env=env),
                                                      indent=1))
    md = markdown(report, command, env)
    png = prefix.with_suffix(".png")
    if plot(report, png):
        md += f"\n![KL and per-layer error]({png.name})\n"
        written.append(png)
    else:
        md += "\n(No plot: matplotlib is not installed; `pip install .[dev]`.)\n"
    prefix.with_suffix(".md").write_text(md)
    return written


def environment() -> str:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{describe()} (load average {load:.1f} at the end: "
            f"shared with other jobs), jax {jax.__version__} {jax.default_backend()}, "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--quick", action="store_true",
                    help="4 calibration and 2 held-out windows of 64 tokens, 8 decode tokens, "
                    "GPTQ and AWQ at int4 only, no act-order (about 4 minutes on a busy 2-core "
                    "CPU)")
    ap.add_argument("--calibration", default=None, help="calibration text file (default: the "
                    "built-in text)")
    ap.add_argument("--heldout", default=str(HELDOUT), help="held-out text file")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--calib-seqs", type=int, default=32)
    ap.add_argument("--heldout-seqs", type=int, default=16)
    ap.add_argument("--decode-tokens", type=int, default=64, help="0: skip the speed runs")
    ap.add_argument("--out", default=str(REPO / "docs" / "results" / "quant_report"),
                    help="output prefix (.md, .json, .png)")
    args = ap.parse_args(argv)
    if args.quick:
        args.seq_len, args.calib_seqs, args.heldout_seqs = 64, 4, 2
        args.decode_tokens = min(args.decode_tokens, 8)
    from models import load_model
    model = load_model(args.model, "float32")
    calibration = load_calibration(model, args.calibration, args.seq_len, args.calib_seqs)
    text = pathlib.Path(args.heldout).read_text(encoding="utf-8")
    heldout = from_text(model.tokenizer, text, args.seq_len, args.heldout_seqs, "held-out").tokens
    start = time.perf_counter()
    report = run_report(model, calibration, heldout, decode_tokens=args.decode_tokens,
                        int8_methods=not args.quick)
    report["seconds"] = time.perf_counter() - start
    command = "PYTHONPATH=$PWD .venv/bin/python scripts/quant_report.py " + shlex.join(
        sys.argv[1:] if argv is None else argv)
    for path in write_outputs(report, pathlib.Path(args.out), command.strip(), environment()):
        print(f"wrote {path}")
    print(markdown(report, command, environment()).split("\n## ")[0])


if __name__ == "__main__":
    main()
