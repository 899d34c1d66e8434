"""Opening an upstream for one exchange: attempt after attempt until its first bytes are in.

Deadlines are per phase: connect (``LLMGW_CONNECT_TIMEOUT``), first byte — the response
headers *and* the first body bytes, because only then is it too late to retry elsewhere
(``LLMGW_FIRST_BYTE_TIMEOUT``) — and the idle gap between chunks of a stream
(``LLMGW_STREAM_IDLE_TIMEOUT``); a model may override each. Before the first byte, a connect
error or an upstream 429/502/503/504 is retried on another upstream (bounded, Retry-After
honoured), and the upstream that refused or could not be reached is ejected for a cool-down;
after it, a failure ends the stream with an error event (``gateway.relay.answers``). A client
that goes away cancels the task running this code, which closes the upstream connection, so
the engine stops generating.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from django.conf import settings

from gateway.errors import ApiError
from gateway.relay.exchange import Deadlines, Exchange, pool, upstream_request_id
from gateway.relay.upstream_client import Dropped, Unreachable, UpstreamError
from gateway.relay.upstream_client import Response as UpstreamResponse
from gateway.routing.choice import Choice
from gateway.routing.table import Upstream
from gateway.routing.upstreams import upstreams
from telemetry import metrics, tracing

logger = logging.getLogger(__name__)

# Answers that say "not now, try elsewhere" rather than "this request is wrong".
RETRYABLE = frozenset({429, 502, 503, 504})
# What every upstream request carries besides its X-Request-Id (and Host, Content-Length).
_UPSTREAM_HEADERS = b"Content-Type: application/json\r\nAccept: application/json\r\n"
_UPSTREAM_STREAM_HEADERS = b"Content-Type: application/json\r\nAccept: text/event-stream\r\n"


@dataclass
class Opened:
    upstream: Upstream
    response: UpstreamResponse
    first: bytes  # the first body bytes (streams) or the whole body (everything else)
    complete: bool


def _retry_after(response: UpstreamResponse) -> float | None:
    raw = response.header(b"retry-after")
    if raw is None:
        return None
    try:
        return max(0.0, float(raw))
    except ValueError:
        return None


def _upstream_refusal(status: int, retry_after: float | None) -> ApiError:
    if status == 429:
        return ApiError(
            429,
            "The model is overloaded; try again shortly.",
            "upstream_rate_limited",
            retry_after=retry_after or 1,
        )
    return ApiError(
        status if status in (502, 503, 504) else 502,
        f"The upstream answered {status}.",
        "upstream_unavailable",
        retry_after=retry_after,
    )


async def open_upstream(ex: Exchange) -> Opened:
    """Send the request, retrying before the first byte; returns once the first bytes are in."""
    assert ex.route is not None and ex.body is not None
    deadlines = Deadlines.of(ex.route)
    attempts = 1 + int(settings.LLMGW_RETRIES)
    last: ApiError = ApiError(
        503, f"No upstream serves '{ex.route.name}' now.", "no_upstream", retry_after=5
    )
    for attempt in range(attempts):
        choice = ex.choose()
        if choice is None:
            break
        upstream = choice.upstream
        if attempt:
            metrics.observe_retry(ex.route.name, last.code)
        ex.tried.add(upstream.id)
        try:
            outcome = await (
                _attempt(ex, upstream, deadlines)
                if ex.trace is None
                else _traced_attempt(ex, choice, deadlines, ex.trace)
            )
        except ApiError as error:  # not retried: a timeout, or a failure mid-answer
            metrics.observe_upstream_error(ex.route.name, error.code)
            raise
        if isinstance(outcome, Opened):
            return outcome
        last, wait = outcome
        metrics.observe_upstream_error(ex.route.name, last.code)
        untried = any(u.id not in ex.tried for u in ex.route.upstreams)
        if wait is not None and not untried:
            if wait > float(settings.LLMGW_RETRY_AFTER_MAX):
                break  # the client is better placed to wait that long
            await asyncio.sleep(wait)
    raise last


async def _traced_attempt(
    ex: Exchange, choice: Choice, deadlines: Deadlines, trace: tracing.RequestSpan
) -> Opened | tuple[ApiError, float | None]:
    """One try under a span of its own, whose context goes to the engine with the request."""
    assert ex.route is not None
    upstream = choice.upstream
    headers = trace.attempt(upstream.id, upstream.base_url, ex.route.name, choice.outcome)
    try:
        outcome = await _attempt(ex, upstream, deadlines, headers)
    except ApiError as error:
        trace.attempt_failed(error.code, error.message)
        raise
    if isinstance(outcome, Opened):
        trace.attempt_answered(outcome.response.status)
    else:
        trace.attempt_failed(outcome[0].code, outcome[0].message)
    return outcome


async def _attempt(
    ex: Exchange, upstream: Upstream, deadlines: Deadlines, trace_headers: bytes = b""
) -> Opened | tuple[ApiError, float | None]:
    """One try at ``upstream``, where the choice holds the request (``Exchange.choose``). A
    retryable failure comes back as (error, seconds to wait or None); ``trace_headers`` are the
    attempt's trace context lines, when it is traced."""
    assert ex.body is not None
    headers = _UPSTREAM_STREAM_HEADERS if ex.body.stream else _UPSTREAM_HEADERS
    response: UpstreamResponse | None = None
    try:
        async with asyncio.timeout(deadlines.first_byte):
            # The pool adds the engine's own key (only the gateway holds it) and connects only
            # where the upstream's address policy allows.
            response = await pool().post(
                upstream,
                ex.api_route.path,
                ex.body.forward_body,
                headers
                + b"X-Request-Id: "
                + upstream_request_id(ex.request_id)
                + b"\r\n"
                + trace_headers,
                connect_timeout=deadlines.connect,
            )
            status = response.status
            # An engine never redirects; an upstream that does is not followed anywhere.
            if 300 <= status < 400:
                response.close()
                ex.drop_hold()
                raise ApiError(
                    502,
                    f"The upstream answered {status} (redirects are not followed).",
                    "upstream_redirect",
                )
            if status in RETRYABLE:
                retry_after = _retry_after(response)
                response.close()
                if status == 429:
                    cool_down = min(retry_after or 1.0, float(settings.LLMGW_EJECT_SECONDS))
                    upstreams.eject(upstream, cool_down)
                else:
                    upstreams.eject(upstream)
                ex.drop_hold()
                return _upstream_refusal(status, retry_after), retry_after
            if ex.body.stream and status == 200:
                first = await response.read_piece()
                complete = False
            else:
                first = await response.read()
                response.release()
                complete = True
    except Unreachable as exc:
        upstreams.eject(upstream)
        ex.drop_hold()
        logger.warning(
            "request %s: upstream %s unreachable: %s",
            ex.request_id,
            upstream.id,
            exc,
        )
        return ApiError(502, "The upstream could not be reached.", "upstream_unreachable"), None
    except Dropped:
        # Almost always a pooled connection the engine had closed; try again, without ejecting.
        ex.drop_hold()
        return ApiError(502, "The upstream closed the connection.", "upstream_disconnected"), None
    except TimeoutError:
        if response is not None:
            response.close()
        # Not retried: the engine may be working on it, and a second copy would double the cost.
        raise ApiError(
            504, f"The upstream sent nothing for {deadlines.first_byte:g}s.", "upstream_timeout"
        ) from None
    except UpstreamError:
        if response is not None:
            response.close()
        upstreams.eject(upstream)
        raise ApiError(502, "The upstream failed before answering.", "upstream_error") from None
    except BaseException:
        if response is not None:
            response.close()
        raise
    ex.first_byte()
    return Opened(upstream, response, first, complete)
