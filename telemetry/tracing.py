"""OpenTelemetry traces: off unless the standard variables name an OTLP endpoint.

With neither ``OTEL_EXPORTER_OTLP_ENDPOINT`` nor ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` set (or
with ``OTEL_SDK_DISABLED=true``, or ``OTEL_TRACES_EXPORTER=none``), nothing of OpenTelemetry is
imported and the request path makes no span: :func:`request` answers None, and the relay's few
``if ex.trace is not None`` are all it pays. With one set, each process calls :func:`start` once
it runs (a web process at its lifespan's start, the Celery worker in each pool process, beat at
its start: after any fork, since an exporting thread does not survive one) and :func:`shutdown`
at its clean exit, which exports what is still queued.

What is traced (the span vocabulary is in :mod:`telemetry.otel`, which imports the SDK):

- each ``/v1`` request that goes to an engine, one SERVER span named by the GenAI semantic
  conventions (``chat m1``), the client's W3C ``traceparent`` (and ``tracestate``) its parent;
- each upstream attempt, a CLIENT child span whose context goes to the engine in the upstream
  request's own ``traceparent``, so an engine that traces (vLLM does) joins the same trace;
- the reconciler's tick, and each placement inside it (:func:`span`).

Everything else is the SDK's, configured by the standard variables: ``OTEL_SERVICE_NAME``
(``llmgw`` when unset), ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER`` and its
``_ARG`` (parent-based always-on by default), ``OTEL_BSP_*`` for the batching, and
``OTEL_EXPORTER_OTLP_(TRACES_)HEADERS``, ``_TIMEOUT``, ``_COMPRESSION``, ``_CERTIFICATE`` for
the export, which is OTLP over HTTP with protobuf. A value llmgw cannot honour stops start-up
with a message naming the variable (:func:`wanted`).

:func:`current_trace_id` is the trace of the request (or tick) being served, for log lines.
This module imports nothing of ours, and nothing of OpenTelemetry until :func:`start`.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Protocol
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from telemetry.otel import Ended, Tracing

AttributeValue = str | bool | int | float | Sequence[str]

# The traces-only variable is read first, as the SDK's exporter reads it.
ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
PROTOCOL_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")


class TracingConfigError(ValueError):
    """A tracing variable llmgw cannot honour; the message names it."""


def wanted(environ: Mapping[str, str]) -> bool:
    """Whether ``environ`` asks for traces (pure). Raises :class:`TracingConfigError` for an
    endpoint that is no URL, an exporter other than OTLP, or a protocol other than OTLP/HTTP
    with protobuf (the one exporter llmgw ships)."""
    endpoints = [(name, environ.get(name, "").strip()) for name in ENDPOINT_VARIABLES]
    if not any(value for _, value in endpoints):
        return False
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return False
    if exporter not in ("", "otlp"):
        raise TracingConfigError(
            f"OTEL_TRACES_EXPORTER={exporter!r}: llmgw exports traces with OTLP only "
            "(otlp, or none for no traces)"
        )
    for name, value in endpoints:
        parts = urlsplit(value) if value else None
        if parts is not None and (parts.scheme not in ("http", "https") or not parts.netloc):
            raise TracingConfigError(f"{name}={value!r} is not an http:// or https:// URL")
    for name in PROTOCOL_VARIABLES:
        protocol = environ.get(name, "").strip()
        if protocol:  # the traces-only one, when set, is the one that counts
            if protocol != "http/protobuf":
                raise TracingConfigError(
                    f"{name}={protocol!r}: llmgw sends OTLP over HTTP with protobuf (http/protobuf)"
                )
            break
    return True


_tracing: Tracing | None = None
_started_in = 0  # the pid that started _tracing: a forked child starts its own
_exit_hooked = False


def start(process: str) -> bool:
    """Start exporting this process's spans, if the environment asks for traces (see
    :func:`wanted`); whether it does. ``process`` (web, worker, beat, …) is recorded on every
    span as the resource attribute ``llmgw.process``. Calling it again changes nothing, except
    in a forked child of a process that had started: the child gets a provider of its own."""
    global _tracing, _started_in, _exit_hooked
    if _tracing is not None and _started_in == os.getpid():
        return True
    if not wanted(os.environ):
        return False
    from telemetry import otel  # noqa: PLC0415 - the SDK, imported only when traces are wanted

    _tracing = otel.Tracing(process)
    _started_in = os.getpid()
    if not _exit_hooked:
        _exit_hooked = True
        atexit.register(shutdown)
    return True


def shutdown() -> None:
    """Export what is queued and stop (a process's clean exit); later calls do nothing."""
    global _tracing
    tracing, _tracing = _tracing, None
    # A forked child leaves its parent's provider alone: what is queued there is the parent's.
    if tracing is not None and _started_in == os.getpid():
        tracing.shutdown()


def active() -> bool:
    return _tracing is not None


class Span(Protocol):
    """What code being traced may do to its span (an OpenTelemetry span is one)."""

    def set_attribute(self, key: str, value: AttributeValue) -> None: ...


class RequestSpan(Protocol):
    """One ``/v1`` request's span and its attempts' (:class:`telemetry.otel.Request`). The relay
    tells it what happens, in plain values; it knows the conventions' names for them."""

    def requested(self, model: str, *, stream: bool, max_tokens: int | None) -> None:
        """What the client asked for: the model as it named it, whether to stream."""

    def attempt(self, upstream_id: str, base_url: str, model: str, outcome: str) -> bytes:
        """An attempt on ``upstream_id`` begins (the routing ``outcome`` says why it was
        chosen): its span starts; the header lines that carry it to the engine."""

    def attempt_answered(self, status: int) -> None:
        """The attempt's upstream answered ``status`` (its first bytes are in)."""

    def attempt_failed(self, code: str, message: str) -> None:
        """The attempt failed with the gateway's error ``code``: its span ends."""

    def activation(self, seconds: float, outcome: str) -> None:
        """The request waited ``seconds`` for its model to start, and how that ended."""

    def error(self, code: str) -> None:
        """The request was refused or failed with the gateway's error ``code``."""

    def finish(self, usage: Ended) -> None:
        """The request ended with ``usage``, its usage row: its span, and an attempt's still
        open, end with what it says."""


def request(
    kind: str, path: str, request_id: str, clock_start: float, *, traceparent: str, tracestate: str
) -> RequestSpan | None:
    """The span of one ``/v1`` request that goes to an engine, begun at ``clock_start`` (its
    ``time.perf_counter()`` on arrival) under the client's trace context, and made the current
    span of the task serving it; None while tracing is off."""
    if _tracing is None:
        return None
    return _tracing.request(
        kind, path, request_id, clock_start, traceparent=traceparent, tracestate=tracestate
    )


class _NoSpan:
    """The span of code traced while tracing is off: nothing, reused."""

    def __enter__(self) -> _NoSpan:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None

    def set_attribute(self, key: str, value: AttributeValue) -> None:
        return None


_NO_SPAN = _NoSpan()


def span(name: str, attributes: Mapping[str, AttributeValue]) -> AbstractContextManager[Span]:
    """A span around a block (the reconciler's tick, a placement), the current span inside it,
    so a span begun within is its child; an exception leaving the block is recorded on it."""
    if _tracing is None:
        return _NO_SPAN
    return _tracing.span(name, attributes)


def current_trace_id() -> str | None:
    """The trace id (32 hex digits) of the request or tick this code runs for; None when
    tracing is off or nothing is being traced here (for log lines: they join the traces)."""
    if _tracing is None:
        return None
    return _tracing.current_trace_id()
