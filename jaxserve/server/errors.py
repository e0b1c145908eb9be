"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with a status code."""

from __future__ import annotations

MAX_SHOWN_CHARS = 40
RETRY_AFTER_S = 1  # what an overloaded server asks a client to wait before retrying


class ApiError(Exception):
    """An error the client can act on; becomes the JSON error body and the HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code = param, code
        self.headers = headers or {}  # extra HTTP headers (Retry-After)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def unavailable(message: str, code: str) -> ApiError:
    return ApiError(503, message, type="service_unavailable_error", code=code)


def overloaded(message: str, code: str) -> ApiError:
    """A 503 for a full queue: the client should retry after Retry-After seconds."""
    return ApiError(503, message, type="service_unavailable_error", code=code,
                    headers={"Retry-After": str(RETRY_AFTER_S)})


def shown(value) -> str:
    """A short repr of a client value: error bodies must never echo a whole (huge) input."""
    text = repr(value)
    return text if len(text) <= MAX_SHOWN_CHARS else text[:MAX_SHOWN_CHARS] + "...(truncated)"


# A LoRAError's status (core/lora.py) as OpenAI's error type and code.
LORA_ERROR_KINDS = {400: ("invalid_request_error", "invalid_lora_adapter"),
                    404: ("not_found_error", "model_not_found"),
                    409: ("invalid_request_error", "lora_adapter_in_use")}


def lora_error(error, param: str | None) -> ApiError:
    """The ApiError of a LoRAError (core/lora.py): its status, its message."""
    type, code = LORA_ERROR_KINDS.get(error.status, LORA_ERROR_KINDS[400])
    return ApiError(error.status if error.status in LORA_ERROR_KINDS else 400, str(error),
                    type=type, param=param, code=code)
