"""The relay: one request from a client, through auth, limits and routing, to an engine and back.

The upstream client is ``gateway.relay.upstream_client``, one pool per process: keep-alive, one
write per request, ``TCP_NODELAY``, no redirects, no cookies (see there for why and what it
measured against aiohttp, which had in turn measured at a fifth of httpx's CPU).

Deadlines are per phase: connect (``LLMGW_CONNECT_TIMEOUT``), first byte — the response
headers *and* the first body bytes, because only then is it too late to retry elsewhere
(``LLMGW_FIRST_BYTE_TIMEOUT``) — and the idle gap between chunks of a stream
(``LLMGW_STREAM_IDLE_TIMEOUT``); a model may override each. Before the first byte, a connect
error or an upstream 429/502/503/504 is retried on another upstream (bounded, Retry-After
honoured); after it, a failure ends the stream with an error event. A client that goes away
cancels the task running this code, which closes the upstream connection, so the engine stops
generating.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import logging
import os
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field

from django.conf import settings
from django.db import DatabaseError
from redis.exceptions import RedisError

from gateway import responses
from gateway.errors import ApiError, error_response, model_not_found
from gateway.identity import limits
from gateway.identity.keys import KeyInfo
from gateway.ledger.usage import Usage, recorder
from gateway.models import UsageRecord
from gateway.relay import counting, payload
from gateway.relay.drain import drain
from gateway.relay.routes import RelayRoute
from gateway.relay.upstream_client import Dropped, Pool, Unreachable, UpstreamError
from gateway.relay.upstream_client import Response as UpstreamResponse
from gateway.responses import Response
from gateway.routing.table import Route, Upstream
from gateway.routing.upstreams import upstreams
from telemetry import metrics

logger = logging.getLogger(__name__)

# Answers that say "not now, try elsewhere" rather than "this request is wrong".
RETRYABLE = frozenset({429, 502, 503, 504})
# What every upstream request carries besides its X-Request-Id (and Host, Content-Length).
_UPSTREAM_HEADERS = b"Content-Type: application/json\r\nAccept: application/json\r\n"
_UPSTREAM_STREAM_HEADERS = b"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
# A status no response carries, for the usage rows of clients that left before an answer.
CLIENT_CLOSED = 499
Reason = UsageRecord.FinishReason

_pool: Pool | None = None
_pool_loop: asyncio.AbstractEventLoop | None = None

# Idle pooled connections are dropped after this many seconds: sooner than engines drop them
# (uvicorn, under vLLM and SGLang, closes an idle keep-alive connection after 5 s), so a
# request is rarely sent down a connection the engine is closing at that moment.
KEEPALIVE_S = 4.0


def pool() -> Pool:
    """This process's upstream connections (one pool per event loop). No cap on their number:
    the engines bound their own concurrency, and a cap here would queue requests out of
    sight of the deadlines."""
    global _pool, _pool_loop
    loop = asyncio.get_running_loop()
    if _pool is None or _pool_loop is not loop:
        _pool = Pool(keepalive_s=KEEPALIVE_S)
        _pool_loop = loop
    return _pool


@dataclass(frozen=True)
class Deadlines:
    connect: float
    first_byte: float
    idle: float

    @classmethod
    def of(cls, route: Route) -> Deadlines:
        return cls(
            route.connect_timeout_s or float(settings.LLMGW_CONNECT_TIMEOUT),
            route.first_byte_timeout_s or float(settings.LLMGW_FIRST_BYTE_TIMEOUT),
            route.stream_idle_timeout_s or float(settings.LLMGW_STREAM_IDLE_TIMEOUT),
        )


@dataclass
class Exchange:
    """One request's state from authentication to its usage row."""

    api_route: RelayRoute  # the /v1 route the request came in on
    key: KeyInfo
    usage: Usage
    clock_start: float
    body: payload.Inspected | None = None
    route: Route | None = None
    reservation: limits.Reservation = limits.NO_RESERVATION
    holding: Upstream | None = None  # counted as outstanding until released
    started: bool = False
    finished: bool = False
    being_counted: bool = False  # its tokens are being counted: the count task finishes it
    learn_context: bool = False  # ask the engine its context length once this request ends
    served_by: Upstream | None = None
    tried: set[str] = field(default_factory=set)

    @property
    def request_id(self) -> str:
        return self.usage.request_id

    def hold(self, upstream: Upstream) -> None:
        self.drop_hold()
        upstreams.acquire(upstream)
        self.holding = upstream
        self.served_by = upstream
        self.usage.upstream = upstream.id
        if not self.started:
            self.started = True
            if settings.LLMGW_USAGE_ACCOUNTING:
                recorder.start(self.usage)

    def drop_hold(self) -> None:
        if self.holding is not None:
            upstreams.release(self.holding)
            self.holding = None

    def first_byte(self) -> None:
        if self.usage.ttft_ms is None:
            self.usage.ttft_ms = (time.perf_counter() - self.clock_start) * 1000

    def finish(
        self,
        status: int,
        reason: str,
        tokens: payload.Tokens | None = None,
        source: str = counting.ENGINE,
        *,
        counted: bool = False,
    ) -> None:
        """Close the request: exactly one usage record, whatever path ended it."""
        if self.finished or (self.being_counted and not counted):
            return
        self.finished = True
        if self.learn_context and self.served_by is not None and self.route is not None:
            # Only after the answer: llama-cpp-python's server interrupts the stream it is
            # generating when another request arrives.
            counting.learn_context_length(pool(), self.served_by.base_url, self.route.name)
        self.drop_hold()
        usage = self.usage
        usage.status = status
        usage.finish_reason = reason
        usage.duration_ms = (time.perf_counter() - self.clock_start) * 1000
        if tokens is not None:
            usage.prompt_tokens = tokens.prompt
            usage.completion_tokens = tokens.completion
            usage.cached_tokens = tokens.cached
            usage.source = source
        if settings.LLMGW_USAGE_ACCOUNTING:
            recorder.finish(usage)
            if tokens is not None and tokens.clamped:
                recorder.note_clamped(usage, tokens.clamped)
        # The catalog's name, never the client's string: clients cannot grow the label set.
        metrics.observe_request(
            self.route.name if self.route is not None else metrics.UNKNOWN_MODEL,
            status,
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            ttft_s=None if usage.ttft_ms is None else usage.ttft_ms / 1000,
            duration_s=usage.duration_ms / 1000,
        )
        if self.reservation.counters:
            limits.settle(self.reservation, usage.prompt_tokens + usage.completion_tokens)

    def finish_uncounted(
        self,
        status: int,
        reason: str,
        upstream: Upstream,
        relayed: Callable[[], tuple[list[str], int | None]],
    ) -> None:
        """Close a request its engine reported no usage for: counted in the background (the
        engine's tokenizer, or an estimate), then recorded. Nothing else may finish it."""
        if self.finished or self.being_counted:
            return
        self.being_counted = True
        self.drop_hold()
        task = asyncio.get_running_loop().create_task(
            self._count_then_finish(status, reason, upstream, relayed)
        )
        _counting.add(task)
        task.add_done_callback(_counting.discard)

    async def _count_then_finish(
        self,
        status: int,
        reason: str,
        upstream: Upstream,
        relayed: Callable[[], tuple[list[str], int | None]],
    ) -> None:
        completions: list[str] = []
        relayed_events: int | None = None
        try:
            # What was relayed is parsed here, after the answer has gone, not on its way out.
            completions, relayed_events = relayed()
            counted = await self.count(upstream, completions, relayed_events)
        except Exception:
            logger.exception("request %s: counting failed", self.request_id)
            counted = await counting.count(None, self.prompt(), completions, relayed_events)
        self.finish(status, reason, counted.tokens, counted.source, counted=True)

    def prompt(self) -> counting.Prompt:
        return counting.prompt_of(self.api_route.kind, self.body.data if self.body else {})

    async def count(
        self, upstream: Upstream, completions: list[str], relayed_events: int | None
    ) -> counting.Counted:
        assert self.route is not None
        tokenizer = counting.Tokenizer(pool(), upstream, self.route.name)
        return await counting.count(tokenizer, self.prompt(), completions, relayed_events)


