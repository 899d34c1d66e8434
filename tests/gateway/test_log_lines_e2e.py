"""A request's log lines name it: with ``LLMGW_LOG_FORMAT=json`` each line a real web process
writes while serving a ``/v1`` request carries its ``request_id`` (the ``x-request-id`` the
client got back) and, when the client sent a W3C ``traceparent``, its ``trace_id``; lines of no
request carry neither, and no line carries a key (G15). Without the setting, the lines are as
they always were.

The request goes to a static endpoint nobody listens on, so that the relay logs a warning
naming the upstream while it serves it; the access log adds one line a request."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness.factories import make_key
from tests.harness.live import assert_no_secrets, http, start_web
from tests.harness.procs import Proc, free_port
from tests.harness.waits import wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.e2e, pytest.mark.timeout(300)]

TRACE = "0af7651916cd43dd8448eb211c80319c"
TRACEPARENT = f"00-{TRACE}-b7ad6b7169203331-01"
CHAT = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
# The plain format, as it has been: time, level, logger, [pid], message.
PLAIN = re.compile(
    r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR) \S+ \[\d+\] .+"
)


@pytest.fixture
def nowhere() -> str:
    """A static endpoint for model ``m`` on a port nobody listens on."""
    return f"dead=http://127.0.0.1:{free_port()}=m"


@contextlib.contextmanager
def web(tmp_path: Path, nowhere: str, **settings: str) -> Iterator[Proc]:
    proc = start_web(tmp_path / "var", LLMGW_STATIC_ENDPOINTS=nowhere, **settings)
    try:
        yield proc
    finally:
        proc.stop()
        assert_no_secrets(proc)


def failed_request(proc: Proc, key: str, **headers: str) -> str:
    """A request the relay cannot forward (502); its request id."""
    status, answer, body = http(
        "POST", proc.url + "/v1/chat/completions", key=key, body=CHAT, headers=headers
    )
    assert status == 502, body
    return str(answer["x-request-id"])


def json_lines(proc: Proc) -> list[dict[str, Any]]:
    return [json.loads(line) for line in proc.log().splitlines() if line.strip()]


def lines_of(proc: Proc, request_id: str) -> list[dict[str, Any]]:
    """The lines written while serving the request, once its access line (the last) is there."""

    def written() -> list[dict[str, Any]] | None:
        found = [line for line in json_lines(proc) if line.get("request_id") == request_id]
        return found if any(line["logger"] == "uvicorn.access" for line in found) else None

    return wait_until(written, what=f"the lines of {request_id}", logs=[proc])


def test_json_lines_of_a_request_carry_its_request_id_and_the_clients_trace_id(
    tmp_path: Path, nowhere: str
) -> None:
    key, _ = make_key("alice")
    with web(tmp_path, nowhere, LLMGW_LOG_FORMAT="json", LLMGW_ACCESS_LOG="true") as proc:
        traced = failed_request(proc, key, traceparent=TRACEPARENT)
        untraced = failed_request(proc, key)
        lines = lines_of(proc, traced)
        by_logger = {line["logger"]: line for line in lines}
        # The relay's warning names the request in its message; the upstream's ejection and
        # the access line do not, and carry its ids all the same.
        warning = by_logger["gateway.relay.attempts"]
        assert warning["message"].startswith(f"request {traced}: upstream static:dead unreachable")
        assert warning["level"] == "WARNING"
        assert by_logger["gateway.routing.upstreams"]["message"].startswith("upstream static:dead")
        assert '"POST /v1/chat/completions HTTP/1.1" 502' in by_logger["uvicorn.access"]["message"]
        for line in lines:
            assert line["trace_id"] == TRACE
            assert line["process"] == "web" and line["pid"] == proc.pid
        other = lines_of(proc, untraced)
        assert {line["logger"] for line in other} == set(by_logger)
        assert all("trace_id" not in line for line in other)
        # Every line of the process is one JSON object; those of no request name none.
        everything = json_lines(proc)
        started = [line for line in everything if "diagnostics: web answers" in line["message"]]
        assert started and "request_id" not in started[0]
        assert {line.get("request_id") for line in everything} == {None, traced, untraced}


def test_without_the_setting_the_lines_are_as_they_were(tmp_path: Path, nowhere: str) -> None:
    key, _ = make_key("alice")
    with web(tmp_path, nowhere) as proc:
        request_id = failed_request(proc, key, traceparent=TRACEPARENT)

        def warning() -> str | None:
            return next((line for line in proc.log().splitlines() if request_id in line), None)

        line = wait_until(warning, what="the relay's warning", logs=[proc])
        assert PLAIN.fullmatch(line), line
        assert f" WARNING gateway.relay.attempts [{proc.pid}] request {request_id}: " in line
        assert TRACE not in line and not line.startswith("{")
        assert all(not line.startswith("{") for line in proc.log().splitlines())
