"""The admin API's one error shape: ``{"error": {"code", "message", "field"}}`` (and, for bad
input, ``errors``: one ``{"field", "message"}`` per fault), whatever failed.

:class:`AdminApiError` is what a route raises for an answer other than success; ``install``
gives an API the handlers that turn it, a refused caller, a failed validation and ninja's and
Django's own errors into that shape. Not the gateway's ``gateway.errors.ApiError``: that one is
OpenAI-shaped, for ``/v1`` clients.
"""

# No `from __future__ import annotations`: ninja reads the schemas' annotations.

from typing import Any

from django.http import Http404, HttpRequest, HttpResponse
from ninja import NinjaAPI, Schema
from ninja.errors import AuthenticationError, HttpError, ValidationError

from llmgw_site.admin_api.auth import Denied


class AdminApiError(Exception):
    """An answer other than success: HTTP status, a stable code, and the field at fault.

    ``code`` and ``message`` are keyword-only, so a call reads which is which."""

    def __init__(self, status: int, *, code: str, message: str, field: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.field = field


class ErrorDetail(Schema):
    code: str
    message: str
    field: str | None


class FieldError(Schema):
    field: str
    message: str


class ErrorOut(Schema):
    error: ErrorDetail
    errors: list[FieldError] | None = None


# Every route may answer these (authentication, power, lockout, input); the document says so,
# so that a client generated from it knows the error shape.
ERRORS = {
    "401": "no admin token or staff session, or a wrong one",
    "403": "a read-only token or account writing, or a signed-in write without CSRF",
    "404": "no such row",
    "409": "the name is taken, or the row is in use",
    "422": "a value is wrong; `field` names it",
    "429": "too many failed sign-ins from this address or for this token",
}


def _field_of(loc: list[Any] | tuple[Any, ...]) -> str:
    # ninja's locations are ("body", <parameter>, field...) or ("query", field...).
    parts = [str(p) for p in loc]
    if parts and parts[0] == "body":
        parts = parts[2:] if len(parts) > 2 else parts[1:]
    elif parts and parts[0] in {"query", "path"}:
        parts = parts[1:]
    return ".".join(parts)


def install(api: NinjaAPI) -> None:
    """Answer every failure of ``api``'s routes in the one error shape."""

    def error(
        request: HttpRequest, status: int, code: str, message: str, field: str = ""
    ) -> HttpResponse:
        return api.create_response(
            request,
            {"error": {"code": code, "message": message, "field": field or None}},
            status=status,
        )

    @api.exception_handler(AdminApiError)
    def _api_error(request: HttpRequest, exc: AdminApiError) -> HttpResponse:
        return error(request, exc.status, exc.code, exc.message, exc.field)

    @api.exception_handler(Denied)
    def _denied(request: HttpRequest, exc: Denied) -> HttpResponse:
        return error(request, exc.status, exc.code, exc.message)

    @api.exception_handler(AuthenticationError)
    def _unauthenticated(request: HttpRequest, exc: AuthenticationError) -> HttpResponse:
        return error(request, 401, "unauthorized", "send an admin token or sign in as staff")

    @api.exception_handler(ValidationError)
    def _invalid(request: HttpRequest, exc: ValidationError) -> HttpResponse:
        errors = [
            {"field": _field_of(e.get("loc", ())), "message": str(e.get("msg", "invalid"))}
            for e in exc.errors
        ]
        first = errors[0] if errors else {"field": "", "message": "invalid request"}
        response = api.create_response(
            request,
            {
                "error": {
                    "code": "invalid",
                    "message": first["message"],
                    "field": first["field"] or None,
                },
                "errors": errors,
            },
            status=422,
        )
        return response

    @api.exception_handler(HttpError)
    def _http_error(request: HttpRequest, exc: HttpError) -> HttpResponse:
        code = {400: "bad_request", 404: "not_found", 405: "method_not_allowed"}.get(
            exc.status_code, "error"
        )
        return error(request, exc.status_code, code, str(exc))

    @api.exception_handler(Http404)
    def _not_found(request: HttpRequest, exc: Http404) -> HttpResponse:
        return error(request, 404, "not_found", str(exc) or "not found")
