"""The relay's entry points: :func:`relay` for a ``/v1`` call that goes to an engine, and
:func:`model_list` for ``GET /v1/models``.

``relay`` takes one authenticated request through the relay: its body read (``payload``), the
model resolved, the key's permission, the context length and the limits checked and tokens
reserved; then, for a model with no ready replica, a wait for one (``activation``), an upstream
opened (``attempts``) and its answer relayed (``answers``). However it ends, its exchange
(``exchange``) leaves exactly one usage row.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from django.conf import settings

from gateway import responses
from gateway.errors import ApiError, error_response, model_not_found
from gateway.identity import limits
from gateway.identity.keys import KeyInfo
from gateway.ledger.recorder import recorder
from gateway.ledger.usage import Usage
from gateway.relay import counting, payload
from gateway.relay.activation import held_stream, wait_for_activation
from gateway.relay.answers import relay_body, relay_stream
from gateway.relay.attempts import open_upstream
from gateway.relay.exchange import (
    CLIENT_CLOSED,
    Exchange,
    Reason,
    cancel_reason,
    error_reason,
    new_request_id,
)
from gateway.relay.routes import RelayRoute
from gateway.responses import Response
from gateway.routing.upstreams import upstreams
from telemetry import logs, tracing

logger = logging.getLogger(__name__)


def start_background() -> None:
    """What ``/v1`` keeps running in the background of this process (the usage writer),
    started if it is not: by every request, and by the process's startup
    (``gateway.edge.asgi.prepare``)."""
    recorder.ensure_running()


async def relay(
    body: bytes,
    key: KeyInfo,
    api_route: RelayRoute,
    clock_start: float,
    session: str | None = None,
    *,
    traceparent: str = "",
    tracestate: str = "",
) -> Response:
    """The request path after authentication, for one ``/v1`` call that goes to an engine.
    ``session`` is the client's ``x-session-id`` header, if it sent one; ``traceparent`` and
    ``tracestate`` its W3C trace context, which the request's span joins (tracing on)."""
    start_background()
    request_id = new_request_id()
    # Every line logged from here on (and by what this request starts) names it.
    logs.begin_request(request_id, traceparent)
    usage = Usage(request_id, key.id, key.user_id, "", api_route.kind, time.time())
    ex = Exchange(api_route, key, usage, clock_start)
    ex.trace = tracing.request(
        api_route.kind,
        api_route.path,
        request_id,
        clock_start,
        traceparent=traceparent,
        tracestate=tracestate,
    )
    try:
        return await _serve(ex, body, session)
    except ApiError as error:
        if ex.trace is not None:
            ex.trace.error(error.code)
        ex.finish(error.status, error_reason(error))
        return error_response(error, request_id)
    except asyncio.CancelledError:
        ex.finish(CLIENT_CLOSED, cancel_reason())
        raise
    except Exception:
        logger.exception("request %s failed", request_id)
        ex.finish(500, Reason.ERROR)
        return error_response(
            ApiError(500, "The gateway failed on this request.", "internal_error"), request_id
        )


# A model card's "created": when this process started (the catalog keeps no such date).
STARTED = int(time.time())


async def model_list(key: KeyInfo) -> Response:
    """``GET /v1/models``: the models ``key`` may use, the catalog's and static endpoints'."""
    table = await upstreams.ready()
    cards = [
        {"id": name, "object": "model", "created": STARTED, "owned_by": "llmgw"}
        for name in table.model_names()
        if key.may_use(name)
    ]
    body = json.dumps({"object": "list", "data": cards}, separators=(",", ":")).encode()
    return responses.whole(200, body)


async def _serve(ex: Exchange, raw: bytes, session: str | None) -> Response:
    body = payload.inspect(raw, ex.api_route, max_items=int(settings.LLMGW_MAX_ITEMS))
    ex.body = body
    if ex.trace is not None:
        ex.trace.requested(body.model, stream=body.stream, max_tokens=body.max_tokens)
    ex.usage.model = body.model
    ex.usage.stream = body.stream
    route = await upstreams.resolve(body.model)
    if route is None:
        raise model_not_found(body.model)
    if not (ex.key.may_use(route.name) or ex.key.may_use(body.model)):
        raise ApiError(
            403,
            f"This key may not use the model '{route.name}'.",
            "model_not_allowed",
            param="model",
        )
    ex.usage.model = route.name
    ex.route = route
    if body.model != route.name:
        ex.body = body = body.for_model(route.name)
    context_length = route.context_length or counting.context_length(
        [u.base_url for u in route.upstreams], route.name
    )
    if ex.api_route.tag == "generation" and context_length is not None:
        # Refused here, before anything reaches an engine (or wakes a cold model).
        too_long = limits.context_refusal(
            ex.api_route.kind,
            counting.prompt_floor(ex.prompt()),
            body.max_tokens,
            context_length,
        )
        if too_long is not None:
            raise too_long
    plan = limits.plan(
        len(raw),
        body.max_tokens,
        body.n,
        generates=ex.api_route.tag == "generation",
        context_length=context_length,
    )
    ex.reservation = await limits.reserve(ex.key, plan.tokens, request_id=ex.request_id)
    if plan.output_cap is not None and ex.reservation.token_counters():
        # A token limit applies: the engine is told the cap that was reserved, never more.
        ex.body = body = payload.with_output_cap(body, ex.api_route, plan.output_cap)
        # Reserved by the default for want of the context length: learn it for next time.
        ex.learn_context = body.max_tokens is None and context_length is None
    upstreams.note_request(route, None)
    ex.session = session
    if not route.upstreams:
        if body.stream:
            # Headers go out now so keep-alive comments can hold the stream open while the
            # model starts; anything that fails later ends the stream with an error event.
            return responses.event_stream(held_stream(ex), ex.request_id)
        ex.route = await wait_for_activation(ex, route)
    opened = await open_upstream(ex)
    if body.stream and opened.response.status == 200:
        return responses.event_stream(relay_stream(ex, opened), ex.request_id)
    return await relay_body(ex, opened)
