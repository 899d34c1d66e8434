"""The relay under faults, end to end: a live llmgw web process in front of live ``sim`` engines
that fail, hang and disconnect on purpose (G6, G10, G11, G12, G13)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import openai
import pytest

from tests.harness.factories import make_key, serve_model
from tests.harness.live import (
    Stack,
    engine_requests,
    gateway_stack,
    http,
    set_sim_faults,
    sim_metrics,
    wait_for_rows,
)
from tests.harness.procs import Proc, free_port
from tests.harness.waits import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

LIMIT = 4 * 1024 * 1024
MODELS = ("m1", "m2", "m3", "m4", "m5", "m6", "m7", "ext-model")


def web_settings(engines: list[Proc]) -> dict[str, str]:
    return {
        # A router-only upstream, given at start: no catalog row, no replica.
        "LLMGW_STATIC_ENDPOINTS": f"ext={engines[1].url}/v1=ext-model",
        "LLMGW_MAX_BODY_BYTES": str(LIMIT),
        "LLMGW_RETRY_AFTER_MAX": "2",
        "LLMGW_EJECT_SECONDS": "30",
    }


@pytest.fixture(scope="module")
def live(django_db_setup: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with gateway_stack(tmp_path_factory.mktemp("relay-e2e"), MODELS, settings=web_settings) as live:
        yield live


@pytest.fixture
def stack(live: Stack) -> Iterator[tuple[Proc, Proc, Proc]]:
    """The module's processes; after each test its faults are cleared and its rows stored."""
    live.begin()
    yield live.web, live.engines[0], live.engines[1]
    for sim in live.engines:
        http("DELETE", sim.url + "/sim/faults")
    live.settle()


def client(web: Proc, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=web.url + "/v1", api_key=key, max_retries=0, timeout=60)


def ready(web: Proc, key: str, name: str, ports: list[int], **fields: Any) -> Any:
    """Serve ``name``; first wait until the web process has dropped the earlier tests' (deleted)
    rows for it, so that a stale table entry cannot pass for the new one."""

    def listed() -> list[str]:
        return [m.id for m in client(web, key).models.list().data]

    wait_until(lambda: name not in listed())
    served = serve_model(name, ports, **fields)
    wait_until(lambda: name in listed())
    return served


def chat(name: str, **extra: Any) -> bytes:
    return json.dumps(
        {"model": name, "messages": [{"role": "user", "content": "hello"}], **extra}
    ).encode()


def chat_request(key: str, body: bytes) -> bytes:
    """A whole chat completion request as a client writes it on a socket."""
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer " + key.encode() + b"\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    )
    return head + body


def arrived(sim: Proc) -> float:
    """Requests that reached the engine, finished or not."""
    return engine_requests(sim, running=True)


