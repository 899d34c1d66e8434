"""Relaying an upstream's answer to the client, and how each kind of answer ends.

A whole body is read and handed on, and its usage read from it once the client has it. An SSE
stream is relayed chunk by chunk within the idle deadline, the usage chunk hidden from a client
that did not ask for it; a stream that stalls, fails or ends without its terminal event ends
with an error event, and its upstream is ejected. Either way the exchange finishes with exactly
one usage record: the engine's count, or one made from what was relayed.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncGenerator

from gateway import responses
from gateway.errors import ApiError
from gateway.relay import counting, payload
from gateway.relay.attempts import Opened
from gateway.relay.exchange import Deadlines, Exchange, Reason, cancel_reason
from gateway.relay.upstream_client import UpstreamError
from gateway.responses import Response
from gateway.routing.table import Upstream
from gateway.routing.upstreams import upstreams
from telemetry import metrics


async def read_rest(opened: Opened) -> bytes:
    """The whole body of an opened answer: its first bytes and the rest."""
    if opened.complete:
        return opened.first
    try:
        rest = await opened.response.read()
    finally:
        opened.response.release()  # back to the pool if the answer is complete
    return opened.first + rest


async def relay_body(ex: Exchange, opened: Opened) -> Response:
    body = await read_rest(opened)
    response = opened.response
    answer = responses.whole(
        response.status,
        body,
        content_type=response.headers.get(b"content-type") or responses.JSON,
        request_id=ex.request_id,
    )
    # The usage is read from the answer and recorded once the client has it.
    answer.after = functools.partial(_finish_body, ex, opened.upstream, response.status, body)
    return answer


def _finish_body(ex: Exchange, upstream: Upstream, status: int, body: bytes) -> None:
    tokens, reason = payload.usage_of_body(body) if status == 200 else (None, "")
    if status == 200 and tokens is None:
        ex.finish_uncounted(status, reason, upstream, lambda: (counting.body_texts(body), None))
    else:
        ex.finish(status, reason if status == 200 else Reason.UPSTREAM_ERROR, tokens)


async def relay_stream(ex: Exchange, opened: Opened) -> AsyncGenerator[bytes]:
    """Relay the SSE stream chunk by chunk; exactly one usage record however it ends."""
    assert ex.body is not None and ex.route is not None
    response = opened.response
    sse = payload.SseFilter(
        hide_usage_chunk=not ex.body.client_wants_usage and ex.api_route.chunked
    )
    idle = Deadlines.of(ex.route).idle
    failure: ApiError | None = None
    clean = False
    try:
        out = sse.feed(opened.first)
        if out:
            yield out
        while True:
            chunk = await response.read_piece(idle)
            if not chunk:
                break
            out = sse.feed(chunk)
            if out:
                yield out
        clean = True
    except TimeoutError:
        failure = ApiError(
            504, f"The upstream stalled for {idle:g}s mid-stream.", "upstream_timeout"
        )
    except UpstreamError:
        failure = ApiError(502, "The upstream failed mid-stream.", "upstream_error")
    except (asyncio.CancelledError, GeneratorExit):
        # Billed the prompt and what was relayed (the engine's count if it gave one).
        _finish_stream(ex, opened, sse, cancel_reason())
        raise
    finally:
        if clean:
            response.release()
        else:
            # Closing (not releasing) drops the connection, which is how the engine learns to
            # stop generating for a client that is gone.
            response.close()
    rest = sse.rest()
    if failure is None and not sse.terminal:
        # The connection ended cleanly but the stream did not: an engine that crashed or was
        # cut off mid-answer. Relayed as it was, the client would take it for a whole answer.
        failure = ApiError(
            502,
            "The upstream ended the stream before its last event; the answer is incomplete.",
            "upstream_truncated",
        )
    if failure is not None:
        upstreams.eject(opened.upstream)
        metrics.observe_upstream_error(
            ex.route.name,
            {504: "idle_timeout"}.get(failure.status, "after_first_byte"),
        )
        _finish_stream(
            ex, opened, sse, Reason.TIMEOUT if failure.status == 504 else Reason.UPSTREAM_ERROR
        )
        yield (
            rest + failure.sse_event()
            if rest.endswith(b"\n\n") or not rest
            else (rest + b"\n\n" + failure.sse_event())
        )
        return
    if rest:
        yield rest
    reason = sse.finish_reason or Reason.STOP
    if sse.tokens is None and ex.body.client_wants_usage and ex.api_route.chunked:
        # The client asked for usage and the engine gave none: count now, and send the one
        # usage chunk OpenAI's format has, before [DONE].
        relayed = counting.Relayed(sse.blocks)
        completions, head = relayed.parsed()
        counted = await ex.count(opened.upstream, completions, relayed.content_events)
        ex.finish(200, reason, counted.tokens, counted.source)
        yield counting.usage_chunk(head, counted.tokens, ex.api_route.kind)
    else:
        _finish_stream(ex, opened, sse, reason)
    if sse.done:
        yield payload.DONE_EVENT


def _finish_stream(ex: Exchange, opened: Opened, sse: payload.SseFilter, reason: str) -> None:
    """One usage row for a stream however it ended: the engine's last report, else counted in
    the background from what was relayed."""
    if sse.tokens is not None:
        ex.finish(200, reason, sse.tokens)
        return
    blocks = sse.blocks

    def relayed() -> tuple[list[str], int | None]:
        kept = counting.Relayed(blocks)
        completions, _ = kept.parsed()
        return completions, kept.content_events

    ex.finish_uncounted(200, reason, opened.upstream, relayed)
