"""OpenAI-shaped errors: ``{"error": {"message", "type", "code", "param"}}`` with the right status.

Clients map the status to their exception classes (the official ``openai`` client raises
``AuthenticationError`` for 401, ``NotFoundError`` for 404, ``RateLimitError`` for 429 ...), so
the status matters as much as the body. Messages never carry a key, a stack trace or anything
the client did not send.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from django.conf import settings
from django.http import HttpResponse
from django.http.response import HttpResponseBase

from gateway import responses
from gateway.responses import Header

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

    def __post_init__(self) -> None:
        super().__init__(self.message)

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request")

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.code, self.param)

    def response_headers(self) -> list[Header]:
        if self.retry_after is None:
            return []
        # Whole seconds, rounded up: a client that waits exactly this long must succeed.
        return [(b"retry-after", b"%d" % max(1, int(-(-self.retry_after // 1))))]

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


def too_large() -> ApiError:
    limit = int(settings.LLMGW_MAX_BODY_BYTES)
    return ApiError(413, f"The request body is larger than {limit} bytes.", "request_too_large")


def error_response(error: ApiError, request_id: str | None = None) -> responses.Response:
    return responses.whole(
        error.status, error.body(), request_id=request_id, extra=error.response_headers()
    )


def openai_shaped(response: HttpResponseBase) -> HttpResponseBase:
    """Django's own 404/405 pages (unknown path, wrong method) as OpenAI-shaped errors."""
    if response.status_code not in (404, 405):
        return response
    if response.get("Content-Type", "").startswith("application/json"):
        return response
    if response.status_code == 404:
        body = error_body("Unknown API path.", "invalid_request_error", "unknown_url")
    else:
        body = error_body(
            "Method not allowed for this path.", "invalid_request_error", "method_not_allowed"
        )
    shaped = HttpResponse(body, status=response.status_code, content_type="application/json")
    if "Allow" in response:
        shaped["Allow"] = response["Allow"]
    return shaped
