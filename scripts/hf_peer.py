"""Peer runner for scripts/bench_throughput.py: HF transformers (or llama.cpp) on one workload.

Run by the benchmark in a separate interpreter (.venv-ref for HF, the one given by
--llama-cpp-python for llama.cpp); reads a JSON workload, writes JSON timings. Not meant to be
run by hand, but it can be:

    .venv-ref/bin/python scripts/hf_peer.py --workload w.json --out r.json [--engine llama_cpp]

Workload JSON: {"model_path": ".../x.gguf", "threads": 2, "hf_batch_size": 16,
"hf_dtypes": ["float32", "bfloat16"], "throughput_dtypes": ["bfloat16"] (default: hf_dtypes),
"requests": [{"prompt": [ids], "max_tokens": n}, ...],
"batch1": {"prompt": [ids], "max_tokens": 128, "dtypes": ["float32"]}}.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import time


# ---- HF transformers ---------------------------------------------------------------------------

def load_hf(model_path: str, threads: int):
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(threads)
    path = pathlib.Path(model_path)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32)
    model.eval()
    return model, time.perf_counter() - t0


def first_token_timer():
    """A logits processor that records when generate() first asks for logits (prefill done)."""
    from transformers import LogitsProcessor

    class Timer(LogitsProcessor):
        def __init__(self):
            self.first = None

        def __call__(self, input_ids, scores):
            if self.first is None:
                self.first = time.perf_counter()
            return scores

    return Timer()


def hf_generate(model, prompts: list[list[int]], new_tokens: int, pad_id: int, timer=None):
    """Greedy static batch, left padded; exactly `new_tokens` per row (EOS suppressed)."""
    import torch
    from transformers import LogitsProcessorList
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    extra = {"logits_processor": LogitsProcessorList([timer])} if timer is not None else {}
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             pad_token_id=pad_id, **extra)
    generated = out.shape[1] - width
    if generated != new_tokens:
        raise RuntimeError(f"HF generated {generated} tokens, expected {new_tokens}")
    return out


def hf_throughput(model, requests: list[dict], batch_size: int, pad_id: int) -> dict:
    """Static batches in arrival order; each runs to its longest requested output."""
    own = sum(r["max_tokens"] for r in requests)
    prompt_tokens = sum(len(r["prompt"]) for r in requests)
    computed, batches = 0, []
    t0 = time.perf_counter()
    for start in range(0, len(requests), batch_size):
        batch = requests[start:start + batch_size]
        new = max(r["max_tokens"] for r in batch)
        tb = time.perf_counter()
        hf_generate(model, [r["prompt"] for r in batch], new, pad_id)
        batches.append({"size": len(batch), "new_tokens": new,
                        "seconds": time.perf_counter() - tb})
        computed += new * len(batch)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "num_requests": len(requests), "output_tokens": own,
            "prompt_tokens": prompt_tokens, "tokens_computed_incl_padding": computed,
            "output_tok_s": own / seconds, "prompt_tok_s": prompt_tokens / seconds,
            "batches": batches}


def hf_batch1(model, prompt: list[int], new_tokens: int, pad_id: int, repeats: int) -> dict:
    best = None
    for _ in range(repeats):
        timer = first_token_timer()
        t0 = time.perf_counter()
        out = hf_generate(model, [prompt], new_tokens, pad_id, timer)
        end = time.perf_counter()
        run = {"seconds": end - t0, "ttft_s": timer.first - t0,
               "tok_s": new_tokens / (end - t0),
               "decode_tok_s": (new_tokens - 1) / (end - timer.first),
               "token_ids": out[0, len(prompt):].tolist()}
        if best is None or run["seconds"] < best["seconds"]:
            best = run
    return best


def run_hf(work: dict) -> dict:
    import torch
    import transformers
    model, load_s = load_hf(work["model_path"], work["threads"])
    pad_id = model.config.eos_token_id
    pad_id = pad_id[0] if isinstance(pad_id, list) else (pad_id if pad_id is not None else 0)
    result = {"torch": torch.__version__, "transformers": transformers.__version__,
              "threads": torch.get_num_threads(), "load_seconds": load_s, "pad_token_id": pad_id,
              "throughput": {}, "batch1": {}}
    b1 = work.get("batch1")
    for dtype in work["hf_dtypes"]:
        model = model.to(getattr(torch, dtype))
        t0 = time.perf_counter()
        warm = [r["prompt"] for r in work["requests"][:work["hf_batch_size"]]]
        hf_generate(model, warm or [[100 + i for i in range(16)]], 4, pad_id)  # untimed
        result.setdefault("warmup_seconds", {})[dtype] = time.perf_counter() - t0
        if work["requests"] and dtype in work.get("throughput_dtypes", work["hf_dtypes"]):
            result["throughput"][dtype] = hf_throughput(model, work["requests"],
                                                        work["hf_batch_size"], pad_id)
        if b1 and dtype in b1["dtypes"]:
            result["batch1"][dtype] = hf_batch1(model, b1["prompt"], b1["max_tokens"], pad_id,
                                                b1.get("repeats", 1))
    return result


# ---- llama.cpp ---------------------------------------------------------------------------------

def run_llama_cpp(work: dict) -> dict:
    """Batch-1 greedy decode with llama.cpp on the GGUF as shipped (its own quantized kernels).

    Through llama-cpp-python's low-level API: the high-level `Llama` constructor has no
    `use_extra_bufts` argument, and the AMX extra buffer type it leaves on segfaults on these
    CPUs, so the model is loaded from a params struct with it off."""
    import llama_cpp
    llama_cpp.llama_backend_init()
    mparams = llama_cpp.llama_model_default_params()
    mparams.use_extra_bufts = False
    model = llama_cpp.llama_model_load_from_file(work["model_path"].encode(), mparams)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {work['model_path']}")
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx, cparams.n_batch = 1024, 512
    cparams.n_threads = cparams.n_threads_batch = work["threads"]
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    sampler = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    llama_cpp.llama_sampler_chain_add(sampler, llama_cpp.llama_sampler_init_greedy())
    b1 = work["batch1"]

    def decode(ids: list[int]) -> None:
        arr = (llama_cpp.llama_token * len(ids))(*ids)
        if llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(arr, len(ids))) != 0:
            raise RuntimeError("llama_decode failed")

    best, tokens = None, None
    for _ in range(b1.get("repeats", 1) + 1):  # the first run is a warm-up
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
        llama_cpp.llama_sampler_reset(sampler)
        out = []
        t0 = time.perf_counter()
        decode(list(b1["prompt"]))
        first = None
        while len(out) < b1["max_tokens"]:  # EOS ignored, as for the other systems
            tok = llama_cpp.llama_sampler_sample(sampler, ctx, -1)
            out.append(int(tok))
            first = first or time.perf_counter()
            if len(out) < b1["max_tokens"]:
                decode([tok])
        end = time.perf_counter()
        n = len(out)
        run = {"seconds": end - t0, "ttft_s": first - t0, "tok_s": n / (end - t0),
               "decode_tok_s": (n - 1) / (end - first), "new_tokens": n}
        if best is None or run["seconds"] < best["seconds"]:
            best, tokens = run, out
    llama_cpp.llama_sampler_free(sampler)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)
    return {"llama_cpp": llama_cpp.__version__, "threads": work["threads"],
            "use_extra_bufts": False, "batch1": best, "token_ids": tokens}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", required=True, help="input JSON (see the module docstring)")
    ap.add_argument("--out", required=True, help="where to write the JSON timings")
    ap.add_argument("--engine", choices=("hf", "llama_cpp"), default="hf")
    args = ap.parse_args()
    work = json.loads(pathlib.Path(args.workload).read_text())
    result = run_hf(work) if args.engine == "hf" else run_llama_cpp(work)
    result["python"] = platform.python_version()
    pathlib.Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
