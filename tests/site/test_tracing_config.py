"""Which environments ask for traces (the standard OpenTelemetry variables), what stops start-up
naming the variable, and that tracing off imports nothing of OpenTelemetry's tracing."""

from __future__ import annotations

from pathlib import Path

import pytest

from telemetry import tracing
from tests.site.test_config import run_manage

ENDPOINT = "http://collector:4318"


@pytest.mark.parametrize(
    ("environ", "wanted"),
    [
        ({}, False),
        ({"OTEL_SERVICE_NAME": "llmgw", "OTEL_TRACES_SAMPLER": "always_on"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "  "}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": ENDPOINT + "/v1/traces"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT, "OTEL_SDK_DISABLED": "TRUE"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT, "OTEL_SDK_DISABLED": "false"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT, "OTEL_TRACES_EXPORTER": "none"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT, "OTEL_TRACES_EXPORTER": "otlp"}, True),
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT,
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            },
            True,
        ),
        # The traces-only protocol wins over the general one, as in the SDK.
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT,
                "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
            },
            True,
        ),
    ],
)
def test_an_environment_asks_for_traces_only_with_an_endpoint(
    environ: dict[str, str], wanted: bool
) -> None:
    assert tracing.wanted(environ) is wanted


@pytest.mark.parametrize(
    ("environ", "named"),
    [
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4318"}, "OTEL_EXPORTER_OTLP_ENDPOINT="),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "ftp://x/"}, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT="),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT, "OTEL_TRACES_EXPORTER": "zipkin"},
            "OTEL_TRACES_EXPORTER='zipkin'",
        ),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
            "OTEL_EXPORTER_OTLP_PROTOCOL='grpc'",
        ),
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT,
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json",
            },
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL='http/json'",
        ),
    ],
)
def test_what_tracing_cannot_honour_names_the_variable(environ: dict[str, str], named: str) -> None:
    with pytest.raises(tracing.TracingConfigError, match=named):
        tracing.wanted(environ)


def test_a_process_with_a_bad_tracing_variable_does_not_start(tmp_path: Path) -> None:
    variables = {"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    result = run_manage({"LLMGW_VAR_DIR": str(tmp_path), "SECRET_KEY": "x", **variables}, "check")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "llmgw cannot start:" in result.stderr
    assert "OTEL_EXPORTER_OTLP_PROTOCOL='grpc'" in result.stderr


def test_tracing_off_has_no_current_trace_and_no_span() -> None:
    assert not tracing.active()
    assert tracing.current_trace_id() is None
    span = tracing.request(
        "chat", "/v1/chat/completions", "req_1", 0.0, traceparent="", tracestate=""
    )
    assert span is None
    with tracing.span("reconcile tick", {"llmgw.lease.epoch": 1}) as block:
        block.set_attribute("llmgw.tick.placed", 1)
    assert tracing.current_trace_id() is None
