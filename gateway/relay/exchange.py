"""One request's state in the relay, from authentication to its usage row.

An ``Exchange`` holds what is known of one ``/v1`` call as it goes (its body, its route, the
tokens reserved for it, the upstream it holds) and finishes it with exactly one usage record,
whatever path ends it: an answer, an error, a client that left, or a count of its tokens in the
background where the engine reported none (:func:`counts_settled` waits for those). Beside it:
the deadlines of each phase, the request ids, the finish reason of a request cut short or
refused, and this process's upstream connections, which an exchange needs again after its
answer (to count tokens, to learn a context length).

The upstream client is ``gateway.relay.upstream_client``, one pool per process: keep-alive, one
write per request, ``TCP_NODELAY``, no redirects, no cookies (chosen over aiohttp, which had
been chosen over httpx, by measurement: docs/decisions.md, 'upstream client').
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from django.conf import settings

from gateway.errors import ApiError
from gateway.identity import limits
from gateway.identity.keys import KeyInfo
from gateway.ledger.recorder import recorder
from gateway.ledger.usage import Usage
from gateway.models import UsageRecord
from gateway.relay import counting, payload
from gateway.relay.drain import drain
from gateway.relay.routes import RelayRoute
from gateway.relay.upstream_client import Pool
from gateway.routing import prefix
from gateway.routing.choice import Choice, affinity_of
from gateway.routing.loads import Hold
from gateway.routing.placing import routing_settings
from gateway.routing.table import Route, Upstream
from gateway.routing.upstreams import upstreams
from telemetry import metrics, tracing

logger = logging.getLogger(__name__)

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
    holding: Hold | None = None  # counted as outstanding at its upstream until released
    started: bool = False
    finished: bool = False
    being_counted: bool = False  # its tokens are being counted: the count task finishes it
    learn_context: bool = False  # ask the engine its context length once this request ends
    served_by: Upstream | None = None
    tried: set[str] = field(default_factory=set)
    # Routing by the cache: the session the client named (an x-session-id header), the
    # prompt's blocks and session key (worked out once there is a choice to make), and what
    # the choice expected to be cached where it went (corrected by the engine's report).
    session: str | None = None
    blocks: prefix.PromptBlocks = prefix.NO_BLOCKS
    affinity: int | None = None
    predicted: int = 0
    keyed: bool = False
    # Its span (telemetry.tracing), when tracing is on: told what happens, ended by finish().
    trace: tracing.RequestSpan | None = None

    @property
    def request_id(self) -> str:
        return self.usage.request_id

    def choose(self) -> Choice | None:
        """The upstream for the next attempt (an untried one where any is left), the request
        then held there: counted as outstanding until ``drop_hold``."""
        assert self.route is not None
        if not self.keyed and len(self.route.upstreams) > 1:
            self._key_prompt()
        blocks, affinity = self.blocks, self.affinity
        key = affinity if affinity is not None else blocks.lead
        self.drop_hold()
        taken = upstreams.take(
            self.route, self.tried, blocks=blocks, affinity=affinity, key=key
        ) or upstreams.take(self.route, blocks=blocks, affinity=affinity, key=key)
        if taken is None:
            return None
        choice, self.holding = taken
        self.predicted = choice.predicted
        metrics.observe_route(self.route.name, choice.outcome)
        upstream = choice.upstream
        self.served_by = upstream
        self.usage.upstream = upstream.id
        if not self.started:
            self.started = True
            if settings.LLMGW_USAGE_ACCOUNTING:
                recorder.start(self.usage)
        return choice

    def _key_prompt(self) -> None:
        """The prompt as blocks and the session it names: what routing by the cache places by
        (generation requests only; embeddings and rerank keep no cache between requests)."""
        self.keyed = True
        knobs = routing_settings()
        if self.body is None or self.api_route.tag != "generation" or not knobs.cache_aware:
            return
        self.blocks = prefix.blocks_of(
            self.api_route.kind, self.body.data, knobs.block_bytes, knobs.max_blocks
        )
        self.affinity = affinity_of(self.body.data, self.session)

    def drop_hold(self) -> None:
        if self.holding is not None:
            upstreams.release(self.holding)
            self.holding = None

    def first_byte(self) -> None:
        # Only an attempt without a first byte is retried, so the first byte is the held
        # upstream's: its prefill is done (awaiting counts it until then).
        if self.usage.ttft_ms is None:
            self.usage.ttft_ms = (time.perf_counter() - self.clock_start) * 1000
            if self.holding is not None:
                upstreams.answered(self.holding)

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
            counting.learn_context_length(pool(), self.served_by, self.route.name)
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
        if tokens is not None and source == counting.ENGINE and self.blocks.keys:
            if not tokens.clamped:  # a count out of range says nothing about this prompt
                upstreams.placer.measure(self.blocks, tokens.prompt)
        if tokens is not None and tokens.cached_reported and self.served_by is not None:
            self._learn(self.served_by, tokens)
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
        if self.trace is not None:
            self.trace.finish(usage)  # its span ends with what its usage row says

    def _learn(self, upstream: Upstream, tokens: payload.Tokens) -> None:
        """What the engine said it had cached: the truth routing is corrected by, and the
        prefix-cache hit ratio operators watch."""
        assert self.route is not None
        prediction = None
        if self.blocks.keys and not tokens.clamped:  # counts out of range tell nothing of it
            learned = upstreams.placer.learn(
                upstream, self.blocks, self.predicted, tokens.cached, tokens.prompt
            )
            prediction = learned.outcome
        metrics.observe_prefix_cache(
            self.route.name,
            upstream.id,
            prompt_tokens=tokens.prompt,
            cached_tokens=tokens.cached,
            prediction=prediction,
        )

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
    restarts without a ``getrandom`` system call per request (docs/decisions.md, 'request
    ids').
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


def cancel_reason() -> str:
    """Why a request was cancelled: its client left, or this process's stop grace ran out."""
    return Reason.INTERRUPTED if drain.cut else Reason.CLIENT_DISCONNECT


def error_reason(error: ApiError) -> str:
    """The finish reason of a request that ``error`` ended."""
    if error.status == 504:
        return Reason.TIMEOUT
    if error.status == 502:
        return Reason.UPSTREAM_ERROR
    return Reason.ERROR
