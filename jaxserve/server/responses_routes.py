"""POST /v1/responses (OpenAI's Responses API) and GET /v1/responses/{id}.

A request becomes the chat route's GenerationRequest (server/responses_request.py) and runs the
way a chat completion runs (`serve`: admission, structured-output compile, the engine, client
disconnects); server/responses_output.py writes the Response or its event stream. With
`max_stored_responses` > 0, responses asked to be stored are kept in memory
(server/responses_store.py) for `previous_response_id` and for GET.
"""

from __future__ import annotations

from flask import Flask, jsonify, request

from jaxserve.server.errors import ApiError, shown
from jaxserve.server.fields import parse_json
from jaxserve.server.responses_output import ResponseFormatter
from jaxserve.server.responses_request import ResponsesRequest, parse_responses
from jaxserve.server.responses_store import ResponseStore


def register_responses_routes(app: Flask, state, serve) -> None:
    """serve(req, adapter, make): runs a GenerationRequest, answering with make(gen, model)."""
    store = ResponseStore(state.config.max_stored_responses)

    def keeper(req: ResponsesRequest):
        def keep(body: dict, output: list[dict]) -> None:
            if req.store:
                store.put(body, req.items + output)
        return keep

    @app.post("/v1/responses")
    def create_response():
        body = parse_json(request.get_data(cache=False))
        adapter = state.models.resolve(body.get("model") if isinstance(body, dict) else None)
        req = parse_responses(body, state.config, state.info, store)
        return serve(req.gen, adapter,
                     lambda gen, model: ResponseFormatter(gen, model, req, keeper(req)))

    @app.get("/v1/responses/<response_id>")
    def get_response(response_id: str):
        entry = store.get(response_id)
        if entry is None:
            raise ApiError(404, f"response {shown(response_id)} not found", type="not_found_error",
                           param="response_id", code="response_not_found")
        return jsonify(entry.response)
