"""Multi-LoRA serving against HF transformers + PEFT on the same tiny random models and random
adapters (tests/lora_reference.py): one batch mixes every adapter of a model and the base,
with fewer device slots than adapters (so slots are swapped mid-run), chunked prefill and
prefix caching on; every request's greedy tokens and top-5 logprobs equal PEFT's. Also on the
Pallas kernel in interpret mode, and with an int8 base against the dequantized weights with the
adapters merged."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxserve import EngineConfig, LLMEngine, LoRARequest, SamplingParams
from jaxserve.quantization.core import dequantize_weight
from jaxserve.quantization.paths import prepare_model
from lora_reference import ADAPTERS, MAX_NEW_TOKENS, MAX_RANK, PROMPTS, TOP_K, lora_reference
from models import load_model
from models.quantized import is_quantized

pytestmark = pytest.mark.hf_ref

LOGPROB_ATOL = 2e-4  # float32, as the other HF comparisons (tests/modeling/test_model_hf.py)
ENGINE = dict(block_size=16, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=64,
              kv_cache_memory=1 << 22, dtype="float32", warmup=False, enable_lora=True,
              max_lora_rank=MAX_RANK)


def adapters_of(model: str) -> list[str]:
    return [a["name"] for a in ADAPTERS if a["model"] == model]


def run(engine: LLMEngine, jobs: list[tuple[list[int], LoRARequest | None]]) -> list:
    """Every job at once (one batch); returns each one's (tokens, top-k logprobs per step)."""
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True,
                            logprobs=TOP_K)
    for i, (prompt, lora) in enumerate(jobs):
        engine.add_request(str(i), prompt, params, lora_request=lora)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    return [(done[str(i)].token_ids, done[str(i)].logprobs) for i in range(len(jobs))]


def check(ref, variant: str, i: int, tokens, logprobs):
    a = ref.arrays
    assert list(tokens) == a[f"{variant}/greedy/{i}"].tolist(), (variant, i)
    for step, top in enumerate(logprobs):
        ids, lps = a[f"{variant}/topk_ids/{i}"][step], a[f"{variant}/topk_logprobs/{i}"][step]
        # Near-ties may order differently: compare the values of the reference's top ids.
        got = np.array([top.get(int(t), -np.inf) for t in ids])
        np.testing.assert_allclose(got, lps, atol=LOGPROB_ATOL, err_msg=f"{variant} {i} {step}")


def jobs_for(ref, model: str, prompts=range(len(PROMPTS))):
    """Each prompt on the base and on every adapter of `model`, interleaved."""
    names = [None] + adapters_of(model)
    jobs, keys = [], []
    for i in prompts:
        for k, name in enumerate(names):
            lora = None if name is None else LoRARequest(name, k, str(ref.adapter_dir(name)))
            jobs.append((PROMPTS[i], lora))
            keys.append((name or model, i))
    return jobs, keys


@pytest.mark.parametrize("model", ["llama", "qwen2", "phi3"])
def test_mixed_adapters_equal_peft(model):
    ref = lora_reference()
    base = load_model(ref.model_dir(model), dtype="float32")
    # Fewer slots than adapters: llama's five share three slots over the run.
    engine = LLMEngine(EngineConfig(model=str(ref.model_dir(model)), max_loras=3, **ENGINE),
                       model=base)
    jobs, keys = jobs_for(ref, model)
    for (variant, i), (tokens, logprobs) in zip(keys, run(engine, jobs)):
        check(ref, variant, i, tokens, logprobs)
    stats = engine.stats()["lora"]
    assert stats["loaded"] == len(adapters_of(model))
    if len(adapters_of(model)) > 3:
        assert stats["device_loads"] > 3  # slots were reused


def test_mixed_adapters_equal_peft_on_the_pallas_kernel():
    """The same batch with the adapters' delta in the Pallas kernel (interpret mode)."""
    ref = lora_reference()
    base = load_model(ref.model_dir("llama"), dtype="float32")
    engine = LLMEngine(EngineConfig(model="llama", max_loras=3, linear_backend="pallas-interpret",
                                    attention_backend="xla", **ENGINE), model=base)
    jobs, keys = jobs_for(ref, "llama", prompts=[0, 3])
    for (variant, i), (tokens, logprobs) in zip(keys, run(engine, jobs)):
        check(ref, variant, i, tokens, logprobs)


def _merged_on_dequantized(ref, base_float, quantized, adapter):
    """The int8 base dequantized, plus PEFT's merge delta (merged - base) of `adapter`."""
    def deq(x):
        # Layer weights are stacked [L, ...]: dequantized layer by layer.
        if not is_quantized(x):
            return np.array(x, np.float32)
        stacked = jax.tree.leaves(x)[0].ndim > 2
        w = jax.vmap(dequantize_weight)(x) if stacked else dequantize_weight(x)
        return np.array(w, np.float32)  # a copy, written below
    params = jax.tree.map(deq, quantized.params, is_leaf=is_quantized)
    layers = params["layers"]  # fresh dicts and arrays (tree.map): written in place
    prefix = f"{adapter}/merged/"
    for key, merged in ref.arrays.items():
        if not key.startswith(prefix):
            continue
        name = key[len(prefix):]  # model.layers.{i}.{self_attn|mlp}.{module}.weight
        parts = name.split(".")
        layer, block, module = int(parts[2]), parts[3], parts[4]
        parent = "attn" if block == "self_attn" else "mlp"
        float_kernel = np.asarray(base_float.params["layers"][parent][module]["kernel"][layer])
        delta = merged.T - float_kernel  # [K, N]: what the adapter adds
        layers[parent][module]["kernel"][layer] += delta
    return params


# w8a16: per-channel int8 on XLA's dot, layers in a scan; w4a16: the native matmul's packed
# weights, layers unrolled with the weights left stacked (the adapter slots per layer).
@pytest.mark.parametrize("quantization", ["w8a16", "w4a16"])
def test_adapters_over_a_quantized_base_equal_the_dequantized_merge(quantization):
    ref = lora_reference()
    base = load_model(ref.model_dir("llama"), dtype="float32")
    quantized, _ = prepare_model(base, quantization)
    engine = LLMEngine(EngineConfig(model="llama", max_loras=2, quantization=quantization,
                                    **ENGINE), model=base)
    layout = set(engine.runner.model.params) & {"layers", "layers_0"}
    assert layout == ({"layers"} if quantization == "w8a16" else {"layers", "layers_0"})
    names = ["llama_all_r8", "llama_qv_r4"]
    jobs = [(PROMPTS[i], LoRARequest(n, k + 1, str(ref.adapter_dir(n))))
            for i in (0, 2) for k, n in enumerate(names)]
    results = run(engine, jobs)
    for (prompt, lora), (tokens, logprobs) in zip(jobs, results):
        oracle = dataclasses.replace(
            base, params=jax.tree.map(np.asarray, _merged_on_dequantized(
                ref, base, quantized, lora.lora_name)))
        assert list(tokens) == oracle.greedy_generate(prompt, MAX_NEW_TOKENS,
                                                      stop_token_ids=[])
        logits = oracle.forward_logits(list(prompt) + list(tokens))[len(prompt) - 1:-1]
        lsm = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1,
                              keepdims=True)) - logits.max(-1, keepdims=True)
        for step, top in enumerate(logprobs):
            for tok, lp in top.items():
                assert abs(lp - lsm[step, tok]) < LOGPROB_ATOL, (lora.lora_name, step, tok)
