"""The relay's HTTP/1.1 client (``gateway.relay.upstream_client``) against real sockets: small
asyncio servers on loopback that answer the way engines do, and the ways they fail."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import pytest

from gateway.addresses import AddressPolicy, address_problem
from gateway.relay.upstream_client import (
    HIGH_WATER,
    Broken,
    Dropped,
    Forbidden,
    Pool,
    Unreachable,
)
from gateway.relay.upstream_client import Response as UpstreamResponse
from gateway.routing import table
from tests.harness.procs import free_port

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, "Upstream"], Awaitable[None]]


@dataclass
class Upstream:
    """A scripted server: ``handler`` runs once per connection."""

    handler: Handler
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer, self)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def read_request(self, reader: asyncio.StreamReader) -> bytes:
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        request = head + await reader.readexactly(length)
        self.requests.append(request)
        return request


@contextlib.asynccontextmanager
async def upstream(handler: Handler) -> AsyncIterator[Upstream]:
    scripted = Upstream(handler)
    server = await asyncio.start_server(scripted.serve, "127.0.0.1", 0)
    scripted.port = server.sockets[0].getsockname()[1]
    async with server:
        yield scripted


def answer(body: bytes, *extra: bytes) -> bytes:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n" % len(
        body
    )
    return head + b"".join(extra) + b"\r\n" + body


def answering(raw: bytes, *, then_wait_for_eof: bool = False) -> Handler:
    """An upstream that answers every request on a connection with ``raw``."""

    async def engine(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, up: Upstream
    ) -> None:
        while True:
            await up.read_request(reader)
            writer.write(raw)
            await writer.drain()
            if then_wait_for_eof:
                await reader.read()
                return

    return engine


@pytest.fixture
def pool() -> Iterator[Pool]:
    connections = Pool(keepalive_s=30)
    yield connections
    connections.close()


def to(url: str, policy: AddressPolicy = AddressPolicy.ANY) -> table.Upstream:
    """An upstream at ``url``, as the routing table hands one to the client."""
    return table.Upstream(f"upstream:{url}", url, addresses=policy)


async def post(pool: Pool, url: str, body: bytes = b'{"x":1}') -> tuple[int, bytes]:
    response = await pool.post(
        to(url), "/v1/chat/completions", body, b"X-Request-Id: r1\r\n", connect_timeout=5
    )
    data = await response.read()
    response.release()
    return response.status, data


async def test_answers_come_back_whole_over_one_kept_alive_connection(pool: Pool) -> None:
    async with upstream(answering(answer(b'{"ok":true}'))) as up:
        answers = [await post(pool, up.url, b'{"n":%d}' % i) for i in range(3)]
    assert answers == [(200, b'{"ok":true}')] * 3
    assert up.connections == 1
    first = up.requests[0]
    assert first.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
    assert b"\r\nHost: 127.0.0.1:%d\r\n" % up.port in first
    assert b"\r\nX-Request-Id: r1\r\n" in first
    assert first.endswith(b'Content-Length: 7\r\n\r\n{"n":0}')


async def test_a_chunked_stream_is_handed_over_as_each_piece_arrives(pool: Pool) -> None:
    next_piece = asyncio.Event()

    async def engine(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, up: Upstream
    ) -> None:
        await up.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for event in (b"data: 1\n\n", b"data: 2\n\n"):
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
            await next_piece.wait()  # the second piece is sent only after the first was read
            next_piece.clear()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with upstream(engine) as up:
        response = await pool.post(to(up.url), "/v1/completions", b"{}", b"", connect_timeout=5)
        assert await response.read_piece() == b"data: 1\n\n"
        next_piece.set()
        assert await response.read_piece() == b"data: 2\n\n"
        next_piece.set()
        assert await response.read_piece() == b""
        assert response.complete
        response.release()


async def test_the_idle_deadline_counts_only_the_wait_for_a_piece(pool: Pool) -> None:
    """A reader slower than the idle deadline between reads is not an idle upstream; a wait
    for a piece that lasts past it is, however many pieces came before."""
    send = asyncio.Queue[bytes]()

    async def engine(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, up: Upstream
    ) -> None:
        await up.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        while event := await send.get():
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
        await reader.read()

    idle = 0.2
    async with upstream(engine) as up:
        response = await pool.post(to(up.url), "/v1/completions", b"{}", b"", connect_timeout=5)
        for n in range(3):  # each piece comes in time; the reader dawdles between reads
            send.put_nowait(b"data: %d\n\n" % n)
            assert await response.read_piece(idle) == b"data: %d\n\n" % n
            await asyncio.sleep(idle * 1.5)
        send.put_nowait(b"data: late\n\n")  # there already: no wait at all
        await asyncio.sleep(idle * 1.5)
        assert await response.read_piece(idle) == b"data: late\n\n"
        loop = asyncio.get_running_loop()
        waited_from = loop.time()
        with pytest.raises(TimeoutError):
            await response.read_piece(idle)
        assert loop.time() - waited_from >= idle * 0.9  # the wait itself, not the last piece
        response.close()
        send.put_nowait(b"")


async def test_a_body_without_a_length_ends_with_the_connection_which_is_not_reused(
    pool: Pool,
) -> None:
    async def engine(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, up: Upstream
    ) -> None:
        await up.read_request(reader)
        writer.write(b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n{"all":')
        await writer.drain()
        writer.write(b'"of it"}')

    async with upstream(engine) as up:
        assert await post(pool, up.url) == (200, b'{"all":"of it"}')
        assert await post(pool, up.url) == (200, b'{"all":"of it"}')
    assert up.connections == 2


async def test_an_answer_saying_connection_close_is_not_reused(pool: Pool) -> None:
    closing = answer(b"{}", b"Connection: close\r\n")
    async with upstream(answering(closing, then_wait_for_eof=True)) as up:
        for _ in range(2):
            assert await post(pool, up.url) == (200, b"{}")
    assert up.connections == 2


async def test_a_reused_connection_closed_without_an_answer_is_dropped_a_fresh_one_broken(
    pool: Pool,
) -> None:
    async def engine(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, up: Upstream
    ) -> None:
        await up.read_request(reader)
        if up.connections == 1:
            writer.write(answer(b"{}"))
            await writer.drain()
            await up.read_request(reader)  # the second request on this connection: no answer

    async with upstream(engine) as up:
        assert await post(pool, up.url) == (200, b"{}")
        with pytest.raises(Dropped):
            await post(pool, up.url)
        with pytest.raises(Broken):
            await post(pool, up.url)  # a new connection, closed without an answer


async def test_a_port_nobody_listens_on_is_unreachable(pool: Pool) -> None:
    with pytest.raises(Unreachable):
        await post(pool, f"http://127.0.0.1:{free_port()}")


async def test_an_answer_that_is_not_http_is_broken(pool: Pool) -> None:
    async with upstream(answering(b"SSH-2.0-OpenSSH_9.6\r\n\r\n", then_wait_for_eof=True)) as up:
        with pytest.raises(Broken):
            await post(pool, up.url)


async def test_a_client_that_does_not_read_stops_the_upstream_instead_of_buffering(
    pool: Pool,
) -> None:
    size = 64 * HIGH_WATER
    blocked = asyncio.Event()

    async def engine(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, up: Upstream
    ) -> None:
        await up.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
        # Let unsent bytes pile up here well past what the check below looks for.
        writer.transport.set_write_buffer_limits(high=8 * HIGH_WATER)
        piece = b"x" * 65536
        for _ in range(size // len(piece)):
            writer.write(piece)
            if writer.transport.get_write_buffer_size() > 4 * HIGH_WATER:
                blocked.set()  # the bytes pile up here, not in the client
            await asyncio.sleep(0)  # the client shares this loop: let it read
            await writer.drain()
        await reader.read()

    async with upstream(engine) as up:
        response = await pool.post(to(up.url), "/v1/completions", b"{}", b"", connect_timeout=5)
        async with asyncio.timeout(30):
            await blocked.wait()
        # What the client holds is bounded by the high-water mark and one read's worth.
        assert response._buffered <= HIGH_WATER + 1024 * 1024
        received = len(await response.read())
        response.release()
    assert received == size


async def test_idle_connections_past_the_keepalive_are_not_reused() -> None:
    pool = Pool(keepalive_s=0.0)
    async with upstream(answering(answer(b"{}"))) as up:
        for _ in range(2):
            assert await post(pool, up.url) == (200, b"{}")
    assert up.connections == 2
    pool.close()


async def test_a_base_url_with_a_path_keeps_it_in_front_of_the_route(pool: Pool) -> None:
    async with upstream(answering(answer(b"{}"))) as up:
        assert await post(pool, up.url + "/openai") == (200, b"{}")
    assert up.requests[0].startswith(b"POST /openai/v1/chat/completions HTTP/1.1\r\n")


async def test_bytes_after_a_complete_answer_drop_the_connection(pool: Pool) -> None:
    async with (
        upstream(answering(answer(b"{}") + answer(b"{}"), then_wait_for_eof=True)) as up,
        asyncio.timeout(10),  # a connection wrongly trusted again would wait forever
    ):
        with contextlib.suppress(Broken):
            await post(pool, up.url)
        assert await post(pool, up.url) == (200, b"{}")
    assert up.connections == 2  # the first connection was not trusted again


# --------------------------------------------------------------------------- where it connects


def resolving_to(address: str) -> Callable[[str, int], Awaitable[list[str]]]:
    """A resolver stub: every name resolves to ``address`` (as a hostile DNS answer would)."""

    async def resolve(host: str, port: int) -> list[str]:
        return [address]

    return resolve


async def dial(pool: Pool, url: str, policy: AddressPolicy) -> UpstreamResponse:
    """A request to ``url`` under ``policy``, its answer's head in."""
    return await pool.post(to(url, policy), "/v1/x", b"{}", b"", connect_timeout=5)


