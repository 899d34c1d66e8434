"""Log lines as JSON (``agents.logs``) carrying the request's ids (``telemetry.logs``): what a
line holds, what it never holds, and which ``traceparent`` headers give a trace id."""

from __future__ import annotations

import asyncio
import contextvars
import io
import json
import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agents import logs as lines
from telemetry import logs
from tests.harness.procs import REPO_ROOT

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.mark.parametrize(
    ("header", "trace_id"),
    [
        (f"00-{TRACE}-00f067aa0ba902b7-01", TRACE),
        (f" 00-{TRACE}-00f067aa0ba902b7-00 ", TRACE),
        # A later version may add fields after the flags; version 00 may not.
        (f"01-{TRACE}-00f067aa0ba902b7-01-more", TRACE),
        (f"00-{TRACE}-00f067aa0ba902b7-01-more", None),
        (f"ff-{TRACE}-00f067aa0ba902b7-01", None),
        (f"00-{'0' * 32}-00f067aa0ba902b7-01", None),
        (f"00-{TRACE}-{'0' * 16}-01", None),
        (f"00-{TRACE.upper()}-00f067aa0ba902b7-01", None),
        ("00-abc-def-01", None),
        ("", None),
        (None, None),
    ],
)
def test_the_trace_id_comes_from_a_well_formed_traceparent_only(
    header: str | None, trace_id: str | None
) -> None:
    assert logs.trace_id_of(header) == trace_id


@pytest.fixture
def captured() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(lines.JsonFormatter({"process": "web"}))
    handler.addFilter(logs.RequestIds())
    logger = logging.getLogger("tests.json-lines")
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.INFO)
    try:
        yield logger, stream
    finally:
        logger.removeHandler(handler)


def records(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_a_line_outside_a_request_has_the_fields_and_no_ids(
    captured: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, stream = captured
    contextvars.Context().run(logger.warning, "node %s is %s", "g1", "lost")
    (line,) = records(stream)
    assert set(line) == {"time", "level", "logger", "message", "pid", "process"}
    assert line["message"] == "node g1 is lost"
    assert line["level"] == "WARNING"
    assert line["logger"] == "tests.json-lines"
    assert line["process"] == "web"
    assert isinstance(line["time"], str) and line["time"].endswith("Z")
    assert len(line["time"]) == len("2024-01-01T00:00:00.000Z")


def test_lines_while_serving_a_request_carry_its_ids_and_those_of_other_requests_do_not(
    captured: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, stream = captured

    async def serve(request_id: str, traceparent: str | None) -> None:
        logs.begin_request(request_id, traceparent)
        await asyncio.sleep(0)  # the other request runs meanwhile
        logger.info("request %s: done", request_id)
        # What the request starts inherits its ids.
        await asyncio.create_task(asyncio.to_thread(logger.info, "counted %s", request_id))

    async def both() -> None:
        await asyncio.gather(
            serve("req_a", f"00-{TRACE}-00f067aa0ba902b7-01"), serve("req_b", None)
        )
        logger.info("between requests")

    asyncio.run(both())
    by_message = {line["message"]: line for line in records(stream)}
    for message in ("request req_a: done", "counted req_a"):
        assert by_message[message]["request_id"] == "req_a"
        assert by_message[message]["trace_id"] == TRACE
    for message in ("request req_b: done", "counted req_b"):
        assert by_message[message]["request_id"] == "req_b"
        assert "trace_id" not in by_message[message]
    assert "request_id" not in by_message["between requests"]


def test_a_traceback_stays_in_its_line_and_extras_never_reach_it(
    captured: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, stream = captured
    try:
        raise RuntimeError("upstream said no\nsecond line")
    except RuntimeError:
        logger.exception("relay failed", extra={"authorization": "Bearer llmgw-secret"})
    assert len(stream.getvalue().splitlines()) == 1
    (line,) = records(stream)
    assert "RuntimeError: upstream said no\nsecond line" in str(line["exc"])
    assert "llmgw-secret" not in stream.getvalue()
    assert "authorization" not in line


def test_the_plain_format_is_the_one_given_and_an_unknown_format_is_refused() -> None:
    plain = lines.formatter("plain", "%(levelname)s %(message)s", {"process": "web"})
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "hello %s", ("you",), None)
    assert plain.format(record) == "INFO hello you"
    with pytest.raises(ValueError, match="one of plain, json"):
        lines.formatter("xml", "", {})


def agent(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """The agent started without a node token: it says so, and exits."""
    argv = [sys.executable, "-m", "agents", "--node", "g7", "--state-dir", str(tmp_path / "s")]
    argv += ["--weights-dir", str(tmp_path / "w")]
    return subprocess.run(
        argv, cwd=REPO_ROOT, env={"PATH": "/usr/bin:/bin", **env},
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def test_the_agent_writes_json_lines_under_the_setting_and_plain_ones_without(
    tmp_path: Path,
) -> None:
    told = agent(tmp_path, LLMGW_LOG_FORMAT="json")
    assert told.returncode == 2
    (line,) = [json.loads(text) for text in told.stderr.splitlines()]
    assert line["message"] == "no node token: pass --token-file or set LLMGW_NODE_TOKEN"
    assert (line["level"], line["logger"], line["process"], line["node"]) == (
        "ERROR",
        "agents",
        "agent",
        "g7",
    )
    plain = agent(tmp_path)
    assert plain.stderr.strip().endswith(
        "ERROR agent[g7] agents: no node token: pass --token-file or set LLMGW_NODE_TOKEN"
    )
    wrong = agent(tmp_path, LLMGW_LOG_FORMAT="xml")
    assert wrong.returncode == 2
    assert "LLMGW_LOG_FORMAT='xml': use one of plain, json" in wrong.stderr
