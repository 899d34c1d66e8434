"""How often one node may open a stream, counted across every transport and web process, in
both stores: the database (the embedded default) and Redis (``REDIS_URL`` set).

A node that reconnects in a loop got a fresh message allowance with each stream, and each
hello cost the store a registration and a full desired state; now its streams are counted per
node where every process sees them, and past the limit a stream is closed with 4429 before it
costs anything else or takes over the node's open stream."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
from channels.db import database_sync_to_async
from channels.routing import URLRouter
from channels.testing import WebsocketCommunicator
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from agents import grpc_wire
from agents.agent_pb2 import AgentFrame
from agents.protocol.codec import decode_server_message, encode
from agents.protocol.messages import Heartbeat, Hello
from agents.protocol.vocabulary import NODE_HEADER, STREAM_PATH, CloseCode
from control import agent_grpc, stream_limits
from control.models import Node, StreamCounter
from control.node_tokens import NodeIdentity
from control.routing import websocket_urlpatterns
from tests.harness.factories import issue_node
from tests.harness.live import start_web, stop_checked
from tests.harness.procs import Proc, free_port
from tests.harness.redis import RedisServer
from tests.harness.store import settle_own_transactions

pytestmark = pytest.mark.django_db(transaction=True)

APP = URLRouter(websocket_urlpatterns)
CONNECT_TIMEOUT = 30  # the handshake does store work; a loaded machine is slow at it
LIMIT = 3
# An hour: a window that turns while a test runs would hand out a fresh allowance in the
# middle of it; a test that sees its window turn runs again (see `in_one_window`).
WINDOW = 3600.0


def window_index() -> int:
    return int(time.time() // WINDOW)


def in_one_window(scenario: Any, *names: str) -> Any:
    """Run ``scenario`` with fresh node names until one run falls inside one window (the first,
    nearly always): a count that spans two windows is right to admit more."""
    for attempt in range(3):
        started = window_index()
        result = scenario(*(f"{name}-{attempt}" for name in names))
        if window_index() == started:
            return result
    raise AssertionError("three windows turned during three runs")


@pytest.fixture(params=["store", "redis"])
def counts_in(request: pytest.FixtureRequest, settings: Any) -> Iterator[str]:
    """Each test once on the database, once on a private Redis (emptied first)."""
    settings.LLMGW_AGENT_HELLO_LIMIT = LIMIT
    settings.LLMGW_AGENT_HELLO_WINDOW = WINDOW
    if request.param == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        settings.REDIS_URL = server.url
        redis.Redis.from_url(server.url).flushall()
    else:
        settings.REDIS_URL = ""
    yield request.param


# --------------------------------------------------------------------------- the count

N1, N2 = NodeIdentity(1, "n1"), NodeIdentity(2, "n2")
START = WINDOW * 500_000  # the first second of a window


def another_process() -> None:
    """What a second web process would have of its own: its Redis connections, its purge
    timer. Everything else it shares through the store or Redis."""
    stream_limits._clients.clear()
    stream_limits._next_purge = 0.0


def test_streams_are_counted_per_node_across_processes_until_the_window_turns(
    counts_in: str,
) -> None:
    for second in range(LIMIT):
        another_process()
        assert stream_limits.admit(N1, now=START + second) is None
    another_process()
    refusal = stream_limits.admit(N1, now=START + 100)
    assert refusal == stream_limits.Refusal("n1", LIMIT, WINDOW, WINDOW - 100)
    assert refusal.message == "more than 3 streams of node 'n1' within 3600s; reconnect in 3500s"
    # Retries are refused too, and never move the window's end.
    assert stream_limits.admit(N1, now=START + 200) == replace(refusal, retry_after=WINDOW - 200)
    assert stream_limits.admit(N2, now=START + 200) is None  # another node: a count of its own
    # The next window lets it in again, LIMIT times.
    for second in range(LIMIT):
        assert stream_limits.admit(N1, now=START + WINDOW + second) is None
    assert stream_limits.admit(N1, now=START + WINDOW + LIMIT) is not None


def test_a_node_past_its_limit_is_logged_once_per_window(
    counts_in: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="control.stream_limits"):
        for second in range(LIMIT + 5):
            stream_limits.admit(N1, now=START + second)
    assert [r.getMessage() for r in caplog.records] == [
        "node n1: 4 streams opened within 3600s, more than 3; refusing its streams for 3597s"
    ]


def test_with_redis_unreachable_the_store_counts(
    settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis is down (a closed port): streams are still counted, in the store, and a looping
    node is still refused; the fallback is logged."""
    settings.LLMGW_AGENT_HELLO_LIMIT = LIMIT
    settings.LLMGW_AGENT_HELLO_WINDOW = WINDOW
    settings.REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"
    another_process()
    for second in range(LIMIT):
        assert stream_limits.admit(N1, now=START + second) is None
    assert stream_limits.admit(N1, now=START + LIMIT) is not None
    assert StreamCounter.objects.get(name=f"streams:1:{int(START // WINDOW)}").used == LIMIT + 1
    assert "counting in the store meanwhile" in caplog.text
    another_process()


