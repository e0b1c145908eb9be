"""POST /v1/embeddings request bodies -> a validated EmbeddingRequest (token ids per input and
PoolingParams). OpenAI's fields (`input`, `model`, `encoding_format`, `dimensions`, `user`)
plus vLLM's `normalize`; everything a client can get wrong is a 400 naming its `param`.
"""

from __future__ import annotations

import dataclasses

from jaxserve.core.pooling import PoolingParams
from jaxserve.core.sampling_params import SamplingParamError
from jaxserve.server.errors import invalid, shown
from jaxserve.server.fields import Fields
from jaxserve.server.protocol import ModelInfo

MAX_INPUTS = 2048  # OpenAI's limit of inputs in one request
ENCODING_FORMATS = ("float", "base64")
# vLLM fields this server does not implement: refused rather than silently ignored.
UNSUPPORTED = ("truncate_prompt_tokens",)
INPUT_TYPES = ("'input' must be a non-empty string, a list of non-empty strings, a list of "
               "token ids or a list of non-empty token-id lists")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EmbeddingRequest:
    model: str
    inputs: list[list[int]]  # token ids, one list per input
    encoding_format: str     # "float" | "base64" (little-endian float32 bytes)
    params: PoolingParams


def parse_embedding(body, info: ModelInfo, embedding_size: int | None,
                    max_inputs: int) -> EmbeddingRequest:
    """embedding_size: the served embeddings' length, None when the engine serves none.
    max_inputs: the most inputs one request may have on this server."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    f = Fields(body)
    model = f.string("model", required=True)
    if embedding_size is None:
        raise invalid("this server does not serve embeddings: start it with "
                      "--enable-embeddings", "model", "unsupported")
    for name in UNSUPPORTED:
        if f.raw(name) is not None:
            raise invalid(f"'{name}' is not supported by this server", name, "unsupported")
    encoding = f.string("encoding_format", "float")
    if encoding not in ENCODING_FORMATS:
        raise invalid(f"'encoding_format' must be one of {ENCODING_FORMATS}, got "
                      f"{shown(encoding)}", "encoding_format")
    f.string("user")  # accepted (OpenAI's end-user id); only its type is checked
    try:
        params = PoolingParams(dimensions=f.integer("dimensions", None, 1),
                               normalize=f.boolean("normalize", True))
        params.check(embedding_size)
    except SamplingParamError as e:
        raise invalid(str(e), e.param) from e
    inputs = _inputs(f.raw("input"), info, max_inputs)
    return EmbeddingRequest(model=model, inputs=inputs, encoding_format=encoding,
                            params=params)


def _inputs(raw, info: ModelInfo, max_inputs: int) -> list[list[int]]:
    if raw is None:
        raise invalid("'input' is a required field", "input", "missing_field")
    if isinstance(raw, str) or (isinstance(raw, list) and raw and
                                all(_is_int(t) for t in raw)):
        batch = [raw]
    elif isinstance(raw, list) and raw:
        batch = raw
    else:
        raise invalid(INPUT_TYPES, "input")
    if len(batch) > max_inputs:
        raise invalid(f"at most {max_inputs} inputs per request on this server, got "
                      f"{len(batch)}", "input")
    inputs = [_one_input(x, info) for x in batch]
    limit = info.max_model_len
    for i, ids in enumerate(inputs):
        if len(ids) > limit:
            raise invalid(f"this model's maximum context length is {limit} tokens; input "
                          f"{i} has {len(ids)} tokens: shorten it", "input",
                          "context_length_exceeded")
    return inputs


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _one_input(x, info: ModelInfo) -> list[int]:
    if isinstance(x, str) and x:
        tok = info.tokenizer
        if tok is None:
            raise invalid("this model has no tokenizer: send the input as token ids", "input")
        bos = [tok.bos_token_id] if tok.add_bos and tok.bos_token_id is not None else []
        return bos + tok.encode(x)
    if isinstance(x, list) and x and all(_is_int(t) for t in x):
        bad = [t for t in x if not 0 <= t < info.vocab_size]
        if bad:
            raise invalid(f"input token ids must be integers in [0, {info.vocab_size}); got "
                          f"{shown(bad[:3])}", "input", "invalid_token_id")
        return list(x)
    raise invalid(INPUT_TYPES, "input")
