"""[G8] Slow clients, end to end: a few hundred connections to a live web process, each sending
a byte a second (its headers, or its body after whole headers, to ``/v1`` and to the admin),
while other clients use the gateway with the ``openai`` client.

Each slow connection must be answered 408 and closed once its deadline (``LLMGW_HEADER_TIMEOUT``
from the connection's start, ``LLMGW_BODY_TIMEOUT`` from the end of its headers) has passed,
never before it; every other client's request must be answered as usual meanwhile; and the web
process's memory must stay bounded. No timing ceiling is asserted: a loaded machine closes
later, never earlier.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.client import HTTPConnection
from pathlib import Path

import openai
import pytest
from django.utils import timezone

from tests.harness.cluster import Cluster, heartbeat_after, node_health
from tests.harness.factories import make_key, serve_model
from tests.harness.live import Stack, gateway_stack, http, routes
from tests.harness.procs import Proc, connections_to
from tests.harness.waits import TIMEOUT, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True), pytest.mark.timeout(300)]

HEADER_TIMEOUT = 2.0
BODY_TIMEOUT = 3.0
SLOW_HEADERS = 150
SLOW_BODIES = 150  # half to /v1, half to the admin's sign-in
# A slow connection still open this long after its start was never closed by the server.
GIVE_UP_AFTER = max(HEADER_TIMEOUT, BODY_TIMEOUT) + TIMEOUT
MIB = 1024 * 1024
MEMORY_BOUND = 100 * MIB


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    settings = {
        "LLMGW_HEADER_TIMEOUT": str(HEADER_TIMEOUT),
        "LLMGW_BODY_TIMEOUT": str(BODY_TIMEOUT),
    }
    with gateway_stack(tmp_path, ["m"], engines=1, settings=lambda _: settings) as stack:
        yield stack


def rss(proc: Proc) -> int:
    """Resident memory of ``proc`` in bytes."""
    for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {proc.name}")


@dataclass
class Outcome:
    """What one slow connection saw: the server's answer and when the connection ended."""

    kind: str
    deadline: float
    answer: bytes = b""
    lasted: float = 0.0
    closed: bool = False


HEAD_SLOWLY = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"s" * 400 + b"\r\n\r\n"


def body_head(path: bytes, length: int) -> bytes:
    return (
        b"POST " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % length
    )


async def trickle(port: int, outcome: Outcome, at_once: bytes, slowly: bytes) -> None:
    """Send ``at_once``, then ``slowly`` a byte a second, until the server closes the
    connection (or ``GIVE_UP_AFTER``: then it is recorded as never closed)."""
    # Before the connect: the server cannot have started its clock any earlier.
    opened = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    chunks: list[bytes] = []

    async def read_all() -> None:
        try:
            while chunk := await reader.read(65536):
                chunks.append(chunk)
        except ConnectionError:
            pass  # a reset is a close too

    reading = asyncio.ensure_future(read_all())
    try:
        if at_once:
            writer.write(at_once)
        for byte in slowly:
            if time.monotonic() - opened > GIVE_UP_AFTER:
                break
            try:
                writer.write(bytes([byte]))
                await writer.drain()
            except ConnectionError:
                break
            done, _ = await asyncio.wait({reading}, timeout=1.0)
            if done:
                break
        done, _ = await asyncio.wait(
            {reading}, timeout=max(0.0, GIVE_UP_AFTER - (time.monotonic() - opened))
        )
        outcome.closed = bool(done)
    finally:
        outcome.lasted = time.monotonic() - opened
        outcome.answer = b"".join(chunks)
        reading.cancel()
        writer.close()


