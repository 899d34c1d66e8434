"""Waiting for a model that is starting: a request for a catalog model with no ready replica.

The request takes a place in the model's queue of waiters (``max_waiting``, counted across
every web process; 429 once it is full), notes demand so the reconciler places a replica, and
waits for the routing table to bring one, up to the model's activation timeout (then 503 with
Retry-After). A stream is held: its headers go out at once and keep-alive comments keep it
open while it waits, and whatever fails later ends it with an error event. Any other request
simply waits, then goes on to its upstream like the rest.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator

from django.conf import settings
from django.db import DatabaseError
from redis.exceptions import RedisError

from gateway import dbthread
from gateway.errors import ApiError
from gateway.relay.answers import read_rest, relay_stream
from gateway.relay.attempts import open_upstream
from gateway.relay.exchange import Exchange, Reason, cancel_reason, error_reason
from gateway.routing.table import Route
from gateway.routing.upstreams import upstreams
from telemetry import metrics


async def _activation_slot(ex: Exchange, route: Route) -> int:
    """A place in the model's queue of waiters, counted across every web process. Refused at
    once while the store is unreachable: the demand that starts a replica is written there,
    and the reconciler acts on it from there, so a request could only wait out its timeout."""
    assert route.catalog_id is not None
    if dbthread.store_down():
        raise ApiError(
            503,
            f"The model '{route.name}' is not running, and it cannot be started while the "
            "gateway's store is unreachable.",
            "store_unavailable",
            retry_after=5,
        )
    try:
        taken = await upstreams.take_waiting_slot(route.catalog_id, route.max_waiting)
    except (DatabaseError, RedisError):
        raise ApiError(
            503, "The gateway cannot queue requests right now.", "queue_unavailable", retry_after=5
        ) from None
    if not taken:
        metrics.observe_activation_wait(route.name, 0.0, "rejected")
        raise ApiError(
            429,
            f"Too many requests are waiting for '{route.name}' to start.",
            "model_activation_queue_full",
            retry_after=5,
        )
    upstreams.note_demand(route)
    return route.catalog_id


async def _activations(ex: Exchange, route: Route) -> AsyncIterator[Route | None]:
    """Yields None at each keep-alive interval while waiting, then the route once it has an
    upstream. Raises 503 with Retry-After when the model's activation timeout passes."""
    if route.catalog_id is None:
        raise ApiError(503, f"No upstream serves '{route.name}' now.", "no_upstream", retry_after=5)
    catalog_id = await _activation_slot(ex, route)
    assert ex.body is not None
    began = time.monotonic()
    deadline = began + route.activation_timeout_s
    keepalive = float(settings.LLMGW_KEEPALIVE_INTERVAL)
    next_keepalive = time.monotonic() + keepalive
    outcome = "disconnected"  # unless the loop below says otherwise
    # The route asked for, profile included (the body now names the model only).
    wanted = f"{route.name}@{route.profile}" if route.profile else ex.body.model
    try:
        while True:
            with metrics.waiting_for_activation(route.name):
                current = await upstreams.wait_for_upstream(
                    route, wanted, until=min(deadline, next_keepalive)
                )
            if current is not None:
                outcome = "ready"
                yield current
                return
            now = time.monotonic()
            if now >= deadline:
                outcome = "timeout"
                raise ApiError(
                    503,
                    f"The model '{route.name}' is starting; it was not ready in "
                    f"{route.activation_timeout_s:g}s.",
                    "model_not_ready",
                    retry_after=10,
                )
            if now >= next_keepalive:
                next_keepalive = now + keepalive
                yield None
    finally:
        upstreams.leave_waiting_slot(catalog_id)
        waited = time.monotonic() - began
        metrics.observe_activation_wait(route.name, waited, outcome)
        if ex.trace is not None:
            ex.trace.activation(waited, outcome)


async def wait_for_activation(ex: Exchange, route: Route) -> Route:
    """The route once its model has an upstream, for a request that is not a stream."""
    async for ready in _activations(ex, route):
        if ready is not None:
            return ready
    raise AssertionError("activation ended without a route or an error")


async def held_stream(ex: Exchange) -> AsyncGenerator[bytes]:
    """A stream held open while its model starts: keep-alive comments, then the upstream's
    stream; an error event if the wait or the upstream fails first."""
    assert ex.route is not None
    try:
        async for ready in _activations(ex, ex.route):
            if ready is None:
                yield b": waiting\n\n"
            else:
                ex.route = ready
        opened = await open_upstream(ex)
    except ApiError as error:
        ex.finish(200, error_reason(error))
        yield error.sse_event()
        return
    except (asyncio.CancelledError, GeneratorExit):
        ex.finish(200, cancel_reason())
        raise
    if opened.response.status != 200:
        body = await read_rest(opened)
        ex.finish(opened.response.status, Reason.UPSTREAM_ERROR)
        yield b"data: " + body.strip() + b"\n\n"
        return
    async for part in relay_stream(ex, opened):
        yield part
