"""POST /tokenize, POST /detokenize and GET /tokenizer_info: the served model's tokenizer over
HTTP, in vLLM's routes and bodies (no /v1 prefix, as vLLM serves them).

/tokenize takes a `prompt` (text) or chat `messages` (rendered by the chat template exactly as
/v1/chat/completions renders them, server/protocol.py chat_prompt) and answers
`{"count", "max_model_len", "tokens", "token_strs"}`; /detokenize takes `tokens` and answers
`{"prompt": text}`. /tokenizer_info (vLLM's, off unless the server was started with
--enable-tokenizer-info-endpoint, since it shows the chat template) is what lm-evaluation-
harness's `tokenizer_backend=remote` reads, so an evaluation needs no tokenizer files of its
own. All three sit behind the API key when one is set; `model`, when given, must name a
served model (an adapter shares its base model's tokenizer).
"""

from __future__ import annotations

from flask import Flask, jsonify, request

from jaxserve.server.errors import ApiError, invalid, shown
from jaxserve.server.fields import Fields, parse_json
from jaxserve.server.protocol import ModelInfo, chat_prompt


def _body(state) -> Fields:
    body = parse_json(request.get_data(cache=False))
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    fields = Fields(body)
    state.models.resolve(fields.string("model"))  # a 404 for a name this server does not serve
    return fields


def _tokenizer(info: ModelInfo, param: str):
    if info.tokenizer is None:
        raise invalid("this model has no tokenizer: prompts must be given as token ids", param)
    return info.tokenizer


def _prompt_ids(f: Fields, info: ModelInfo) -> list[int]:
    has_prompt, has_messages = f.raw("prompt") is not None, f.raw("messages") is not None
    if has_prompt == has_messages:
        raise invalid("give either 'prompt' (text) or 'messages' (a chat), not "
                      f"{'both' if has_prompt else 'neither'}", "prompt",
                      None if has_prompt else "missing_field")
    if has_prompt:
        tok = _tokenizer(info, "prompt")
        text = f.string("prompt")
        # A model that starts every prompt with BOS gets it here, as /v1/completions does.
        return info.encode(text) if f.boolean("add_special_tokens", True) else tok.encode(text)
    tok = _tokenizer(info, "messages")
    generation = f.boolean("add_generation_prompt", True)
    continuing = f.boolean("continue_final_message", False)
    if generation and continuing:
        raise invalid("'continue_final_message' needs 'add_generation_prompt': false",
                      "continue_final_message")
    text, _ = chat_prompt(f, info, add_generation_prompt=generation,
                          continue_final_message=continuing)
    # The template writes the special tokens itself; vLLM adds none on top by default.
    return info.encode(text) if f.boolean("add_special_tokens", False) else tok.encode(text)


def _token_ids(f: Fields, info: ModelInfo) -> list[int]:
    ids = f.raw("tokens")
    if ids is None:
        raise invalid("'tokens' is a required field", "tokens", "missing_field")
    if not isinstance(ids, list):
        raise invalid(f"'tokens' must be a list of token ids, got {shown(ids)}", "tokens")
    tok = _tokenizer(info, "tokens")
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int)
           or not 0 <= t < info.vocab_size or tok.id_to_token(t) is None]
    if bad:
        raise invalid(f"token ids must be integers in [0, {info.vocab_size}) that the "
                      f"tokenizer knows; got {shown(bad[:3])}", "tokens", "invalid_token_id")
    if len(ids) > info.max_model_len:
        raise invalid(f"at most {info.max_model_len} tokens (the model's context), got "
                      f"{len(ids)}", "tokens", "context_length_exceeded")
    return ids


def tokenizer_info(info: ModelInfo) -> dict:
    """vLLM's /tokenizer_info: the tokenizer_config.json fields a client needs to tokenize
    and template on its own (lm-eval reads eos_token, bos_token and chat_template)."""
    tok = _tokenizer(info, None)

    def text(token_id):
        return tok.id_to_token(token_id) if token_id is not None else None

    return {"tokenizer_class": type(tok).__name__, "bos_token": text(tok.bos_token_id),
            "eos_token": text(tok.eos_token_id), "pad_token": text(tok.pad_token_id),
            "add_bos_token": bool(tok.add_bos), "model_max_length": info.max_model_len,
            "vocab_size": info.vocab_size, "chat_template": tok.chat_template}


def register_tokenize_routes(app: Flask, state) -> None:
    info = state.info

    @app.post("/tokenize")
    def tokenize():
        f = _body(state)
        ids = _prompt_ids(f, info)
        strs = [info.tokenizer.id_to_token(t) for t in ids] \
            if f.boolean("return_token_strs", False) else None
        return jsonify({"count": len(ids), "max_model_len": info.max_model_len,
                        "tokens": ids, "token_strs": strs})

    @app.post("/detokenize")
    def detokenize():
        f = _body(state)
        ids = _token_ids(f, info)
        return jsonify({"prompt": info.tokenizer.decode(ids)})

    @app.get("/tokenizer_info")
    def get_tokenizer_info():
        if not state.config.enable_tokenizer_info_endpoint:
            raise ApiError(404, "the tokenizer info endpoint is off: start the server with "
                                "--enable-tokenizer-info-endpoint", type="not_found_error",
                           code="tokenizer_info_disabled")
        return jsonify(tokenizer_info(info))