# Count tasks in flight (held so they are not collected mid-count).
_counting: set[asyncio.Task[None]] = set()


async def counts_settled() -> None:
    """Wait for the background counts in flight: each ends in a usage row, which a stopping
    process must write before its usage recorder closes. The caller bounds the wait."""
    if _counting:
        await asyncio.wait(set(_counting))


_id_prefix: tuple[int, str] = (-1, "")
_id_counter = itertools.count(1)


def new_request_id() -> str:
    """``req_`` + 16 random hex digits per process + a counter: unique across processes and
    restarts without a ``getrandom`` system call per request (measured at ~27 us here).
    Always ours: a client-chosen id could collide with another row and lose it."""
    global _id_prefix
    pid = os.getpid()
    if _id_prefix[0] != pid:  # a forked child must not repeat its parent's ids
        _id_prefix = (pid, secrets.token_hex(8))
    return f"req_{_id_prefix[1]}{next(_id_counter):x}"


def upstream_request_id(request_id: str) -> bytes:
    """The request id as the engine is told it: the same hex digits in UUID form, because
    llama-cpp-python's server refuses (400, empty body) any X-Request-Id that is not a UUID,
    while vLLM and SGLang take any string."""
    digits = request_id[4:20] + request_id[20:].rjust(16, "0")[-16:]
    return (f"{digits[:8]}-{digits[8:12]}-{digits[12:16]}-{digits[16:20]}-{digits[20:32]}").encode()


