"""The streaming client of the load scripts (stress_server.py, soak.py): one completion
request over SSE, read chunk by chunk, optionally dropped (connection closed) after some chunks.
Plain `requests`, no project imports: what a client outside the server sees."""

from __future__ import annotations

import dataclasses
import json
import random
import time

import requests

WORDS = ("time person year way day thing man world life hand part child eye woman place work "
         "week case point company number group problem fact river garden music story window "
         "paper light water city mountain evening question market").split()


@dataclasses.dataclass
class Outcome:
    status: int = 0  # HTTP status; 0: no response (connection failed)
    texts: dict[int, str] = dataclasses.field(default_factory=dict)  # choice index -> text
    finish: dict[int, str] = dataclasses.field(default_factory=dict)
    chunks: int = 0
    done: bool = False  # saw data: [DONE]
    dropped: bool = False  # we closed the connection on purpose
    error: str = ""  # an error event in the stream, or the error body
    latency_s: float = 0.0


def random_prompt(rng: random.Random, min_words: int, max_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words)))


def stream_completion(url: str, body: dict, drop_after: int | None = None,
                      timeout: float = 300.0) -> Outcome:
    """POSTs a streaming /v1/completions; `drop_after` chunks then hangs up (None: read all)."""
    out, start = Outcome(), time.perf_counter()
    try:
        with requests.post(url + "/v1/completions", json={**body, "stream": True}, stream=True,
                           timeout=timeout) as resp:
            out.status = resp.status_code
            if resp.status_code != 200:
                out.error = resp.text[:300]
                return out
            for line in resp.iter_lines():
                if not line.startswith(b"data: "):
                    continue
                if line == b"data: [DONE]":
                    out.done = True
                    break
                _take(out, json.loads(line[6:]))
                if drop_after is not None and out.chunks >= drop_after:
                    out.dropped = True
                    break  # leaving the `with` closes the socket mid-stream
    except requests.RequestException as e:
        out.error = f"{type(e).__name__}: {str(e)[:200]}"
    finally:
        out.latency_s = time.perf_counter() - start
    return out


def _take(out: Outcome, chunk: dict) -> None:
    if "error" in chunk:
        out.error = str(chunk["error"].get("message", chunk["error"]))[:300]
        return
    out.chunks += 1
    for c in chunk.get("choices", []):
        i = c["index"]
        out.texts[i] = out.texts.get(i, "") + (c.get("text") or "")
        if c.get("finish_reason"):
            out.finish[i] = c["finish_reason"]
