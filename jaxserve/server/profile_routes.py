"""POST /start_profile and /stop_profile: jax.profiler captures of a running server.

Off (404) unless the server was started with a profile directory (`--profile-dir`). Like the
/v1 routes they need the API key when one is set: a capture writes files on the server.
"""

from __future__ import annotations

import hmac
import json

from flask import Flask, jsonify, request

from jaxserve.telemetry.profiling import ProfilerError
from jaxserve.server.errors import ApiError, invalid


def _profiler(state):
    profiler = state.loop.model.profiler  # None: no single process to profile (replicas)
    if profiler is None or profiler.directory is None:
        raise ApiError(404, "profiling is off: start the server with --profile-dir DIR",
                       type="not_found_error", code="profiling_disabled")
    key = state.config.api_key
    if key is not None:
        header = request.headers.get("Authorization", "")
        given = header[7:] if header.startswith("Bearer ") else ""
        if not hmac.compare_digest(given.encode(), key.encode()):
            raise ApiError(401, "invalid or missing API key (send 'Authorization: Bearer "
                           "<key>')", type="authentication_error", code="invalid_api_key")
    return profiler


def _num_steps() -> int | None:
    raw = request.get_data(cache=False)
    if not raw.strip():
        return None
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise invalid("the request body is not valid JSON", code="invalid_json") from None
    extra = sorted(body)[:3] if isinstance(body, dict) else []
    if extra and extra != ["num_steps"]:
        # The capture goes where the server was started to put it: never a path a client gives.
        raise invalid("the body takes only 'num_steps' (captures go to the server's "
                      "--profile-dir)", param=next(k for k in extra if k != "num_steps")[:40])
    steps = body.get("num_steps") if isinstance(body, dict) else None
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise invalid("num_steps must be a positive integer", param="num_steps")
    return steps


def register_profile_routes(app: Flask, state) -> None:
    @app.post("/start_profile")
    def start_profile():
        profiler = _profiler(state)
        steps = _num_steps()
        try:
            directory = profiler.start(num_steps=steps)
        except ProfilerError as e:
            raise ApiError(409, str(e), code="profiler_busy") from None
        return jsonify({"status": "started", "directory": str(directory), "num_steps": steps})

    @app.post("/stop_profile")
    def stop_profile():
        profiler = _profiler(state)
        try:
            run = profiler.stop()
        except ProfilerError as e:
            raise ApiError(409, str(e), code="profiler_not_running") from None
        return jsonify({"status": "stopped", "trace_dir": str(run),
                        "files": sorted(p.name for p in run.iterdir() if p.is_file())})