def _start_background() -> None:
    recorder.ensure_running()


async def relay(body: bytes, key: KeyInfo, api_route: RelayRoute, clock_start: float) -> Response:
    """The request path after authentication, for one ``/v1`` call that goes to an engine."""
    _start_background()
    request_id = new_request_id()
    usage = Usage(request_id, key.id, key.user_id, "", api_route.kind, time.time())
    ex = Exchange(api_route, key, usage, clock_start)
    try:
        return await _serve(ex, body)
    except ApiError as error:
        ex.finish(error.status, _reason_for(error))
        return error_response(error, request_id)
    except asyncio.CancelledError:
        ex.finish(CLIENT_CLOSED, _cut_short())
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


def _cut_short() -> str:
    """Why a request was cancelled: its client left, or this process's stop grace ran out."""
    return Reason.INTERRUPTED if drain.cut else Reason.CLIENT_DISCONNECT


def _reason_for(error: ApiError) -> str:
    if error.status == 504:
        return Reason.TIMEOUT
    if error.status == 502:
        return Reason.UPSTREAM_ERROR
    return Reason.ERROR


async def _serve(ex: Exchange, raw: bytes) -> Response:
    body = payload.inspect(raw, ex.api_route, max_items=int(settings.LLMGW_MAX_ITEMS))
    ex.body = body
    ex.usage.model = body.model
    ex.usage.stream = body.stream
    table = await upstreams.ready()
    route = table.resolve(body.model)
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
    ex.reservation = await limits.reserve(ex.key, plan.tokens)
    if plan.output_cap is not None and ex.reservation.token_counters():
        # A token limit applies: the engine is told the cap that was reserved, never more.
        ex.body = body = payload.with_output_cap(body, ex.api_route, plan.output_cap)
        # Reserved by the default for want of the context length: learn it for next time.
        ex.learn_context = body.max_tokens is None and context_length is None
    upstreams.note_request(route, None)
    if not route.upstreams:
        if body.stream:
            # Headers go out now so keep-alive comments can hold the stream open while the
            # model starts; anything that fails later ends the stream with an error event.
            return responses.event_stream(_held_stream(ex), ex.request_id)
        ex.route = await _wait_for_activation(ex, route)
    opened = await _open(ex)
    if body.stream and opened.response.status == 200:
        return responses.event_stream(_relay_stream(ex, opened), ex.request_id)
    return await _relay_body(ex, opened)