def test_the_counts_of_ended_windows_are_deleted(settings: Any) -> None:
    settings.LLMGW_AGENT_HELLO_WINDOW = WINDOW
    settings.REDIS_URL = ""
    another_process()
    stream_limits.admit(N1, now=START)
    stream_limits.admit(N2, now=START)
    assert StreamCounter.objects.count() == 2
    another_process()  # its purge is due
    stream_limits.admit(N1, now=START + WINDOW)
    assert list(StreamCounter.objects.values_list("name", "used")) == [
        (f"streams:1:{int(START // WINDOW) + 1}", 1)
    ]


# --------------------------------------------------------------------------- the two transports


async def by_websocket(name: str, token: str) -> tuple[WebsocketCommunicator, int | str]:
    """Open a stream of ``name`` through the Channels consumer and say hello: the open stream
    and "welcome", or the close code it was refused with."""
    comm = WebsocketCommunicator(
        APP,
        STREAM_PATH,
        headers=[
            (b"authorization", f"Bearer {token}".encode()),
            (NODE_HEADER.lower().encode(), name.encode()),
        ],
    )
    connected, code = await comm.connect(timeout=CONNECT_TIMEOUT)
    if not connected:
        return comm, int(code or 0)
    await comm.send_to(text_data=encode(Hello(node=name, boot_id="b", agent_version="t")))
    first = json.loads(await comm.receive_from(timeout=CONNECT_TIMEOUT))
    if first["type"] == "welcome":
        return comm, "welcome"
    close = await comm.receive_output(timeout=CONNECT_TIMEOUT)
    assert close["type"] == "websocket.close" and close["code"] == first["code"]
    return comm, int(first["code"])


@pytest.fixture
async def listener(tmp_path: Path) -> AsyncIterator[int]:
    """The gRPC servicer on a loopback port of this test's event loop (plaintext, tokens)."""
    server, _, port, tls = agent_grpc.build_server(
        "127.0.0.1:0", ca_dir=tmp_path / "no-ca", require_identity=False
    )
    assert not tls
    await server.start()
    try:
        yield port
    finally:
        await server.stop(None)
        # The last streams' ends, written before the flush truncates every table.
        await asyncio.to_thread(settle_own_transactions)


