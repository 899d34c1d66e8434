"""A stopping web process, as clients see it: requests and streams in flight finish, new
connections go to the other processes, and what outlives the grace is ended with an error a
client library reads and recorded as interrupted (S1, S2 in docs/scenarios.md)."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from gateway.models import UsageRecord
from tests.harness.factories import make_key, serve_model
from tests.harness.live import routes, start_sim, start_web
from tests.harness.procs import Proc, port_open
from tests.harness.waits import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

MODEL = "slow"


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Proc]:
    sim = start_sim(tmp_path / "engines", [MODEL])
    yield sim
    sim.stop()


async def stream_all(client: openai.AsyncOpenAI, tokens: int, itl_ms: int) -> dict[str, Any]:
    """One stream to the end: its events, and the error that ended it, if one did."""
    out: dict[str, Any] = {"events": 0, "error": None}
    try:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "go"}],
            max_tokens=tokens,
            stream=True,
            extra_body={"sim": {"itl_ms": itl_ms, "ttft_ms": 5}},
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                out["events"] += 1
    except openai.APIError as error:
        out["error"] = error
    return out


def test_sigterm_finishes_short_streams_and_cuts_long_ones_at_the_grace(
    tmp_path: Path, engine: Proc
) -> None:
    web = start_web(tmp_path / "var", LLMGW_SHUTDOWN_GRACE="2")
    key, api_key = make_key()
    serve_model(MODEL, [engine.port])
    wait_until(lambda: routes(web, key, MODEL), what="the model routed")
    client = openai.AsyncOpenAI(base_url=web.url + "/v1", api_key=key, max_retries=0)

    async def scenario() -> tuple[list[dict[str, Any]], list[dict[str, Any]], bool]:
        short = [asyncio.create_task(stream_all(client, 10, 50)) for _ in range(5)]
        long = [asyncio.create_task(stream_all(client, 300, 50)) for _ in range(3)]
        await asyncio.sleep(0.3)  # every stream under way
        web.signal(signal.SIGTERM)
        await asyncio.sleep(0.5)
        refused = not port_open(web.port)
        return await asyncio.gather(*short), await asyncio.gather(*long), refused

    short, long, refused = asyncio.run(scenario())
    assert web.wait(30) == 0, web.tail()
    assert refused, "the stopping process still accepted connections"
    assert all(s["error"] is None and s["events"] == 10 for s in short), short
    for cut in long:
        assert isinstance(cut["error"], openai.APIError), cut
        assert 0 < cut["events"] < 300
        assert cut["error"].code == "server_shutting_down"
    rows = UsageRecord.objects.filter(api_key=api_key)
    reasons = sorted(rows.values_list("finish_reason", flat=True))
    assert reasons.count(UsageRecord.FinishReason.INTERRUPTED) == 3, reasons
    assert len(reasons) == 8


def test_a_connection_whose_stream_began_before_the_stop_stays_usable_after_it(
    tmp_path: Path, engine: Proc
) -> None:
    """The stream's answer went out before the stop, without ``Connection: close``, so its
    client keeps the connection for its next request. Closing it when the stream ends races
    that request (a read error at the client); it stays open, and the next answer on it says
    ``Connection: close``."""
    import json
    import socket

    web = start_web(tmp_path / "var", LLMGW_SHUTDOWN_GRACE="20")
    key, _ = make_key()
    serve_model(MODEL, [engine.port])
    wait_until(lambda: routes(web, key, MODEL), what="the model routed")

    def request(stream: bool) -> bytes:
        body = json.dumps(
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "go"}],
                "max_tokens": 10,
                "stream": stream,
                "sim": {"itl_ms": 100, "ttft_ms": 5},
            }
        ).encode()
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        return head.encode() + body

    def read_until(sock: socket.socket, end: bytes, seen: bytes = b"") -> bytes:
        while end not in seen:
            data = sock.recv(65536)
            if not data:
                raise AssertionError(f"the server closed the connection; read so far: {seen!r}")
            seen += data
        return seen

    with socket.create_connection(("127.0.0.1", web.port), timeout=30) as sock:
        sock.sendall(request(stream=True))
        head = read_until(sock, b"data: ")
        assert head.startswith(b"HTTP/1.1 200") and b"connection: close" not in head.lower()
        web.signal(signal.SIGTERM)
        read_until(sock, b"0\r\n\r\n", head)  # the stream runs to its end
        sock.sendall(request(stream=False))  # as a pooled client does, right away
        answer = read_until(sock, b"\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 200"), answer
        assert b"connection: close" in answer.lower(), answer
    assert web.wait(30) == 0, web.tail()


async def test_healthz_says_draining_once_the_stop_began() -> None:
    """A balancer's probe that still reaches a stopping process (a connection accepted just
    before the stop) learns to move away; the process was healthy until then."""
    from gateway.relay.drain import drain
    from llmgw_site.asgi import application

    async def probe() -> tuple[int, bytes]:
        sent: list[dict[str, Any]] = []
        inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        inbox.put_nowait({"type": "http.request", "body": b"", "more_body": False})

        async def receive() -> dict[str, Any]:
            return await inbox.get()  # after the request: nothing, until the answer is out

        async def send(message: Any) -> None:
            sent.append(dict(message))

        scope = {
            "type": "http", "method": "GET", "path": "/healthz", "headers": [],
            "query_string": b"", "root_path": "", "scheme": "http", "http_version": "1.1",
            "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 5000),
        }  # fmt: skip
        await application(scope, receive, send)
        return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])

    assert (await probe())[0] == 200
    drain.begin()
    try:
        status, body = await probe()
    finally:
        drain.draining = False
    assert status == 503 and b"draining" in body
