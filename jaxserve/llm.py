"""`LLM`: the offline batch API. `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import dataclasses
import numbers
from typing import Sequence

from tqdm import tqdm

from jaxserve.config import EngineConfig
from jaxserve.core.lora import LoRARequest
from jaxserve.engine import LLMEngine
from jaxserve.core.outputs import RequestOutput
from jaxserve.core.pooling import EmbeddingRequestOutput, PoolingParams
from jaxserve.core.sampling_params import RequestOutputKind, SamplingParams
from models import Model


class LLM:
    """Loads a model once and generates for batches of prompts with continuous batching.

    Keyword arguments are EngineConfig fields (dtype, block_size, max_num_seqs,
    max_num_batched_tokens, max_model_len, kv_cache_memory, ...).
    """

    def __init__(self, model: str | Model = "smollm2-135m", *, draft_model: Model | None = None,
                 **engine_kwargs):
        # draft_model: a loaded draft for speculative_config={"method": "draft_model", ...}.
        if isinstance(model, Model):
            config = EngineConfig(model=model.source, dtype=model.dtype, **engine_kwargs)
            self.engine = LLMEngine(config, model=model, draft_model=draft_model)
        else:
            self.engine = LLMEngine(EngineConfig(model=str(model), **engine_kwargs),
                                    draft_model=draft_model)

    @property
    def tokenizer(self):
        return self.engine.model.tokenizer

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 priority: int | Sequence[int] = 0,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 ) -> list[RequestOutput]:
        """One output per prompt, in input order. Prompts are strings or lists of token ids.

        priority: one per prompt or one for all; lower runs first (FCFS within a priority) and
        is preempted last. lora_request: the LoRA adapter (engine started with
        enable_lora=True) of all prompts, or one (or None: the base model) per prompt."""
        prompts = _prompt_list(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"got {len(sampling_params)} SamplingParams for "
                                 f"{len(prompts)} prompts")
            params = list(sampling_params)
        else:
            params = [sampling_params or SamplingParams()] * len(prompts)
        params = _final_only(params)
        priorities = _per_prompt(priority, len(prompts), "priorities")
        loras = _per_prompt(lora_request, len(prompts), "LoRA requests")
        return self._run(self._add(prompts, params, priorities, loras), use_tqdm)

    def embed(self, prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
              pooling_params: PoolingParams | None = None, use_tqdm: bool = True,
              lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
              ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in input order (vLLM's LLM.embed): `.outputs.embedding`
        is the prompt's pooled final hidden state (EngineConfig.pooling: last token or mean),
        L2-normalised. Needs an engine started with enable_embeddings=True; the prompts run in
        the same batches as any generation. lora_request: as in `generate`."""
        prompts = _prompt_list(prompts)
        loras = _per_prompt(lora_request, len(prompts), "LoRA requests")
        params = [pooling_params or PoolingParams()] * len(prompts)
        ids = self._add(prompts, params, [0] * len(prompts), loras)
        return self._run(ids, use_tqdm, desc="embedding")

    def _add(self, prompts, params, priorities, loras) -> list[str]:
        """Adds one request per prompt; all or nothing. Returns their ids."""
        engine = self.engine
        ids = []
        try:
            for prompt, p, prio, lora in zip(prompts, params, priorities, loras):
                rid = engine.next_request_id()
                engine.add_request(rid, prompt, p, priority=prio, lora_request=lora)
                ids.append(rid)
        except Exception:
            for rid in ids:  # nothing half-submitted stays in the engine
                engine.abort(rid)
            raise
        return ids

    def _run(self, ids: list[str], use_tqdm: bool, desc: str = "generating") -> list:
        results: dict = {}
        wanted = set(ids)
        with tqdm(total=len(ids), desc=desc, unit="req", disable=not use_tqdm) as bar:
            while len(results) < len(ids) and self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        results[out.request_id] = out
                        bar.update(1)
        return [results[rid] for rid in ids]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
             ) -> list[RequestOutput]:
        """Applies the model's chat template to one conversation or a list of them.
        lora_request: as in `generate`."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(list(c), add_generation_prompt)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def reset_prefix_cache(self) -> int:
        """Forgets cached prompt prefixes no request holds (e.g. between benchmark passes)."""
        return self.engine.reset_prefix_cache()

    def stats(self) -> dict:
        return self.engine.stats()


def _prompt_list(prompts) -> list:
    """One prompt (a string or token ids) or a list of them -> a list of prompts."""
    if isinstance(prompts, str) or (len(prompts) and isinstance(prompts[0], numbers.Integral)):
        return [prompts]
    return list(prompts)


def _per_prompt(value, n: int, what: str) -> list:
    """One value for every prompt, or a list or tuple of one per prompt."""
    values = list(value) if isinstance(value, (list, tuple)) else [value] * n
    if len(values) != n:
        raise ValueError(f"got {len(values)} {what} for {n} prompts")
    return values


def _final_only(params: list[SamplingParams]) -> list[SamplingParams]:
    """generate() keeps only final outputs: its requests ask for nothing else (as vLLM's LLM
    does), so no step builds an output for an unfinished request."""
    kind, replaced = RequestOutputKind.FINAL_ONLY, {}
    out = []
    for p in params:
        if p.output_kind is not kind and id(p) not in replaced:
            replaced[id(p)] = dataclasses.replace(p, output_kind=kind)
        out.append(replaced.get(id(p), p))
    return out