async def other_clients(base_url: str, key: str, slow: list[asyncio.Task[None]]) -> list[str]:
    """Requests as usual, one after another while the slow connections are open; their
    answers."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=120)
    answers: list[str] = []
    try:
        while not all(task.done() for task in slow) or len(answers) < 10:
            reply = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hello"}], max_tokens=4
            )
            answers.append(reply.choices[0].message.content or "")
            stream = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
            )
            answers.append(
                "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            )
    finally:
        await client.close()
    return answers


async def slow_loris(web: Proc, key: str) -> tuple[list[Outcome], list[str], int]:
    """The slow connections and the other clients together; (outcomes, answers, peak RSS)."""
    body = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"x" * 900 + b'"}]}'
    outcomes: list[Outcome] = []
    tasks: list[asyncio.Task[None]] = []
    for i in range(SLOW_HEADERS + SLOW_BODIES):
        if i < SLOW_HEADERS:
            outcome, at_once, slowly = Outcome("headers", HEADER_TIMEOUT), b"", HEAD_SLOWLY
        else:
            path = b"/v1/chat/completions" if i % 2 else b"/admin/login/"
            outcome, at_once, slowly = (
                Outcome(f"body {path.decode()}", BODY_TIMEOUT),
                body_head(path, len(body)),
                body,
            )
        outcomes.append(outcome)
        tasks.append(asyncio.ensure_future(trickle(web.port, outcome, at_once, slowly)))
    peak = 0

    async def watch_memory() -> None:
        nonlocal peak
        while not all(task.done() for task in tasks):
            peak = max(peak, rss(web))
            await asyncio.sleep(0.2)

    watching = asyncio.ensure_future(watch_memory())
    answers = await other_clients(web.url + "/v1", key, tasks)
    await asyncio.gather(*tasks)
    await watching
    return outcomes, answers, peak


def test_slow_headers_and_bodies_are_closed_at_their_deadline_and_nobody_else_waits(
    stack: Stack, tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    """[G8] 150 connections trickling their headers and 150 their bodies, a byte a second:
    each is answered 408 (or at least closed) after its deadline, never before; the
    requests of other clients meanwhile are all answered, a kept-alive connection idle past
    the deadlines and an agent's stream are left alone; the web process grows by less than
    100 MiB."""
    key, _ = make_key()
    serve_model("m", [stack.engines[0].port])
    wait_until(lambda: routes(stack.web, key, "m"), what="the web process to route m")
    client = openai.OpenAI(base_url=stack.web.url + "/v1", api_key=key, max_retries=0)
    assert client.chat.completions.create(model="m", messages=[{"role": "user", "content": "warm"}])
    # The admin's URLconf is loaded by its first request: load it now, not during the count.
    assert http("GET", stack.web.url + "/admin/login/")[0] == 200
    # What the deadlines must leave alone: a kept-alive connection idle between its requests,
    # and an agent's WebSocket stream (whose handshake had headers, and no body ever ends).
    kept = HTTPConnection("127.0.0.1", stack.web.port, timeout=60)
    kept.request("GET", "/v1/models", headers={"Authorization": f"Bearer {key}"})
    assert kept.getresponse().read()
    kept_socket = kept.sock
    agents = Cluster(tmp_path)
    agent = agents.add_agent("slow-g8", urls=[stack.web.url])
    wait_until(lambda: node_health("slow-g8") == "ready", what="the agent", logs=[stack.web])
    assert agent.proc is not None
    stream = connections_to(agent.proc.pid, stack.web.port)
    assert stream
    before = rss(stack.web)

    try:
        outcomes, answers, peak = asyncio.run(slow_loris(stack.web, key))
        after = rss(stack.web)
        ended = timezone.now()
        wait_until(lambda: heartbeat_after("slow-g8", ended), what="a heartbeat after the test")
        assert connections_to(agent.proc.pid, stack.web.port) == stream, "the same stream"
    finally:
        agents.stop()
    kept.request("GET", "/v1/models", headers={"Authorization": f"Bearer {key}"})
    assert kept.getresponse().status == 200
    assert kept.sock is kept_socket, "served on the same kept-alive connection"
    kept.close()
    record_property("rss_before_mib", round(before / MIB, 1))
    record_property("rss_peak_mib", round(peak / MIB, 1))
    record_property("rss_after_mib", round(after / MIB, 1))
    still_open = [o for o in outcomes if not o.closed]
    assert not still_open, (
        f"{len(still_open)} of {len(outcomes)} slow connections were still open after "
        f"{GIVE_UP_AFTER:g}s (kinds: {sorted({o.kind for o in still_open})})"
    )
    early = [o for o in outcomes if o.lasted < o.deadline]
    assert not early, f"closed before their deadline: {[(o.kind, o.lasted) for o in early[:5]]}"
    answered = [o for o in outcomes if o.answer]
    assert all(o.answer.startswith(b"HTTP/1.1 408 ") for o in answered), {
        o.answer[:40] for o in answered
    }
    # A connection closed while a byte of it was still unread may be reset before the client
    # reads the 408; most are not.
    for kind in {o.kind for o in outcomes}:
        assert any(o.answer for o in outcomes if o.kind == kind), f"no 408 for {kind}"
    assert len(answers) >= 10 and all(answers), answers
    assert stack.web.running()
    assert peak - before < MEMORY_BOUND, f"RSS {before / MIB:.0f} -> {peak / MIB:.0f} MiB"
    # The process still serves afterwards.
    assert client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "after"}]
    )
