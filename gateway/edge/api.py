"""``/v1``'s ninja operations: the OpenAPI document at ``/v1/openapi.json`` (interactive docs at
``/v1/docs``), the model list and a key's usage. An edge: it authenticates, then hands the
request on. The relay routes (``gateway.relay.routes``) are documented here but served only by
the front door, ``gateway.edge.asgi.V1App``, which answers them before ninja sees them."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

from django.db import DatabaseError
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from django.http.response import HttpResponseBase
from ninja import NinjaAPI, Schema
from ninja.errors import AuthenticationError, HttpError, ValidationError
from ninja.security.http import HttpBearer

from gateway import dbthread
from gateway.edge import schemas
from gateway.errors import ApiError, error_response, invalid_key
from gateway.identity import keys, limits
from gateway.identity.keys import KeyInfo
from gateway.ledger import rollups
from gateway.relay import entry
from gateway.relay.routes import RELAY_ROUTES, RelayRoute
from gateway.responses import Response


class BearerKey(HttpBearer):
    """``Authorization: Bearer llmgw-…``. Async, cached (``gateway.identity.keys``), never
    logged."""

    async def __call__(self, request: HttpRequest) -> KeyInfo | None:
        return await keys.authenticate(request.headers.get("Authorization"))

    def authenticate(self, request: HttpRequest, token: str) -> Any:
        raise NotImplementedError  # __call__ does the work, asynchronously


class GatewayApi(NinjaAPI):
    """Adds the documented request bodies, which ninja does not see because the views read the
    raw bytes instead of letting ninja parse them."""

    def get_openapi_schema(self, *args: Any, **kwargs: Any) -> Any:
        schema = super().get_openapi_schema(*args, **kwargs)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for route in RELAY_ROUTES:
            body = _schema(route.request).model_json_schema(
                ref_template="#/components/schemas/{model}"
            )
            components.update(body.pop("$defs", {}))
            components[route.request] = body
        return schema


api = GatewayApi(
    title="llmgw",
    version="1",
    description="OpenAI-compatible API in front of self-hosted engines.",
    urls_namespace="v1",
    auth=BearerKey(),
    docs_url="/docs",
    openapi_url="/openapi.json",
)

_ERRORS: dict[int, Any] = {
    code: schemas.ErrorResponse for code in (400, 401, 403, 404, 413, 429, 502, 503, 504)
}


# One server-sent event, as OpenAPI 3.2 describes streams: a `data` line holding a JSON chunk
# (or `[DONE]`), an optional event name (the Responses API names its events).
_SSE_EVENT: dict[str, Any] = {
    "type": "object",
    "properties": {
        "event": {"type": "string"},
        "data": {"type": "string", "description": "A JSON chunk, or [DONE] at the end."},
        "id": {"type": "string"},
    },
    "required": ["data"],
}


def _schema(name: str) -> type[Schema]:
    """A documented body of ``gateway.edge.schemas`` by the name a relay route gives."""
    schema: type[Schema] = getattr(schemas, name)
    return schema


def _body_doc(route: RelayRoute) -> dict[str, Any]:
    """The request body ninja cannot see, and for streaming routes both forms of the answer."""
    extra: dict[str, Any] = {
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": {"$ref": f"#/components/schemas/{route.request}"}}
            },
        }
    }
    if route.streams:
        extra["responses"] = {
            "200": {
                "description": 'The result; with "stream": true, server-sent events ending in '
                "`data: [DONE]`.",
                "content": {
                    "application/json": {
                        "schema": {"$ref": f"#/components/schemas/{route.response}"}
                    },
                    "text/event-stream": {"schema": _SSE_EVENT},
                },
            }
        }
    return extra


def to_django(response: Response) -> HttpResponseBase:
    """The relay's answer as a Django response, for the ninja operations."""
    response.settled()  # Django writes the answer later, out of sight: settle it now
    answer: HttpResponseBase
    if response.stream is not None:
        answer = StreamingHttpResponse(response.stream, status=response.status)
    else:
        answer = HttpResponse(response.body, status=response.status)
    for name, value in response.headers:
        answer[name.decode("latin-1")] = value.decode("latin-1")
    return answer