async def by_grpc(port: int, name: str, token: str) -> int | str:
    """Open a stream of ``name`` on the gRPC listener and say hello: "welcome", or the close
    code it was refused with (the error frame's, which the trailing metadata repeats)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.stream_stream(
            grpc_wire.METHOD,
            request_serializer=grpc_wire.serialize,
            response_deserializer=grpc_wire.parse_server_frame,
        )(
            metadata=(("authorization", f"Bearer {token}"), (grpc_wire.NODE_KEY, name)),
            timeout=120,
        )
        await call.write(
            grpc_wire.to_frame(Hello(node=name, boot_id="b", agent_version="t"), AgentFrame)
        )
        first = json.loads(grpc_wire.frame_to_text(await call.read()))
        if first["type"] == "welcome":
            call.cancel()
            return "welcome"
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await call.read()
        assert ended.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        trailing = dict(ended.value.trailing_metadata() or ())
        assert trailing[grpc_wire.CLOSE_CODE_KEY] == str(first["code"])
        return int(first["code"])


async def test_a_node_reconnecting_in_a_loop_is_refused_past_its_limit_on_every_transport(
    counts_in: str, listener: int
) -> None:
    """A node opens streams in a row, by WebSocket and by gRPC in turn, over one store: the
    first LIMIT are served, every one after is refused with 4429 on both transports, and the
    refused ones do not take over the stream it holds; another node is served meanwhile."""

    async def scenario(name: str, other: str) -> None:
        _, token = await database_sync_to_async(issue_node)(name)
        _, other_token = await database_sync_to_async(issue_node)(other)
        held, outcome = await by_websocket(name, token)
        assert outcome == "welcome"
        await held.receive_from(timeout=CONNECT_TIMEOUT)  # its desired state
        assert await by_grpc(listener, name, token) == "welcome"
        # (the gRPC stream took over from the WebSocket one: its close is drained below)
        comm, outcome = await by_websocket(name, token)
        assert outcome == "welcome"
        await comm.receive_from(timeout=CONNECT_TIMEOUT)
        refused = []
        for _ in range(2):
            extra, outcome = await by_websocket(name, token)
            await extra.disconnect()
            refused.append(outcome)
            refused.append(await by_grpc(listener, name, token))
        assert refused == [CloseCode.RATE_LIMITED] * 4
        # The stream it holds was not replaced by the refused ones: it still reports.
        await comm.send_to(text_data=encode(Heartbeat(seq=1)))
        assert await comm.receive_nothing(timeout=0.5)
        await comm.disconnect()
        # Another node is not held to this one's count, on either transport.
        other_comm, outcome = await by_websocket(other, other_token)
        assert outcome == "welcome"
        await other_comm.disconnect()
        assert await by_grpc(listener, other, other_token) == "welcome"
        await held.disconnect()

    for attempt in range(3):
        started = window_index()
        await scenario(f"loop-{attempt}", f"calm-{attempt}")
        if window_index() == started:
            return
    raise AssertionError("three windows turned during three runs")


async def test_the_refusal_says_why_and_when_to_come_back(counts_in: str) -> None:
    _, token = await database_sync_to_async(issue_node)("n1")
    for _ in range(LIMIT):
        comm, outcome = await by_websocket("n1", token)
        assert outcome == "welcome"
        await comm.disconnect()
    comm = WebsocketCommunicator(
        APP,
        STREAM_PATH,
        headers=[
            (b"authorization", f"Bearer {token}".encode()),
            (NODE_HEADER.lower().encode(), b"n1"),
        ],
    )
    assert (await comm.connect(timeout=CONNECT_TIMEOUT))[0]
    await comm.send_to(text_data=encode(Hello(node="n1", boot_id="refused", agent_version="t")))
    error = decode_server_message(await comm.receive_from(timeout=CONNECT_TIMEOUT))
    assert error.TYPE == "error" and error.code == CloseCode.RATE_LIMITED  # type: ignore[union-attr]
    assert f"more than {LIMIT} streams of node 'n1' within 3600s" in error.message  # type: ignore[union-attr]
    assert "reconnect in" in error.message  # type: ignore[union-attr]
    # Refused before its hello was read: the refused stream's hello reached nothing.
    assert (await Node.objects.aget(name="n1")).boot_id == "b"


# --------------------------------------------------------------------------- two web processes


def ws_hello(port: int, name: str, token: str) -> int | str:
    """A real WebSocket client's stream of ``name`` to a web process: "welcome", or the close
    code it was refused with."""
    headers = {NODE_HEADER: name, "Authorization": f"Bearer {token}"}
    with connect(
        f"ws://127.0.0.1:{port}{STREAM_PATH}", additional_headers=headers, open_timeout=60
    ) as ws:
        try:
            ws.send(encode(Hello(node=name, boot_id="b", agent_version="t")))
            first = json.loads(ws.recv(timeout=60))
        except ConnectionClosed:
            assert ws.close_code is not None
            return int(ws.close_code)
        if first["type"] == "welcome":
            return "welcome"
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=60)
        assert ws.close_code == first["code"]
        return int(first["code"])


@pytest.mark.e2e
@pytest.mark.parametrize("with_redis", [False, True], ids=["store", "redis"])
def test_a_node_reconnecting_through_two_web_processes_is_refused_past_its_limit_on_both(
    with_redis: bool, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Two real web processes share the count, in the store or in Redis: a node that opens
    stream after stream, through one then the other, is served LIMIT times in all and refused
    by both after that; another node is served by both."""
    redis_url = ""
    if with_redis:
        server: RedisServer = request.getfixturevalue("redis_server")
        redis_url = server.url
        redis.Redis.from_url(redis_url).flushall()
    settings = {
        "LLMGW_AGENT_HELLO_LIMIT": str(LIMIT),
        "LLMGW_AGENT_HELLO_WINDOW": str(int(WINDOW)),
        "REDIS_URL": redis_url,
    }
    webs: list[Proc] = []
    try:
        webs = [start_web(tmp_path / f"web{i}", **settings) for i in (1, 2)]
        ports = [web.port for web in webs]

        def scenario(name: str, other: str) -> tuple[list[int | str], list[int | str]]:
            _, token = issue_node(name)
            _, other_token = issue_node(other)
            looping = [ws_hello(ports[i % 2], name, token) for i in range(LIMIT + 2)]
            calm = [ws_hello(port, other, other_token) for port in ports]
            return looping, calm

        looping, calm = in_one_window(scenario, "loop", "calm")
        assert looping == ["welcome"] * LIMIT + [CloseCode.RATE_LIMITED] * 2
        assert calm == ["welcome", "welcome"]
        for web in webs:
            assert "Traceback" not in web.log()
        assert any("refusing" in web.log() for web in webs)  # the refusal's log line
    finally:
        stop_checked(*webs)