def raw_exchange(port: int, head: bytes, body_parts: list[bytes], pause: float = 0.0) -> bytes:
    """Send a request by hand; return whatever the server answered before closing."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(head)
        try:
            for part in body_parts:
                sock.sendall(part)
                if pause:
                    time.sleep(pause)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused mid-upload: exactly what should happen
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except (ConnectionResetError, TimeoutError):
            pass
    return received


# --- G6 -------------------------------------------------------------------------------------


def test_a_declared_oversized_body_is_refused_before_it_is_sent(stack: Any) -> None:
    web, _, _ = stack
    key, _ = make_key()
    for _ in range(5):
        head = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + key.encode() + b"\r\n"
            b"Content-Length: 200000000\r\n\r\n"
        )
        answer = raw_exchange(web.port, head, [])  # not one byte of the body is sent
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        assert b'"code":"request_too_large"' in answer
    assert web.running()


def test_a_chunked_upload_is_cut_off_once_it_passes_the_limit(stack: Any) -> None:
    web, _, _ = stack
    key, _ = make_key()
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer " + key.encode() + b"\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    piece = b"x" * (512 * 1024)
    chunk = b"%x\r\n%s\r\n" % (len(piece), piece)
    parts = [chunk] * 40 + [b"0\r\n\r\n"]  # 20 MiB offered against a 4 MiB limit
    answer = raw_exchange(web.port, head, parts, pause=0.01)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]


def test_deep_nesting_and_huge_message_lists_are_400_naming_the_problem(stack: Any) -> None:
    web, sim_a, _ = stack
    key, _ = make_key()
    ready(web, key, "m1", [sim_a.port])
    nested = b'{"model":"m1","messages":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    status, _, raw = http("POST", web.url + "/v1/chat/completions", key=key, body=nested)
    assert status == 400 and json.loads(raw)["error"]["code"] == "invalid_json"
    many = chat("m1").replace(
        b'[{"role": "user", "content": "hello"}]',
        json.dumps([{"role": "user", "content": "x"}] * 100_000).encode(),
    )
    assert len(many) < LIMIT
    status, _, raw = http("POST", web.url + "/v1/chat/completions", key=key, body=many)
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == "messages"


# --- G10 ------------------------------------------------------------------------------------


def test_an_upstream_5xx_before_the_first_byte_is_retried_elsewhere_and_ejected(
    stack: Any,
) -> None:
    web, sim_a, sim_b = stack
    key, api_key = make_key()
    ready(web, key, "m2", [sim_a.port, sim_b.port])
    set_sim_faults(sim_a, fail=503)
    failed_before = sim_metrics(sim_a).get("sim:request_failed_total", 0)
    for _ in range(6):
        reply = client(web, key).chat.completions.create(
            model="m2", messages=[{"role": "user", "content": "x"}], max_tokens=1
        )
        assert reply.choices[0].message.content == "tok1"
    # Ejected after its first failure: sim_a saw one request, not three.
    assert sim_metrics(sim_a).get("sim:request_failed_total", 0) - failed_before == 1
    rows = wait_for_rows(api_key, 6)
    assert {r.status for r in rows} == {200}
    assert len(rows) == 6


def test_a_refused_connection_is_retried_on_another_replica(stack: Any) -> None:
    web, _, sim_b = stack
    key, _ = make_key()
    dead = free_port()  # nothing listens there
    ready(web, key, "m3", [dead, sim_b.port])
    for _ in range(4):
        client(web, key).chat.completions.create(
            model="m3", messages=[{"role": "user", "content": "x"}], max_tokens=1
        )


class _Redirecting(BaseHTTPRequestHandler):
    """An upstream that sends every request on to ``target`` with a 307."""

    target = ""

    def do_POST(self) -> None:
        self.send_response(307)
        self.send_header("Location", self.target + self.path)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_an_upstream_redirect_is_not_followed(stack: Any) -> None:
    web, _, sim_b = stack
    key, _ = make_key()
    handler = type("ToSim", (_Redirecting,), {"target": sim_b.url})
    with ThreadingHTTPServer(("127.0.0.1", 0), handler) as redirecting:
        threading.Thread(target=redirecting.serve_forever, daemon=True).start()
        try:
            ready(web, key, "m4", [redirecting.server_address[1]])
            before = sim_metrics(sim_b)["vllm:request_success_total"]
            status, _, raw = http(
                "POST", web.url + "/v1/chat/completions", key=key, body=chat("m4", max_tokens=1)
            )
        finally:
            redirecting.shutdown()
    assert status == 502 and json.loads(raw)["error"]["code"] == "upstream_redirect"
    assert sim_metrics(sim_b)["vllm:request_success_total"] == before


def test_upstream_retry_after_is_waited_out_when_short_and_passed_on_when_long(
    stack: Any,
) -> None:
    web, sim_a, _ = stack
    key, _ = make_key()
    ready(web, key, "m4", [sim_a.port])
    set_sim_faults(sim_a, times=1, fail=429, retry_after=1)
    started = time.monotonic()
    status, _, _ = http(
        "POST", web.url + "/v1/chat/completions", key=key, body=chat("m4", max_tokens=1)
    )
    assert status == 200
    assert time.monotonic() - started >= 1.0
    set_sim_faults(sim_a, times=1, fail=429, retry_after=30)
    status, headers, raw = http(
        "POST", web.url + "/v1/chat/completions", key=key, body=chat("m4", max_tokens=1)
    )
    assert status == 429
    assert headers["Retry-After"] == "30"
    assert json.loads(raw)["error"]["type"] == "rate_limit_error"


def test_retries_are_bounded_and_end_in_one_clear_error(stack: Any) -> None:
    web, sim_a, sim_b = stack
    key, api_key = make_key()
    ready(web, key, "m5", [sim_a.port, sim_b.port])
    set_sim_faults(sim_a, fail=502)
    set_sim_faults(sim_b, fail=502)
    before = sum(sim_metrics(s).get("sim:request_failed_total", 0) for s in (sim_a, sim_b))
    with pytest.raises(openai.InternalServerError) as failure:
        client(web, key).chat.completions.create(
            model="m5", messages=[{"role": "user", "content": "x"}]
        )
    assert failure.value.status_code == 502
    after = sum(sim_metrics(s).get("sim:request_failed_total", 0) for s in (sim_a, sim_b))
    assert after - before == 3  # one try and LLMGW_RETRIES (2) more, never more
    (row,) = wait_for_rows(api_key, 1)
    assert row.status == 502 and row.finish_reason == "upstream_error"


# --- G11, G12, G13 --------------------------------------------------------------------------


def test_a_failure_after_the_first_byte_ends_the_stream_with_an_error_event(stack: Any) -> None:
    web, sim_a, _ = stack
    key, api_key = make_key()
    ready(web, key, "m1", [sim_a.port])
    seen: list[str] = []
    with pytest.raises(openai.APIError) as failure:
        for chunk in client(web, key).chat.completions.create(
            model="m1",
            messages=[{"role": "user", "content": "x"}],
            max_tokens=10,
            stream=True,
            extra_body={"sim": {"fail_after_tokens": 3}},
        ):
            if chunk.choices and chunk.choices[0].delta.content:
                seen.append(chunk.choices[0].delta.content)
    assert "mid-stream" in str(failure.value)
    assert seen == ["tok1", " tok2", " tok3"]
    (row,) = wait_for_rows(api_key, 1)
    assert row.finish_reason == "upstream_error"
    assert row.completion_tokens == 3  # partial usage: the tokens that were relayed


def test_a_client_that_hangs_up_mid_stream_cancels_the_engine_request(stack: Any) -> None:
    web, sim_a, _ = stack
    key, api_key = make_key()
    ready(web, key, "m6", [sim_a.port])
    cancelled_before = sim_metrics(sim_a).get("sim:request_cancelled_total", 0)
    body = chat("m6", max_tokens=200, stream=True, sim={"itl_ms": 20})
    with socket.create_connection(("127.0.0.1", web.port), timeout=60) as sock:
        sock.sendall(chat_request(key, body))
        received = b""
        while received.count(b"data: ") < 5:
            received += sock.recv(65536)
    # The socket is closed: the engine must stop generating within a moment.
    wait_until(
        lambda: sim_metrics(sim_a).get("sim:request_cancelled_total", 0) == cancelled_before + 1,
        what="the engine request cancelled",
    )
    assert sim_metrics(sim_a)["vllm:num_requests_running"] == 0
    (row,) = wait_for_rows(api_key, 1)
    assert row.finish_reason == "client_disconnect"
    assert 3 <= row.completion_tokens < 200


def test_a_client_gone_before_the_gateway_listens_for_it_leaves_no_engine_request(
    stack: Any,
) -> None:
    """The gateway starts listening for a hang-up only once a request has run a moment
    (gateway.edge.asgi.LISTEN_AFTER_S); a client that left before that is found then, at once: an
    engine request that was sent is cancelled, and the row says the client left."""
    web, sim_a, _ = stack
    key, api_key = make_key()
    ready(web, key, "m7", [sim_a.port])
    arrived_before = arrived(sim_a)
    cancelled_before = sim_metrics(sim_a).get("sim:request_cancelled_total", 0)
    with socket.create_connection(("127.0.0.1", web.port), timeout=60) as sock:
        sock.sendall(chat_request(key, chat("m7", sim={"hang": "before_first_byte"})))
        time.sleep(0.01)  # long enough to reach the engine, most times; the outcome is the same
    (row,) = wait_for_rows(api_key, 1)
    assert (row.status, row.finish_reason) == (499, "client_disconnect")
    reached = arrived(sim_a) - arrived_before
    wait_until(
        lambda: (
            sim_metrics(sim_a).get("sim:request_cancelled_total", 0) - cancelled_before == reached
        ),
        what="every engine request it reached cancelled",
    )
    assert sim_metrics(sim_a)["vllm:num_requests_running"] == 0


def test_an_upstream_that_never_answers_is_a_504_at_the_first_byte_deadline(stack: Any) -> None:
    web, sim_a, sim_b = stack
    key, api_key = make_key()
    ready(web, key, "m2", [sim_a.port, sim_b.port], first_byte_timeout_s=0.5)
    before = arrived(sim_a) + arrived(sim_b)
    started = time.monotonic()
    status, _, raw = http(
        "POST",
        web.url + "/v1/chat/completions",
        key=key,
        body=chat("m2", sim={"hang": "before_first_byte"}),
    )
    elapsed = time.monotonic() - started
    assert status == 504 and json.loads(raw)["error"]["code"] == "upstream_timeout"
    assert elapsed >= 0.5  # the deadline was waited out
    # Not retried elsewhere: a hung engine may still be working on it.
    assert arrived(sim_a) + arrived(sim_b) == before + 1
    (row,) = wait_for_rows(api_key, 1)
    assert row.finish_reason == "timeout"


def test_an_upstream_that_stalls_mid_stream_gets_an_error_event_at_the_idle_deadline(
    stack: Any,
) -> None:
    web, sim_a, _ = stack
    key, api_key = make_key()
    ready(web, key, "m3", [sim_a.port], stream_idle_timeout_s=0.5)
    status, _, raw = http(
        "POST",
        web.url + "/v1/chat/completions",
        key=key,
        body=chat("m3", stream=True, sim={"hang": "mid_stream"}),
    )
    assert status == 200
    events = [line for line in raw.decode().splitlines() if line.startswith("data: ")]
    assert json.loads(events[-1][6:])["error"]["code"] == "upstream_timeout"
    assert "[DONE]" not in raw.decode()
    (row,) = wait_for_rows(api_key, 1)
    assert row.finish_reason == "timeout"


def test_a_static_endpoint_given_at_start_serves_its_model(stack: Any) -> None:
    web, _, sim_b = stack
    key, api_key = make_key()
    assert "ext-model" in [m.id for m in client(web, key).models.list().data]
    before = sim_metrics(sim_b)["vllm:request_success_total"]
    reply = client(web, key).chat.completions.create(
        model="ext-model", messages=[{"role": "user", "content": "x"}], max_tokens=2
    )
    assert reply.choices[0].message.content == "tok1 tok2"
    assert sim_metrics(sim_b)["vllm:request_success_total"] == before + 1
    (row,) = wait_for_rows(api_key, 1)
    assert row.upstream == "static:ext" and row.completion_tokens == 2