@api.exception_handler(AuthenticationError)
def _unauthenticated(request: HttpRequest, exc: Exception) -> HttpResponseBase:
    return to_django(error_response(invalid_key()))


@api.exception_handler(ApiError)
def _api_error(request: HttpRequest, exc: ApiError) -> HttpResponseBase:
    return to_django(error_response(exc))


@api.exception_handler(ValidationError)
def _invalid(request: HttpRequest, exc: ValidationError) -> HttpResponseBase:
    first = exc.errors[0] if exc.errors else {}
    loc = first.get("loc", ())
    param = str(loc[-1]) if loc else None
    error = ApiError(400, str(first.get("msg", "Invalid request.")), "invalid_request", param=param)
    return to_django(error_response(error))


@api.exception_handler(HttpError)
def _http_error(request: HttpRequest, exc: HttpError) -> HttpResponseBase:
    return to_django(error_response(ApiError(exc.status_code, str(exc), "invalid_request")))


def _key(request: HttpRequest) -> KeyInfo:
    key = getattr(request, "auth", None)
    if not isinstance(key, KeyInfo):
        raise ApiError(401, "Incorrect or missing API key.", "invalid_api_key")
    return key


@api.get(
    "/models", response={200: schemas.ModelList, **_ERRORS}, summary="List models", tags=["models"]
)
async def list_models(request: HttpRequest) -> HttpResponseBase:
    """The models this key may use: the catalog and static endpoints' models."""
    # Under llmgw_site.asgi this path is served by gateway.edge.asgi without ninja (same function).
    return to_django(await entry.model_list(_key(request)))


def _documented(route: RelayRoute) -> Callable[[HttpRequest], Awaitable[HttpResponseBase]]:
    """An operation that documents ``route``: the relay routes are served by one front door,
    ``gateway.edge.asgi.V1App``, which answers their POSTs before ninja sees them (ninja
    answers other methods with 405). One view per route, as ninja marks each view with its
    operation."""

    async def view(request: HttpRequest) -> HttpResponseBase:
        # No docstring: ninja would publish it as the operation's description.
        raise RuntimeError(f"{route.path} is answered by gateway.edge.asgi.V1App, not by ninja")

    return view


for _route in RELAY_ROUTES:
    api.post(
        _route.path.removeprefix("/v1"),
        response={200: _schema(_route.response), **_ERRORS},
        openapi_extra=_body_doc(_route),
        # As ninja names operations after their views (gateway.edge.api.chat_completions ...).
        operation_id="gateway_api_" + _route.path.removeprefix("/v1/").replace("/", "_"),
        summary=_route.summary,
        tags=[_route.tag],
    )(_documented(_route))


def _usage_summary(key: KeyInfo) -> dict[str, Any]:
    start, _ = limits.period_bounds(key.budget_period, time.time())
    totals = rollups.totals(rollups.Selector(key_id=key.id), datetime.fromtimestamp(start, tz=UTC))
    return {
        "key": key.prefix,
        "period": key.budget_period,
        "period_start": int(start),
        "requests": totals.requests,
        "prompt_tokens": totals.prompt_tokens,
        "completion_tokens": totals.completion_tokens,
        "token_budget": key.token_budget,
        "budget_left": None
        if key.token_budget is None
        else max(0, key.token_budget - totals.tokens),
    }


@api.get(
    "/keys/{prefix}/usage",
    response={200: schemas.KeyUsage, **_ERRORS},
    summary="This key's usage in its budget period",
    tags=["keys"],
)
async def key_usage(request: HttpRequest, prefix: str) -> Any:
    """A key sees only itself: any other prefix is 404, whether or not such a key exists."""
    key = _key(request)
    if prefix != key.prefix:
        raise ApiError(404, "No such key.", "key_not_found", param="prefix")
    try:
        return await dbthread.for_request(_usage_summary, key)
    except DatabaseError:
        raise ApiError(
            503, "Usage cannot be read right now.", "store_unavailable", retry_after=5
        ) from None
