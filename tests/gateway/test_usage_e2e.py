"""Usage rows when web processes die (U1, U2): real daphne processes, killed for real."""

from __future__ import annotations

import json
import signal
import socket
from pathlib import Path

import pytest
from django.core.management import call_command

from gateway.models import UsageRecord
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


def test_kill_9_during_100_streams_leaves_one_row_per_engine_request(tmp_path: Path) -> None:
    """U1: the journal survives the process; the sweeper closes what was in flight."""
    sim = start_sim(tmp_path, ["u"])
    web = start_web(tmp_path / "var")
    sockets: list[socket.socket] = []
    try:
        key, api_key = make_key()
        serve_model("u", [sim.port])
        wait_until(lambda: routes(web, key, "u"), what="the web process routes u")
        before = engine_requests(sim)
        sockets = open_streams(web, key, 100)
        wait_until(
            lambda: sim_metrics(sim)["vllm:num_requests_running"] == 100, what="100 streams running"
        )
        web.signal(signal.SIGKILL)
        web.wait()
        wait_until(lambda: sim_metrics(sim)["vllm:num_requests_running"] == 0, what="engines idle")
        reached = engine_requests(sim) - before
        assert reached == 100
        assert usage_rows(api_key) == []  # nothing was written before the kill
        # What `manage.py run` does before starting web processes (a web process also sweeps
        # by itself, in the background, once it serves its first request).
        call_command("replay_usage", dir=tmp_path / "var" / "usage")
        rows = usage_rows(api_key)
        assert len(rows) == reached == len({r.request_id for r in rows})
        assert {r.finish_reason for r in rows} == {UsageRecord.FinishReason.INTERRUPTED}
        assert all(r.model == "u" and r.stream for r in rows)
        # A second sweep, and a restarted web process, add nothing.
        call_command("replay_usage", dir=tmp_path / "var" / "usage")
        restarted = start_web(tmp_path / "var")
        http("GET", restarted.url + "/v1/models", key=key)
        stop_checked(restarted)
        assert len(usage_rows(api_key)) == 100
        assert not list((tmp_path / "var" / "usage").glob("*.journal"))
    finally:
        for sock in sockets:
            sock.close()
        stop_checked(web)
        sim.stop()


def test_sigterm_under_load_writes_a_row_for_every_request(tmp_path: Path) -> None:
    """U2: rows = requests, without any sweep."""
    sim = start_sim(tmp_path, ["u"])
    web = start_web(tmp_path / "var")
    sockets: list[socket.socket] = []
    try:
        key, api_key = make_key()
        serve_model("u", [sim.port])
        wait_until(lambda: routes(web, key, "u"), what="the web process routes u")
        for _ in range(10):  # some finished requests too
            status, _, _ = http(
                "POST",
                web.url + "/v1/chat/completions",
                key=key,
                body=b'{"model":"u","max_tokens":1,"messages":[{"role":"user","content":"x"}]}',
            )
            assert status == 200
        sockets = open_streams(web, key, 50)
        wait_until(
            lambda: sim_metrics(sim)["vllm:num_requests_running"] == 50, what="50 streams running"
        )
        web.signal(signal.SIGTERM)
        assert web.wait() is not None
        rows = usage_rows(api_key)
        assert len(rows) == 60 == len({r.request_id for r in rows})
        in_flight = [r for r in rows if r.stream]
        assert len(in_flight) == 50
        assert {r.finish_reason for r in in_flight} <= {
            UsageRecord.FinishReason.INTERRUPTED,
            UsageRecord.FinishReason.CLIENT_DISCONNECT,
        }
        assert not list((tmp_path / "var" / "usage").glob("*.journal"))
    finally:
        for sock in sockets:
            sock.close()
        stop_checked(web)
        sim.stop()