@pytest.mark.parametrize("policy", [AddressPolicy.PUBLIC, AddressPolicy.NODE])
@pytest.mark.parametrize(
    "url",
    [
        "http://2852039166/",  # 169.254.169.254 as one decimal number
        "http://0xa9fea9fe/",  # ... in hex
        "http://169.254.169.254/",
        "http://[fd00:ec2::254]/",
        "http://[::ffff:169.254.169.254]/",
    ],
)
async def test_metadata_addresses_are_refused_in_every_form_the_resolver_accepts(
    url: str, policy: AddressPolicy
) -> None:
    """The system resolver itself turns the numeric forms into 169.254.169.254; the check
    looks at what it returned, so no form gets through, and no packet is sent."""
    connections = Pool(keepalive_s=30)
    try:
        with pytest.raises(Forbidden, match="link-local or a cloud metadata"):
            await dial(connections, url, policy)
    finally:
        connections.close()


async def test_a_name_that_resolves_to_the_metadata_address_is_refused() -> None:
    connections = Pool(keepalive_s=30, resolver=resolving_to("169.254.169.254"))
    try:
        with pytest.raises(Forbidden, match=r"169\.254\.169\.254"):
            await dial(connections, "http://innocent.example/", AddressPolicy.PUBLIC)
    finally:
        connections.close()


