"""OpenTelemetry traces end to end: a real web process in front of ``sim`` engines, exporting to
a real OTLP/HTTP receiver (``tests.harness.otlp``), which decodes what it gets with
opentelemetry-proto. The client sends a W3C ``traceparent``; the request's span joins its trace,
each attempt is the request span's child, and the engine receives the attempt's context (the
sim records the trace context it was sent). With the variables unset, or the SDK disabled,
nothing is exported, nothing is propagated, and the web process never imports the SDK's tracing
(redis-py imports the SDK's metrics by itself wherever the SDK is installed)."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from gateway.routing.choice import OUTCOMES
from tests.harness.factories import Served, make_key, make_model, serve_model
from tests.harness.live import (
    WEB_SETTINGS,
    Stack,
    gateway_stack,
    http,
    set_sim_faults,
    stop_checked,
)
from tests.harness.otlp import ReceivedSpan, Receiver, otlp_receiver
from tests.harness.procs import Proc, web_process
from tests.harness.store import child_env
from tests.harness.waits import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True), pytest.mark.timeout(300)]

MODEL = "traced"
TRACESTATE = "vendor=abc,other=1"


def web_env(var: Path, **extra: str) -> dict[str, str]:
    """A web process's environment with none of this shell's OTEL_ variables, then ``extra``."""
    env = child_env(LLMGW_VAR_DIR=str(var), **WEB_SETTINGS)
    env = {name: value for name, value in env.items() if not name.startswith("OTEL_")}
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    with otlp_receiver() as receiver:
        yield receiver


@pytest.fixture(scope="module")
def live(
    django_db_setup: None, tmp_path_factory: pytest.TempPathFactory, receiver: Receiver
) -> Iterator[Stack]:
    """Two engines, and a web process that exports its spans to the receiver."""
    traced = {
        # The traces-only variable: it would win over a general one this shell might have.
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.endpoint + "/v1/traces",
        "OTEL_BSP_SCHEDULE_DELAY": "50",  # ms: spans reach the receiver within a poll or two
        "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=test",
    }
    with gateway_stack(
        tmp_path_factory.mktemp("tracing"), [MODEL], settings=lambda _: traced
    ) as live:
        yield live


@pytest.fixture
def stack(live: Stack) -> Iterator[tuple[Proc, list[Proc]]]:
    """The module's processes; after each test its faults are cleared and its rows stored."""
    live.begin()
    yield live.web, live.engines
    for sim in live.engines:
        http("DELETE", sim.url + "/sim/faults")
    live.settle()


def client(web: Proc, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=web.url + "/v1", api_key=key, max_retries=0, timeout=60)


