"""Tensor-parallel runs in a fresh process with 8 host devices
(tests/runtime/test_tensor_parallel.py).

XLA's device count is fixed when JAX starts, and the rest of the suite runs with one device, so
the tests start this script, which runs the cases it is given and prints one JSON line.
"""

import dataclasses
import json
import os
import sys

import numpy as np

from hlo_collectives import collectives_in_layer_loop
from jaxserve import EngineConfig, LLMEngine, SamplingParams
from jaxserve.runtime.sharding import bytes_per_device
from models.config import ModelConfig
from models.model import enable_compilation_cache
from models.random_init import random_model

# GQA (2 query heads per KV head); both head counts divide by 8; head_dim 64 is the kernel's.
GQA = ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2,
                  num_heads=16, num_kv_heads=8, head_dim=64, max_position_embeddings=256)
# SmolLM2's head counts (9 query, 3 KV): padded/replicated for every N > 1.
SMOL_HEADS = ModelConfig(vocab_size=256, hidden_size=96, intermediate_size=256, num_layers=2,
                         num_heads=9, num_kv_heads=3, head_dim=32, max_position_embeddings=256,
                         tie_word_embeddings=True)
# GQA's attention with a MoE MLP (4 experts, top-2): experts split on F over the devices.
MOE = ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2,
                  num_heads=16, num_kv_heads=8, head_dim=64, max_position_embeddings=256,
                  architecture="mixtral", num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=128, norm_topk_prob=True)
# Gemma 2's attention (tests/runtime/test_windowed_tp.py): a local layer with a window shorter than
# the prompts, a global one, soft-caps and query_pre_attn_scalar; head_dim 64 for the kernel.
GEMMA2 = ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=64, max_position_embeddings=256,
                     tie_word_embeddings=True, architecture="gemma2", sliding_window=6,
                     layer_types=("sliding_attention", "full_attention"),
                     attn_logit_softcapping=3.0, final_logit_softcapping=5.0,
                     query_pre_attn_scalar=32.0, hidden_act="gelu_pytorch_tanh")
KV_BYTES = 4 << 20  # per device


def engine(model, n, **kw):
    kw = dict(dict(block_size=16, max_num_seqs=2, max_model_len=64, max_num_batched_tokens=32,
                   warmup=False, kv_cache_memory=KV_BYTES), **kw)
    return LLMEngine(EngineConfig(model="tiny", tensor_parallel_size=n, **kw), model=model)


def greedy(eng, prompts, max_tokens=5):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params)
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [list(done[str(i)]) for i in range(len(prompts))]


def prompt_logprobs(eng, prompts):
    """Each prompt's prompt logprobs of its own tokens (positions 1..)."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    for i, p in enumerate(prompts):
        eng.add_request(f"p{i}", p, params)
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = [e[t] for e, t in zip(out.prompt_logprobs[1:],
                                                             out.prompt_token_ids[1:])]
    return [done[f"p{i}"] for i in range(len(prompts))]


def prompts(vocab, lengths=(5, 20)):
    rng = np.random.default_rng(0)
    return [rng.integers(1, vocab, n).tolist() for n in lengths]


def shared_prefix_waves(vocab):
    """Two waves of prompts on one 20-token prefix (a full block of 16 and a partial one).

    The second wave hits the prefix cache, and every request forks into n branches that write
    into their shared partial block: copy-on-write copies.
    """
    rng = np.random.default_rng(1)
    prefix = rng.integers(1, vocab, 20).tolist()
    return [[prefix + rng.integers(1, vocab, 3).tolist()],
            [prefix + rng.integers(1, vocab, n).tolist() for n in (2, 7)]]


def greedy_waves(eng, waves, n=2, max_tokens=5):
    """Each wave's requests (n greedy branches each) run to the end before the next is added."""
    params = SamplingParams(n=n, temperature=0, max_tokens=max_tokens, ignore_eos=True)
    out = []
    for w, wave in enumerate(waves):
        for i, p in enumerate(wave):
            eng.add_request(f"{w}.{i}", p, params)
        done = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = [list(c.token_ids) for c in o.outputs]
        out += [done[f"{w}.{i}"] for i in range(len(wave))]
    return out


def memory(eng):
    """Per-device bytes of weights and KV cache, read from the arrays' shards."""
    r = eng.runner
    return {"weights": sorted(bytes_per_device(eng.model.params).values()),
            "kv": sorted(bytes_per_device(r.cache).values()),
            "num_blocks": int(r.cache.k.shape[1]),
            "heads": [r.model.config.num_heads, r.model.config.num_kv_heads]}


def case_tokens(config_name, sizes, qk_norm="none", **kw):
    config = {"gqa": GQA, "smol_heads": SMOL_HEADS, "moe": MOE, "gemma2": GEMMA2}[config_name]
    config = dataclasses.replace(config, qk_norm=qk_norm)  # Qwen3 / OLMoE attention norms
    model = random_model(config, seed=3)
    ps = prompts(config.vocab_size)
    out = {}
    for n in sizes:
        eng = engine(model, n, **kw)
        out[n] = {"tokens": greedy(eng, ps), **memory(eng)}
    return out


