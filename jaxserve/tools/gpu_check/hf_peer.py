"""Section `hf_peer`: HF transformers `generate` on the same device, SmolLM2 shapes, bf16 (the
GGUF's weights when given, else random ones of the same config)."""

from __future__ import annotations

import gc
import importlib.metadata
import pathlib
import time

from jaxserve.tools.gpu_check.context import Ctx, importable
from jaxserve.tools.gpu_check.profiles import TOKEN_LOW, model_configs


def hf_model(ctx: Ctx, torch, device):
    """SmolLM2 in HF: from the GGUF (needs the gguf package) or random weights, same config."""
    import transformers
    path = ctx.args.gguf
    if path and pathlib.Path(path).is_file() and importable("gguf") is None:
        p = pathlib.Path(path)
        m = transformers.AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name)
        return m.to(device=device, dtype=torch.bfloat16).eval(), f"gguf {path}"
    c = model_configs(ctx.args.dry_run)["smollm2"]
    hc = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings)
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(hc).to(device=device, dtype=torch.bfloat16).eval()
    why = "no --gguf given" if not path else "GGUF or the gguf package unavailable"
    return m, f"random weights, SmolLM2 config ({why})"


def hf_decode(torch, model, device, batch: int, prompt_len: int, new_tokens: int) -> dict:
    """Greedy generate of exactly new_tokens per row; decode time starts at the first logits."""
    import numpy as np
    from transformers import LogitsProcessor, LogitsProcessorList
    first = []

    class Timer(LogitsProcessor):
        def __call__(self, input_ids, scores):
            if not first:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                first.append(time.perf_counter())
            return scores

    ids = np.random.default_rng(batch).integers(TOKEN_LOW, min(model.config.vocab_size, 40000),
                                                size=(batch, prompt_len))
    ids = torch.tensor(ids, device=device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             do_sample=False, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, pad_token_id=0,
                             logits_processor=LogitsProcessorList([Timer()]))
    if device.type == "cuda":
        torch.cuda.synchronize()
    end = time.perf_counter()
    got = out.shape[1] - prompt_len
    return {"batch": batch, "prompt_len": prompt_len, "new_tokens": got, "wall_s": end - t0,
            "overall_tok_s": batch * got / (end - t0),
            "decode_tok_s": batch * (got - 1) / (end - first[0]) if got > 1 else float("nan")}


def section_hf_peer(ctx: Ctx) -> dict:
    for mod in ("torch", "transformers"):
        why = importable(mod)
        if why:
            return {"_status": "skipped", "_reason": f"{mod} not importable here ({why})"}
    import torch
    if not ctx.args.dry_run and not torch.cuda.is_available():
        return {"_status": "skipped", "_reason": "torch sees no CUDA device"}
    device = torch.device("cuda" if torch.cuda.is_available() and not ctx.args.dry_run
                          else "cpu")
    model, source = hf_model(ctx, torch, device)
    p = ctx.prof
    res = {"source": source, "device": str(device), "torch": torch.__version__,
           "transformers": importlib.metadata.version("transformers"), "dtype": "bfloat16",
           "runs": []}
    for batch in p.e2e_batches:
        if ctx.over_budget():
            res["runs"].append({"batch": batch, "skipped": ctx.budget_reason()})
            continue
        hf_decode(torch, model, device, batch, p.prompt_len, 4)  # warm-up
        res["runs"].append(hf_decode(torch, model, device, batch, p.prompt_len, p.new_tokens))
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res
