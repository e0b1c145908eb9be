"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter: vLLM's routes, bodies and answers.

Load reads the adapter's files in the handler's thread (LoRAAdapters.add is thread-safe), so
the engine thread keeps stepping while a large adapter is read. Unload is refused (409) while
unfinished requests use the adapter: nothing is drained or aborted behind a client's back.
Both sit behind the API key like every /v1 route; load is the one route that reads a
directory the request names (only the two PEFT files in it, only with --enable-lora).
"""

from __future__ import annotations

from flask import Flask, Response, request

from jaxserve.core.lora import LoRAError
from jaxserve.server.errors import invalid, lora_error
from jaxserve.server.fields import Fields, parse_json

MAX_NAME_CHARS = 256
MAX_PATH_CHARS = 4096  # Linux's PATH_MAX: a longer path names no directory


def _body() -> Fields:
    body = parse_json(request.get_data(cache=False))
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    return Fields(body)


def _bounded(fields: Fields, name: str, limit: int, required: bool) -> str | None:
    value = fields.string(name, required=required)
    if value is not None and not value.strip():
        raise invalid(f"'{name}' must not be empty", name)
    if value is not None and len(value) > limit:
        raise invalid(f"'{name}' must be at most {limit} characters, got {len(value)}", name)
    return value


def _success(text: str) -> Response:
    # vLLM answers both routes with this plain-text sentence.
    return Response(text, status=200, mimetype="text/plain")


def register_lora_routes(app: Flask, state) -> None:
    models = state.models

    @app.post("/v1/load_lora_adapter")
    def load_lora_adapter():
        fields = _body()
        name = _bounded(fields, "lora_name", MAX_NAME_CHARS, required=True)
        path = _bounded(fields, "lora_path", MAX_PATH_CHARS, required=True)
        try:
            adapter = models.load(name, path)
        except LoRAError as e:
            raise lora_error(e, None) from None  # the message names the file or field
        return _success(f"Success: LoRA adapter '{adapter.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    def unload_lora_adapter():
        fields = _body()
        name = _bounded(fields, "lora_name", MAX_NAME_CHARS, required=False)
        lora_id = fields.integer("lora_int_id", None, low=1)
        if name is None and lora_id is None:
            raise invalid("give 'lora_name' (or 'lora_int_id') of the adapter to unload",
                          "lora_name", "missing_field")
        try:
            adapter = models.unload(name, lora_id)
        except LoRAError as e:
            raise lora_error(e, "lora_name") from None
        return _success(f"Success: LoRA adapter '{adapter.lora_name}' removed successfully.")