# --- activation -----------------------------------------------------------------------------


async def _activation_slot(ex: Exchange, route: Route) -> int:
    """A place in the model's queue of waiters, counted across every web process."""
    assert route.catalog_id is not None
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
    try:
        while True:
            # The route asked for, profile included (the body now names the model only).
            wanted = f"{route.name}@{route.profile}" if route.profile else ex.body.model
            current = upstreams.table.resolve(wanted)
            if current is not None and current.upstreams:
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
            upstreams.note_demand(route)
            with metrics.waiting_for_activation(route.name):
                await upstreams.changed(min(deadline, next_keepalive) - now)
    finally:
        upstreams.leave_waiting_slot(catalog_id)
        metrics.observe_activation_wait(route.name, time.monotonic() - began, outcome)


async def _wait_for_activation(ex: Exchange, route: Route) -> Route:
    async for ready in _activations(ex, route):
        if ready is not None:
            return ready
    raise AssertionError("activation ended without a route or an error")


async def _held_stream(ex: Exchange) -> AsyncGenerator[bytes]:
    assert ex.route is not None
    try:
        async for ready in _activations(ex, ex.route):
            if ready is None:
                yield b": waiting\n\n"
            else:
                ex.route = ready
        opened = await _open(ex)
    except ApiError as error:
        ex.finish(200, _reason_for(error))
        yield error.sse_event()
        return
    except (asyncio.CancelledError, GeneratorExit):
        ex.finish(200, _cut_short())
        raise
    if opened.response.status != 200:
        body = await _read_rest(opened)
        ex.finish(opened.response.status, Reason.UPSTREAM_ERROR)
        yield b"data: " + body.strip() + b"\n\n"
        return
    async for part in _relay_stream(ex, opened):
        yield part


# --- talking to the upstream ------------------------------------------------------------------


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


async def _open(ex: Exchange) -> Opened:
    """Send the request, retrying before the first byte; returns once the first bytes are in."""
    assert ex.route is not None and ex.body is not None
    deadlines = Deadlines.of(ex.route)
    attempts = 1 + int(settings.LLMGW_RETRIES)
    last: ApiError = ApiError(
        503, f"No upstream serves '{ex.route.name}' now.", "no_upstream", retry_after=5
    )
    for attempt in range(attempts):
        upstream = upstreams.choose(ex.route, exclude=ex.tried) or upstreams.choose(ex.route)
        if upstream is None:
            break
        if attempt:
            metrics.observe_retry(ex.route.name, last.code)
        ex.tried.add(upstream.id)
        try:
            outcome = await _attempt(ex, upstream, deadlines)
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


async def _attempt(
    ex: Exchange, upstream: Upstream, deadlines: Deadlines
) -> Opened | tuple[ApiError, float | None]:
    """One try. A retryable failure comes back as (error, seconds to wait or None)."""
    assert ex.body is not None
    ex.hold(upstream)
    headers = _UPSTREAM_STREAM_HEADERS if ex.body.stream else _UPSTREAM_HEADERS
    response: UpstreamResponse | None = None
    try:
        async with asyncio.timeout(deadlines.first_byte):
            headers += upstream.authorization  # the engine's own key: only the gateway holds it
            response = await pool().post(
                upstream.base_url,
                ex.api_route.path,
                ex.body.forward_body,
                headers + b"X-Request-Id: " + upstream_request_id(ex.request_id) + b"\r\n",
                connect_timeout=deadlines.connect,
                addresses=upstream.addresses,
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


async def _read_rest(opened: Opened) -> bytes:
    if opened.complete:
        return opened.first
    try:
        rest = await opened.response.read()
    finally:
        opened.response.release()  # back to the pool if the answer is complete
    return opened.first + rest


async def _relay_body(ex: Exchange, opened: Opened) -> Response:
    body = await _read_rest(opened)
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


async def _relay_stream(ex: Exchange, opened: Opened) -> AsyncGenerator[bytes]:
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
        _finish_stream(ex, opened, sse, _cut_short())
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