def client_context() -> tuple[str, str, str]:
    """A client's own trace: (trace id, span id, its traceparent header)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


def serving(web: Proc, engines: list[Proc]) -> tuple[Served, str]:
    """The model served by ``engines`` and routed by ``web``; a key that may use it."""
    served = serve_model(MODEL, [sim.port for sim in engines])
    key, _ = make_key("traced")
    routed(web, key)
    return served, key


def routed(web: Proc, key: str, model: str = MODEL) -> None:
    """Until the web process routes ``model`` (lists it to this key)."""
    wait_until(lambda: model in [m.id for m in client(web, key).models.list().data])


def trace_of(receiver: Receiver, trace_id: str, count: int, web: Proc) -> list[ReceivedSpan]:
    """The ``count`` spans of one trace, once all have come."""
    spans: list[ReceivedSpan] = receiver.wait_for(
        lambda got: len(mine := [s for s in got if s.trace_id == trace_id]) >= count and mine,
        f"{count} span(s) of trace {trace_id}",
        logs=[web],
    )
    return spans


# What tracing would import: the SDK's tracer, batching and exporter, the W3C propagator.
TRACING_MODULES = (
    "opentelemetry.sdk.trace",
    "opentelemetry.exporter",
    "opentelemetry.trace.propagation.tracecontext",
)


def imports_of(proc: Proc) -> set[str]:
    """The modules a process started with PYTHONPROFILEIMPORTTIME imported, from its log."""
    lines = proc.log().splitlines()
    return {line.rsplit("|", 1)[1].strip() for line in lines if line.startswith("import time:")}


def received_by_engines(engines: list[Proc]) -> list[dict[str, str]]:
    contexts: list[dict[str, str]] = []
    for sim in engines:
        status, _, body = http("GET", sim.url + "/sim/trace-context")
        assert status == 200, body
        contexts += json.loads(body)["received"]
    return contexts


def one(spans: list[ReceivedSpan], kind: str) -> ReceivedSpan:
    (span,) = [s for s in spans if s.kind == kind]
    return span


def test_a_request_joins_the_clients_trace_and_its_attempt_carries_it_to_the_engine(
    stack: tuple[Proc, list[Proc]], receiver: Receiver
) -> None:
    web, engines = stack
    served, key = serving(web, engines)
    trace_id, client_span, traceparent = client_context()
    raw = client(web, key).chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello there"}],
        max_tokens=7,
        extra_headers={"traceparent": traceparent, "tracestate": TRACESTATE},
    )
    answer = raw.parse()
    assert answer.usage is not None

    spans = trace_of(receiver, trace_id, 2, web)
    request, attempt = one(spans, "server"), one(spans, "client")
    # The request span is the client's span's child; the attempt is the request span's.
    assert request.parent_span_id == client_span
    assert attempt.parent_span_id == request.span_id
    assert request.trace_state == attempt.trace_state == TRACESTATE
    assert request.name == f"chat {MODEL}"
    replica_ids = {f"replica:{r.pk}" for r in served.replicas}
    assert request.attributes == {
        "gen_ai.operation.name": "chat",
        "gen_ai.request.model": MODEL,
        "gen_ai.request.stream": False,
        "gen_ai.request.max_tokens": 7,
        "gen_ai.response.model": MODEL,
        "gen_ai.response.finish_reasons": [answer.choices[0].finish_reason],
        "gen_ai.usage.input_tokens": answer.usage.prompt_tokens,
        "gen_ai.usage.output_tokens": answer.usage.completion_tokens,
        "gen_ai.usage.cache_read.input_tokens": 0,
        "gen_ai.response.time_to_first_chunk": request.attributes[
            "gen_ai.response.time_to_first_chunk"
        ],
        "http.request.method": "POST",
        "http.response.status_code": 200,
        "url.path": "/v1/chat/completions",
        "llmgw.request_id": raw.headers["x-request-id"],
        "llmgw.finish_reason": answer.choices[0].finish_reason,
        "llmgw.usage.source": "engine",
        "llmgw.upstream.id": attempt.attributes["llmgw.upstream.id"],
        "llmgw.route.outcome": attempt.attributes["llmgw.route.outcome"],
        "llmgw.retries": 0,
    }
    assert 0 < request.attributes["gen_ai.response.time_to_first_chunk"] < 60
    assert request.status == "unset"
    assert request.resource["service.name"] == "llmgw"
    assert request.resource["llmgw.process"] == "web"
    assert request.resource["deployment.environment"] == "test"
    assert request.resource["process.pid"] == web.pid

    assert attempt.attributes["llmgw.upstream.id"] in replica_ids
    assert attempt.attributes["llmgw.route.outcome"] in OUTCOMES
    port = attempt.attributes["server.port"]
    assert attempt.name == f"upstream {attempt.attributes['llmgw.upstream.id']}"
    assert attempt.attributes == {
        "gen_ai.operation.name": "chat",
        "gen_ai.request.model": MODEL,
        "server.address": "127.0.0.1",
        "server.port": port,
        "llmgw.upstream.id": attempt.attributes["llmgw.upstream.id"],
        "llmgw.route.outcome": attempt.attributes["llmgw.route.outcome"],
        "llmgw.attempt": 1,
        "http.response.status_code": 200,
    }
    assert port in [sim.port for sim in engines]
    assert request.start_ns <= attempt.start_ns <= attempt.end_ns <= request.end_ns

    # The engine that answered was sent the attempt's context, the client's tracestate with it.
    (engine,) = [sim for sim in engines if sim.port == port]
    status, _, body = http("GET", engine.url + "/sim/trace-context")
    assert status == 200, body
    sent = {
        "traceparent": f"00-{trace_id}-{attempt.span_id}-01",
        "tracestate": TRACESTATE,
    }
    assert sent in json.loads(body)["received"]


def test_each_retry_is_an_attempt_span_and_a_stream_records_its_first_token(
    stack: tuple[Proc, list[Proc]], receiver: Receiver
) -> None:
    web, engines = stack
    _, key = serving(web, engines)
    for sim in engines:  # each engine refuses once: two attempts fail, the third is answered
        set_sim_faults(sim, times=1, fail=503)
    trace_id, client_span, traceparent = client_context()
    stream = client(web, key).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "stream it"}],
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"traceparent": traceparent},
    )
    chunks = list(stream)
    usage = chunks[-1].usage
    assert usage is not None

    spans = trace_of(receiver, trace_id, 4, web)
    request = one(spans, "server")
    attempts = sorted(
        (s for s in spans if s.kind == "client"), key=lambda s: s.attributes["llmgw.attempt"]
    )
    assert [a.attributes["llmgw.attempt"] for a in attempts] == [1, 2, 3]
    assert all(a.parent_span_id == request.span_id for a in attempts)
    assert request.parent_span_id == client_span
    assert [a.status for a in attempts] == ["error", "error", "unset"]
    assert [a.attributes.get("error.type") for a in attempts] == [
        "upstream_unavailable",
        "upstream_unavailable",
        None,
    ]
    # The two that refused were the two engines.
    assert len({a.attributes["server.port"] for a in attempts[:2]}) == 2
    assert request.attributes["llmgw.retries"] == 2
    assert request.attributes["llmgw.upstream.id"] == attempts[2].attributes["llmgw.upstream.id"]
    assert request.attributes["gen_ai.request.stream"] is True
    assert request.attributes["gen_ai.usage.output_tokens"] == usage.completion_tokens
    assert request.attributes["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    first_token = request.attributes["gen_ai.response.time_to_first_chunk"]
    assert 0 < first_token <= (request.end_ns - request.start_ns) / 1e9
    assert request.status == "unset"
    # Each attempt's own context went to the engine it tried.
    sent = [c["traceparent"] for c in received_by_engines(engines)]
    for attempt in attempts:
        assert f"00-{trace_id}-{attempt.span_id}-01" in sent


def test_a_request_for_a_model_that_does_not_start_records_its_wait(
    stack: tuple[Proc, list[Proc]], receiver: Receiver
) -> None:
    web, _ = stack
    make_model("cold-traced", activation_timeout_s=1)
    key, _ = make_key("traced")
    routed(web, key, "cold-traced")
    trace_id, client_span, traceparent = client_context()
    with pytest.raises(openai.APIStatusError) as refused:
        client(web, key).chat.completions.create(
            model="cold-traced",
            messages=[{"role": "user", "content": "hi"}],
            extra_headers={"traceparent": traceparent},
        )
    assert refused.value.status_code == 503
    (request,) = trace_of(receiver, trace_id, 1, web)
    assert request.parent_span_id == client_span
    assert request.attributes["llmgw.activation.outcome"] == "timeout"
    assert request.attributes["llmgw.activation.wait_s"] >= 1
    assert request.attributes["error.type"] == "model_not_ready"
    assert request.attributes["http.response.status_code"] == 503
    assert request.status == "error"
    assert "llmgw.upstream.id" not in request.attributes  # no attempt was made


def test_a_request_without_a_traceparent_starts_a_trace_of_its_own(
    stack: tuple[Proc, list[Proc]], receiver: Receiver
) -> None:
    web, engines = stack
    _, key = serving(web, engines)
    raw = client(web, key).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "no trace of mine"}]
    )
    request_id = raw.headers["x-request-id"]
    (request,) = receiver.wait_for(
        lambda got: [s for s in got if s.attributes.get("llmgw.request_id") == request_id],
        f"the span of {request_id}",
        logs=[web],
    )
    assert request.parent_span_id == ""
    assert len(request.trace_id) == 32 and request.trace_id != "0" * 32


@pytest.mark.parametrize(
    "variables",
    [
        # Other OTEL_ variables alone ask for nothing.
        {"OTEL_SERVICE_NAME": "llmgw-off", "OTEL_TRACES_SAMPLER": "always_on"},
        # An endpoint with the SDK disabled asks for nothing either.
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "{receiver}", "OTEL_SDK_DISABLED": "true"},
    ],
    ids=["unset", "sdk-disabled"],
)
def test_with_tracing_off_nothing_is_exported_and_opentelemetry_is_never_imported(
    tmp_path: Path, receiver: Receiver, live: Stack, variables: dict[str, str]
) -> None:
    engines = live.engines
    serve_model(MODEL, [sim.port for sim in engines])
    key, _ = make_key("untraced")
    exported_before = receiver.posts
    engine_contexts_before = len(received_by_engines(engines))
    extra = {name: value.format(receiver=receiver.endpoint) for name, value in variables.items()}
    # Every import the process makes is written to its log (Python's -X importtime).
    env = web_env(tmp_path, PYTHONPROFILEIMPORTTIME="1", OTEL_BSP_SCHEDULE_DELAY="50", **extra)
    web = web_process("web-untraced", tmp_path / "logs", env)
    untraced = Stack(web, engines, tmp_path)
    untraced.begin()
    try:
        routed(web, key)
        traceparent = client_context()[2]
        for _ in range(3):
            answer: Any = client(web, key).chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hello"}],
                extra_headers={"traceparent": traceparent},
            )
            assert answer.choices
        untraced.settle()
    finally:
        stop_checked(web)  # a clean stop: whatever a tracer had queued would be exported now
    imported = imports_of(web)
    assert {"gateway.relay.entry", "telemetry.tracing"} <= imported, "the import log is there"
    # redis-py imports OpenTelemetry's metrics SDK by itself wherever the SDK is installed; the
    # SDK's tracing and its exporter, never.
    tracing_side = sorted(
        m for m in imported if m.startswith(TRACING_MODULES) or m == "telemetry.otel"
    )
    assert tracing_side == []
    assert receiver.posts == exported_before
    # Not traced, not propagated: the engines were sent no trace context.
    assert len(received_by_engines(engines)) == engine_contexts_before
