"""OpenAI-shaped errors: ``{"error": {"message", "type", "code", "param"}}`` with the right status.

Clients map the status to their exception classes (the official ``openai`` client raises
``AuthenticationError`` for 401, ``NotFoundError`` for 404, ``RateLimitError`` for 429 ...), so
the status matters as much as the body. Messages never carry a key, a stack trace or anything
the client did not send.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

# The "type" OpenAI uses for each status class.
_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout",
}


@dataclass
class ApiError(Exception):
    """An error answered to the client; raised anywhere on the request path."""

    status: int
    message: str
    code: str
    param: str | None = None
    retry_after: float | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__(self.message)

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request")

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.code, self.param)

    def response_headers(self) -> dict[str, str]:
        headers = dict(self.headers)
        if self.retry_after is not None:
            # Whole seconds, rounded up: a client that waits exactly this long must succeed.
            headers["Retry-After"] = str(max(1, int(-(-self.retry_after // 1))))
        return headers

    def sse_event(self) -> bytes:
        """The same error as the last event of a stream that has already started."""
        return b"data: " + self.body() + b"\n\n"


def error_body(message: str, type_: str, code: str, param: str | None = None) -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": type_, "code": code, "param": param}},
        separators=(",", ":"),
    ).encode()


def invalid_key() -> ApiError:
    return ApiError(401, "Incorrect or missing API key.", "invalid_api_key")


def bad_field(param: str, expected: str) -> ApiError:
    return ApiError(400, f"'{param}' must be {expected}.", "invalid_type", param=param)


def model_not_found(name: str) -> ApiError:
    # The name is echoed only as far as a sane model name goes, so nothing odd is reflected.
    shown = name if len(name) <= 200 and name.isprintable() else "(unprintable)"
    return ApiError(
        404,
        f"The model '{shown}' does not exist or you do not have access to it.",
        "model_not_found",
        param="model",
    )
