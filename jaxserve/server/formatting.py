"""OpenAI response bodies and stream chunks, built from what the engine produced."""

from __future__ import annotations

import dataclasses
import json

MIN_LOGPROB = -9999.0  # JSON has no -inf; OpenAI clamps the same way


@dataclasses.dataclass
class Choice:
    """What one choice has produced so far (the handler's own copy)."""

    index: int
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _lp(value: float) -> float:
    return max(float(value), MIN_LOGPROB)


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    # The engine's entry holds the sampled token plus the top k; keep the k most likely.
    return sorted(entry.items(), key=lambda kv: -kv[1])[:k]


def completion_logprobs(decode, token_ids: list[int], entries: list[dict[int, float]], k: int,
                        offset: int) -> dict:
    """The legacy completions shape: parallel lists of tokens, logprobs and alternatives."""
    tokens = [decode(t) for t in token_ids]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens,
            "token_logprobs": [_lp(e.get(t, MIN_LOGPROB)) for t, e in zip(token_ids, entries)],
            "top_logprobs": [{decode(a): _lp(lp) for a, lp in _top(e, k)} for e in entries],
            "text_offset": offsets}


def echoed_prompt_logprobs(decode, token_ids: list[int],
                           entries: list[dict[int, float] | None], k: int) -> tuple[dict, int]:
    """The completions shape for an echoed prompt (echo with logprobs, vLLM's): its first token
    has no logprob (nothing predicts it), so null there. Returns it and the prompt's decoded
    length, where the completion's text offsets go on."""
    body = completion_logprobs(decode, token_ids[1:], entries[1:], k,
                               len(decode(token_ids[0])) if token_ids else 0)
    if token_ids:
        body["tokens"].insert(0, decode(token_ids[0]))
        body["token_logprobs"].insert(0, None)
        body["top_logprobs"].insert(0, None)
        body["text_offset"].insert(0, 0)
    end = body["text_offset"][-1] + len(body["tokens"][-1]) if token_ids else 0
    return body, end


def join_logprobs(first: dict, second: dict | None) -> dict:
    """Two completions-shaped logprobs one after the other (an echoed prompt, then the
    completion)."""
    return {key: first[key] + second[key] for key in first} if second else first


def chat_logprobs(decode, token_ids: list[int], entries: list[dict[int, float]], k: int) -> dict:
    def item(tid: int, lp: float) -> dict:
        s = decode(tid)
        return {"token": s, "logprob": _lp(lp), "bytes": list(s.encode("utf-8"))}

    return {"content": [
        {**item(t, e.get(t, MIN_LOGPROB)), "top_logprobs": [item(a, lp) for a, lp in _top(e, k)]}
        for t, e in zip(token_ids, entries)]}


def completion_body(rid: str, created: int, model: str, choices: list[dict],
                    usage_: dict | None, chunk: bool = False) -> dict:
    body = {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": choices}
    if usage_ is not None or not chunk:
        body["usage"] = usage_
    return body


def chat_body(rid: str, created: int, model: str, choices: list[dict], usage_: dict | None,
              chunk: bool = False) -> dict:
    body = {"id": rid, "object": "chat.completion.chunk" if chunk else "chat.completion",
            "created": created, "model": model, "choices": choices}
    if usage_ is not None or not chunk:
        body["usage"] = usage_
    return body


def sse(data: dict | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {text}\n\n".encode("utf-8")
