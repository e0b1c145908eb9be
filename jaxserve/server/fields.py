"""Typed, bounded reads of JSON request fields; each failure is a 400 naming its `param`."""

from __future__ import annotations

import json
import math

from jaxserve.server.errors import ApiError, invalid, shown


def parse_json(raw: bytes):
    """A request body's JSON value; a 400 invalid_json when it is not JSON."""
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {str(e)[:100]}",
                       code="invalid_json") from None


class Fields:
    """Reads fields of one JSON object. Absent and null fields both take the default."""

    def __init__(self, body: dict):
        self.body = body

    def raw(self, name: str):
        return self.body.get(name)

    def string(self, name: str, default: str | None = None, required: bool = False):
        value = self.body.get(name)
        if value is None:
            if required:
                raise invalid(f"'{name}' is a required field", name, "missing_field")
            return default
        if not isinstance(value, str):
            raise invalid(f"'{name}' must be a string, got {shown(value)}", name)
        return value

    def boolean(self, name: str, default: bool = False) -> bool:
        value = self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise invalid(f"'{name}' must be a boolean, got {shown(value)}", name)
        return value

    def integer(self, name: str, default: int | None, low: int | None = None,
                high: int | None = None) -> int | None:
        value = self.body.get(name)
        if value is None:
            return default
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # JSON clients sometimes send 16.0 for 16
        if isinstance(value, bool) or not isinstance(value, int):
            raise invalid(f"'{name}' must be an integer, got {shown(value)}", name)
        if (low is not None and value < low) or (high is not None and value > high):
            bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"
            raise invalid(f"'{name}' must be {bounds}, got {value}", name)
        return value

    def number(self, name: str, default: float) -> float:
        """A finite number; ranges are checked where the value is used (SamplingParams)."""
        value = self.body.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not math.isfinite(value):
            raise invalid(f"'{name}' must be a finite number, got {shown(value)}", name)
        return float(value)