def case_warmup(n):
    """Sharded inputs must not retrace: nothing compiles after warm-up."""
    eng = engine(random_model(GQA, seed=3), n, warmup=True)
    tokens = greedy(eng, prompts(GQA.vocab_size))
    return {"tokens": tokens, "compiled": eng.runner.num_compiled,
            "after_warmup": eng.stats()["num_compiles_after_warmup"]}


def case_hlo(n, **kw):
    model = random_model(GQA, seed=3)
    r = engine(model, n, **kw).runner
    out = {}
    for tokens in (2, 32):  # a decode-sized and a prefill-sized ragged step
        idle = r.step_template(tokens)
        hlo = r._step.lower(r.model.params, r.cache, r.state, idle.inputs).compile().as_text()
        out["decode" if tokens == 2 else "prefill"] = collectives_in_layer_loop(hlo)
    return out


def case_int4(sizes, linear_backend="xla", quantization="int4"):
    model = random_model(GQA, seed=3)
    ps = prompts(GQA.vocab_size)
    return {n: {"tokens": greedy(engine(model, n, quantization=quantization,
                                        linear_backend=linear_backend), ps)} for n in sizes}


def case_smollm2(sizes):
    from models import load_model
    model = load_model("smollm2-135m", "float32")  # real weights, with the compilation cache
    tok = model.tokenizer
    texts = ["The capital of France is", "def fibonacci(n):", "List three colors:"]
    ps = [[tok.bos_token_id] * bool(tok.add_bos and tok.bos_token_id is not None)
          + tok.encode(t) for t in texts]
    out = {}
    for n in sizes:
        eng = engine(model, n, max_model_len=256, max_num_seqs=4, kv_cache_memory=64 << 20,
                     quantization="none")  # float on every size (auto: gguf on one)
        out[n] = {"tokens": greedy(eng, ps, max_tokens=16), **memory(eng)}
    return out


def case_lora(sizes):
    """Adapters over a tensor-parallel base: two adapters and the base in one batch; the slots'
    partition specs follow their kernels' roles."""
    import tempfile

    from jaxserve import LoRARequest
    from jaxserve.testing.peft_files import write_adapter
    model = random_model(GQA, seed=3)
    ps = prompts(GQA.vocab_size)
    out = {}
    with tempfile.TemporaryDirectory() as root:
        loras = [None] + [LoRARequest(f"a{i}", i, f"{root}/a{i}") for i in (1, 2)]
        write_adapter(loras[1].lora_path, GQA, rank=8, seed=1,
                      targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                               "down_proj"])
        write_adapter(loras[2].lora_path, GQA, rank=4, seed=2, targets=["v_proj", "down_proj"])
        for n in sizes:
            eng = engine(model, n, max_num_seqs=6, enable_lora=True, max_loras=2,
                         max_lora_rank=8)
            params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
            for i, (p, lora) in enumerate((p, lora) for p in ps for lora in loras):
                eng.add_request(str(i), p, params, lora_request=lora)
            done = {}
            while eng.has_unfinished_requests():
                for o in eng.step():
                    if o.finished:
                        done[int(o.request_id)] = list(o.outputs[0].token_ids)
            layers = eng.runner.model.params["layers"]
            specs = {name: [str(getattr(layers[parent][name][leaf].sharding, "spec", None))
                            for leaf in ("lora_a", "lora_b")]
                     for parent, name in (("attn", "q_proj"), ("mlp", "down_proj"))}
            out[n] = {"tokens": [done[i] for i in range(len(done))], "specs": specs}
    return out


def case_embed(sizes):
    """Mean-pooled embeddings (one prompt chunked) in the same steps as greedy generation:
    each size's embeddings and generated tokens."""
    from jaxserve import PoolingParams
    model = random_model(GQA, seed=3)
    embeds, gens = prompts(GQA.vocab_size, lengths=(40, 3)), prompts(GQA.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    out = {}
    for n in sizes:
        eng = engine(model, n, enable_embeddings=True, pooling="mean")
        for i, p in enumerate(gens):
            eng.add_request(f"g{i}", p, params)
        for i, p in enumerate(embeds):
            eng.add_request(f"e{i}", p, PoolingParams())
        done = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o
        out[n] = {"tokens": [list(done[f"g{i}"].outputs[0].token_ids) for i in range(len(gens))],
                  "embeddings": [done[f"e{i}"].outputs.embedding for i in range(len(embeds))]}
    return out


CASES = {"lora": case_lora, "tokens": case_tokens, "hlo": case_hlo, "int4": case_int4, "smollm2": case_smollm2,
         "warmup": case_warmup, "embed": case_embed}


def main(argv):
    """argv[0]: JSON {label: [case, kwargs]}; prints RESULT {label: result} (one JAX start)."""
    enable_compilation_cache()
    jobs = json.loads(argv[0])
    results = {label: CASES[case](**kwargs) for label, (case, kwargs) in jobs.items()}
    print("RESULT " + json.dumps(results), flush=True)
    return 0


if __name__ == "__main__":
    # Read when JAX first touches a device (not at import), so importers keep their own.
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.exit(main(sys.argv[1:]))
