"""Usage rows when web processes die (U1, U2): real web processes, killed for real."""

from __future__ import annotations

import json
import signal
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from django.core.management import call_command

from gateway.models import ApiKey, UsageRecord
from tests.harness.factories import make_key, serve_model, usage_rows
from tests.harness.live import (
    engine_requests,
    http,
    routes,
    sim_metrics,
    start_sim,
    start_web,
    stop_checked,
)
from tests.harness.procs import Proc
from tests.harness.waits import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def open_streams(web: Proc, key: str, count: int, tokens: int = 5000) -> list[socket.socket]:
    """Start ``count`` slow streams (20 ms between tokens, so each takes minutes) and leave
    them running: however slowly the machine opens them, none ends before the test acts."""
    body = json.dumps(
        {
            "model": "u",
            "messages": [{"role": "user", "content": "go"}],
            "max_tokens": tokens,
            "stream": True,
            "sim": {"itl_ms": 20},
        }
    ).encode()
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer " + key.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body)
    )
    sockets = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", web.port), timeout=60)
        sock.sendall(head + body)
        sockets.append(sock)
    return sockets


@dataclass
class Serving:
    """One engine serving model ``u`` behind one web process, and a key for it."""

    sim: Proc
    web: Proc
    var: Path
    key: str
    api_key: ApiKey
    sockets: list[socket.socket] = field(default_factory=list)

    def wait_streams(self, count: int) -> None:
        wait_until(
            lambda: sim_metrics(self.sim)["vllm:num_requests_running"] == count,
            what=f"{count} streams running",
        )


@pytest.fixture
def serving(tmp_path: Path) -> Iterator[Serving]:
    sim = start_sim(tmp_path, ["u"])
    # A stop lets streams run for the grace, then cuts them: one second here, so a SIGTERM
    # under 100-second streams ends them (as interrupted) while the test waits.
    web = start_web(tmp_path / "var", LLMGW_SHUTDOWN_GRACE="1")
    key, api_key = make_key()
    it = Serving(sim, web, tmp_path / "var", key, api_key)
    try:
        serve_model("u", [sim.port])
        wait_until(lambda: routes(web, key, "u"), what="the web process routes u")
        yield it
    finally:
        for sock in it.sockets:
            sock.close()
        stop_checked(web)
        sim.stop()


def test_kill_9_during_100_streams_leaves_one_row_per_engine_request(serving: Serving) -> None:
    """U1: the journal survives the process; the sweeper closes what was in flight."""
    sim, web, key, api_key = serving.sim, serving.web, serving.key, serving.api_key
    before = engine_requests(sim)
    serving.sockets += open_streams(web, key, 100)
    serving.wait_streams(100)
    web.signal(signal.SIGKILL)
    web.wait()
    serving.wait_streams(0)
    reached = engine_requests(sim) - before
    assert reached == 100
    assert usage_rows(api_key) == []  # nothing was written before the kill
    # What `manage.py run` does before starting web processes (a web process also sweeps by
    # itself, in the background, once it serves its first request).
    call_command("replay_usage", dir=serving.var / "usage")
    rows = usage_rows(api_key)
    assert len(rows) == reached == len({r.request_id for r in rows})
    assert {r.finish_reason for r in rows} == {UsageRecord.FinishReason.INTERRUPTED}
    assert all(r.model == "u" and r.stream for r in rows)
    # A second sweep, and a restarted web process, add nothing.
    call_command("replay_usage", dir=serving.var / "usage")
    restarted = start_web(serving.var)
    http("GET", restarted.url + "/v1/models", key=key)
    stop_checked(restarted)
    assert len(usage_rows(api_key)) == 100
    assert not list((serving.var / "usage").glob("*.journal"))


def test_sigterm_under_load_writes_a_row_for_every_request(serving: Serving) -> None:
    """U2: rows = requests, without any sweep."""
    web, key, api_key = serving.web, serving.key, serving.api_key
    for _ in range(10):  # some finished requests too
        status, _, _ = http(
            "POST",
            web.url + "/v1/chat/completions",
            key=key,
            body=b'{"model":"u","max_tokens":1,"messages":[{"role":"user","content":"x"}]}',
        )
        assert status == 200
    serving.sockets += open_streams(web, key, 50)
    serving.wait_streams(50)
    web.signal(signal.SIGTERM)
    assert web.wait() is not None
    rows = usage_rows(api_key)
    assert len(rows) == 60 == len({r.request_id for r in rows})
    in_flight = [r for r in rows if r.stream]
    assert len(in_flight) == 50
    # Their clients were still reading: the grace ran out, so each was cut and says so.
    assert {r.finish_reason for r in in_flight} == {UsageRecord.FinishReason.INTERRUPTED}
    assert not list((serving.var / "usage").glob("*.journal"))