async def test_loopback_is_refused_to_endpoint_rows_but_is_where_local_engines_live() -> None:
    async with upstream(answering(answer(b"{}"))) as up:
        connections = Pool(keepalive_s=30, resolver=resolving_to("127.0.0.1"))
        try:
            url = f"http://engine.example:{up.port}"
            with pytest.raises(Forbidden, match="loopback"):
                await dial(connections, url, AddressPolicy.PUBLIC)
            assert up.connections == 0  # refused before connecting
            response = await dial(connections, url, AddressPolicy.NODE)
            assert response.status == 200
            response.release()
        finally:
            connections.close()


def test_what_each_policy_allows() -> None:
    assert address_problem("10.0.0.5", AddressPolicy.PUBLIC) is None
    assert address_problem("127.0.0.1", AddressPolicy.NODE) is None
    assert address_problem("127.0.0.1", AddressPolicy.PUBLIC) is not None
    assert address_problem("169.254.169.254", AddressPolicy.ANY) is None  # operator's choice
    assert address_problem("100.100.100.200", AddressPolicy.NODE) is not None
    assert address_problem("0.0.0.0", AddressPolicy.NODE) is not None
    assert address_problem("224.0.0.1", AddressPolicy.NODE) is not None


async def test_a_remote_nodes_engine_is_never_reached_on_this_machines_loopback() -> None:
    """A node whose agent did not connect over loopback: its address may be a name, and the
    name must not resolve to this machine (the gateway host's own services)."""
    assert address_problem("127.0.0.1", AddressPolicy.REMOTE_NODE) is not None
    assert address_problem("::ffff:127.0.0.1", AddressPolicy.REMOTE_NODE) is not None
    assert address_problem("10.0.0.5", AddressPolicy.REMOTE_NODE) is None
    assert address_problem("169.254.169.254", AddressPolicy.REMOTE_NODE) is not None
    async with upstream(answering(answer(b"{}"))) as up:
        connections = Pool(keepalive_s=30, resolver=resolving_to("127.0.0.1"))
        try:
            with pytest.raises(Forbidden, match="loopback"):
                await dial(
                    connections, f"http://gpu-7.example:{up.port}", AddressPolicy.REMOTE_NODE
                )
        finally:
            connections.close()
    assert up.connections == 0


