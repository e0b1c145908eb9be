"""The built-in web page (GET /, /ui/<file>) and the engine-state endpoint it polls.

The page is static files of the package (jaxserve/server/static/) and holds no data: it is
served without the API key so a browser can load it, and it sends the key (asked for once,
kept in sessionStorage) as `Authorization: Bearer` on every /v1 call, which the app's
before_request check guards like any other /v1 route (GET /v1/engine/state included).
"""

from __future__ import annotations

import pathlib
import time

from flask import Flask, jsonify, send_from_directory

from jaxserve.server.errors import unavailable

STATIC_DIR = pathlib.Path(__file__).parent / "static"


def _histogram_totals(histogram) -> tuple[float, float]:
    """(sum, count) of a prometheus_client Histogram, read through its public collect()."""
    total = count = 0.0
    for family in histogram.collect():
        for sample in family.samples:
            if sample.name.endswith("_sum"):
                total = sample.value
            elif sample.name.endswith("_count"):
                count = sample.value
    return total, count


def _server_counters(state) -> dict:
    """What only the HTTP side measures: TTFT from arrival, and tokens streamed out."""
    ttft_sum, ttft_count = _histogram_totals(state.metrics.ttft)
    generated = 0.0
    for family in state.metrics.generation_tokens.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                generated = sample.value
    return {"ttft_sum_s": ttft_sum, "ttft_count": int(ttft_count),
            "generation_tokens": int(generated), "in_flight": state.loop.in_flight()}


def register_ui_routes(app: Flask, state) -> None:
    @app.get("/")
    def index():
        return send_from_directory(STATIC_DIR, "index.html", max_age=0)

    @app.get("/ui/<path:name>")
    def ui_file(name: str):
        return send_from_directory(STATIC_DIR, name, max_age=0)

    @app.get("/v1/engine/state")
    def engine_state():
        snap = state.loop.engine_state()
        if not state.loop.alive:
            raise unavailable("the engine loop is not running", "engine_unavailable")
        if snap is None:
            raise unavailable(f"no engine state snapshot: {state.loop.snapshot_error!r}",
                              "engine_state_unavailable")
        body = dict(snap)  # shallow: the snapshot itself is shared and never mutated
        # Wall time: the snapshot may come from another process (an engine replica).
        body["age_s"] = max(0.0, time.time() - snap["time"])
        body["server"] = _server_counters(state)
        body["model"] = state.config.served_model_name
        return jsonify(body)