async def test_an_upstream_redirecting_to_the_metadata_address_is_not_followed() -> None:
    """The client never follows a Location: the 302 is what comes back (the relay answers it
    with 502 upstream_redirect), and nothing but the upstream itself is resolved or dialled."""
    resolved: list[str] = []

    async def recording(host: str, port: int) -> list[str]:
        resolved.append(host)
        return ["127.0.0.1"]

    redirect = (
        b"HTTP/1.1 302 Found\r\nLocation: http://169.254.169.254/latest/meta-data/\r\n"
        b"Content-Length: 0\r\n\r\n"
    )
    async with upstream(answering(redirect)) as up:
        connections = Pool(keepalive_s=30, resolver=recording)
        try:
            response = await dial(
                connections, f"http://engine.example:{up.port}", AddressPolicy.NODE
            )
            assert response.status == 302
            assert await response.read() == b""
            response.release()
        finally:
            connections.close()
    assert resolved == ["engine.example"]
    assert up.connections == 1 and len(up.requests) == 1


# ---------------------------------------------------------------------- the gateway's own calls
# Token counting and the context-length probe call upstreams too: with the engine's key and
# under the upstream's address policy, like every relayed request.

ENGINE_KEY = "engine-secret-key"


async def test_the_context_length_probe_sends_the_engine_key() -> None:
    """A replica's engine refuses anything without its key (the sim's --api-key, as vLLM's):
    the probe learns the context length only if it sends the key."""
    from agents.sim.config import SimConfig
    from agents.sim.engine import serve
    from gateway.relay import counting

    sim = await serve(SimConfig(model="keyed", max_model_len=1234, api_key=ENGINE_KEY))
    connections = Pool(keepalive_s=30)
    replica = table.Upstream(
        "replica:1", f"http://127.0.0.1:{sim.port}", key=ENGINE_KEY, addresses="node"
    )
    try:
        counting.learn_context_length(connections, replica, "keyed")
        await asyncio.gather(*counting._learning)
        assert counting.context_length([replica.base_url], "keyed") == 1234
    finally:
        counting._contexts.clear()
        connections.close()
        await sim.close()


async def test_a_tokenize_call_sends_the_engine_key(pool: Pool) -> None:
    from gateway.relay import counting

    async with upstream(answering(answer(b'{"count":3,"tokens":[1,2,3]}'))) as up:
        replica = table.Upstream("replica:2", up.url, key=ENGINE_KEY, addresses="node")
        try:
            assert await counting.Tokenizer(pool, replica, "m").count(text="abc") == 3
        finally:
            counting._dialects.clear()
    assert up.requests and all(
        b"\r\nAuthorization: Bearer %s\r\n" % ENGINE_KEY.encode() in r for r in up.requests
    )


async def test_the_probe_of_an_upstream_resolving_to_a_forbidden_address_is_refused() -> None:
    """An Endpoint row's name that resolves to this machine: the relay refuses to connect,
    and so must the probe, before a packet is sent."""
    from gateway.relay import counting

    async with upstream(answering(answer(b'{"data":[{"id":"m","max_model_len":99}]}'))) as up:
        connections = Pool(keepalive_s=30, resolver=resolving_to("127.0.0.1"))
        endpoint = table.Upstream(
            "endpoint:e", f"http://engine.example:{up.port}", addresses="public"
        )
        try:
            counting.learn_context_length(connections, endpoint, "m")
            await asyncio.gather(*counting._learning)
        finally:
            counting._contexts.clear()
            connections.close()
    assert up.connections == 0
    assert counting.context_length([endpoint.base_url], "m") is None


async def test_a_connection_opened_for_a_node_is_not_reused_for_an_endpoint_row() -> None:
    """A connection is checked against the policy once, when it is opened: one opened for a
    replica (loopback allowed) must not carry an Endpoint row's request (loopback refused)
    to the same origin."""
    async with upstream(answering(answer(b"{}"))) as up:
        connections = Pool(keepalive_s=30, resolver=resolving_to("127.0.0.1"))
        url = f"http://engine.example:{up.port}"
        try:
            response = await dial(connections, url, AddressPolicy.NODE)
            response.release()
            with pytest.raises(Forbidden, match="loopback"):
                await dial(connections, url, AddressPolicy.PUBLIC)
            # Under its own policy the connection is still kept and reused.
            response = await dial(connections, url, AddressPolicy.NODE)
            response.release()
        finally:
            connections.close()
    assert up.connections == 1 and len(up.requests) == 2
