"""``make bench``'s load generator: requests one at a time, paced and instant streams, an open
loop stepped up to each target's knee, and many slow streams held at once; each returns its
figures per target of a :class:`~bench.targets.Stack`.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Collection
from typing import Any

import aiohttp

from bench import percentile
from bench.held import HeldStream, held_stream
from bench.targets import MODEL, Stack, Target

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 16}


async def one_request(
    session: aiohttp.ClientSession, target: Target, key: str, body: bytes
) -> float:
    started = time.perf_counter()
    async with session.post(
        target.url + "/v1/chat/completions",
        data=body,
        headers={
            "Authorization": f"Bearer {target.key or key}",
            "Content-Type": "application/json",
        },
    ) as response:
        await response.read()
        if response.status != 200:
            raise RuntimeError(f"{target.name}: HTTP {response.status}")
    return time.perf_counter() - started


async def latency_rounds(
    stack: Stack, rounds: int, per_round: int, keep_rounds: Collection[str] = ()
) -> dict[str, Any]:
    """Requests one at a time, the targets taking turns each round: the median of the rounds'
    p50 and p99, and CPU per request; each round's own for the targets in ``keep_rounds``
    (two compared round by round, since a round's drift hits both)."""
    body = json.dumps(CHAT).encode()
    results: dict[str, dict[str, list[float]]] = {n: {"p50": [], "p99": []} for n in stack.targets}
    cpu = dict.fromkeys(stack.targets, 0.0)
    counted = dict.fromkeys(stack.targets, 0)
    async with aiohttp.ClientSession() as session:
        for target in stack.targets.values():  # warm up: connections, caches, routing table
            for _ in range(200):
                await one_request(session, target, stack.key, body)
        for _ in range(rounds):
            for name, target in stack.targets.items():
                before = target.cpu_seconds()
                samples = [
                    await one_request(session, target, stack.key, body) for _ in range(per_round)
                ]
                cpu[name] += target.cpu_seconds() - before
                counted[name] += per_round
                results[name]["p50"].append(percentile(samples, 0.5))
                results[name]["p99"].append(percentile(samples, 0.99))
    out: dict[str, Any] = {
        name: {
            "p50_ms": statistics.median(r["p50"]) * 1000,
            "p99_ms": statistics.median(r["p99"]) * 1000,
            "cpu_ms_per_request": cpu[name] / counted[name] * 1000,
        }
        for name, r in results.items()
    }
    for name in keep_rounds:
        for q in ("p50", "p99"):
            out[name][f"{q}_rounds_ms"] = [value * 1000 for value in results[name][q]]
    return out


async def one_stream(
    session: aiohttp.ClientSession, target: Target, key: str, body: bytes
) -> tuple[float, list[float], int]:
    """Time to first token, gaps between reads, and events received."""
    started = time.perf_counter()
    first: float | None = None
    last = started
    gaps: list[float] = []
    events = 0
    async with session.post(
        target.url + "/v1/chat/completions",
        data=body,
        headers={
            "Authorization": f"Bearer {target.key or key}",
            "Content-Type": "application/json",
        },
    ) as response:
        async for chunk in response.content.iter_any():
            now = time.perf_counter()
            count = chunk.count(b"data: ")
            if count == 0:
                continue
            events += count
            if first is None:
                first = now - started
            else:
                gaps.append(now - last)
            last = now
    return (first or 0.0), gaps, events


async def stream_rounds(stack: Stack, rounds: int, per_round: int) -> dict[str, Any]:
    """Paced streams one at a time, the targets taking turns each round: time to first token
    and gaps, pooled over the rounds (a full run takes 200 first tokens a target: of 100, the
    p99 that ``percentile`` takes would be the slowest one); then instant streams for CPU per
    event."""
    paced = json.dumps(
        {**CHAT, "max_tokens": 20, "stream": True, "sim": {"itl_ms": 5, "ttft_ms": 5}}
    ).encode()
    instant = json.dumps({**CHAT, "max_tokens": 400, "stream": True}).encode()
    names = [n for n in ("L0", "L1", "L2", "L2-baseline", "L2-granian") if n in stack.targets]
    ttft: dict[str, list[float]] = {n: [] for n in names}
    gap: dict[str, list[float]] = {n: [] for n in names}
    cpu = dict.fromkeys(names, 0.0)
    events = dict.fromkeys(names, 0)
    async with aiohttp.ClientSession() as session:
        for _ in range(rounds):
            for name in names:
                target = stack.targets[name]
                for _ in range(per_round):
                    first, gaps, _ = await one_stream(session, target, stack.key, paced)
                    ttft[name].append(first)
                    gap[name].extend(gaps)
                before = target.cpu_seconds()
                for _ in range(max(2, per_round // 5)):
                    _, _, count = await one_stream(session, target, stack.key, instant)
                    events[name] += count
                cpu[name] += target.cpu_seconds() - before
    return {
        name: {
            "ttft_p50_ms": percentile(ttft[name], 0.5) * 1000,
            "ttft_p99_ms": percentile(ttft[name], 0.99) * 1000,
            "gap_p50_ms": percentile(gap[name], 0.5) * 1000,
            "gap_p99_ms": percentile(gap[name], 0.99) * 1000,
            "cpu_us_per_event": cpu[name] / max(1, events[name]) * 1e6,
        }
        for name in names
    }


async def open_loop(
    session: aiohttp.ClientSession, target: Target, key: str, rate: int, seconds: float
) -> tuple[float, float]:
    """Constant arrival rate for ``seconds``: (p99 latency, error share)."""
    body = json.dumps(CHAT).encode()
    latencies: list[float] = []
    errors = 0

    async def fire() -> None:
        nonlocal errors
        try:
            async with asyncio.timeout(2.0):
                latencies.append(await one_request(session, target, key, body))
        except Exception:
            errors += 1

    tasks: list[asyncio.Task[None]] = []
    start = time.perf_counter()
    total = int(rate * seconds)
    for i in range(total):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(fire()))
    await asyncio.gather(*tasks)
    return percentile(latencies, 0.99), errors / total


# The lowest rate every target is stepped through; below it only the slow ones (LiteLLM's).
MIN_KNEE_RATE = 50
KNEE_TARGETS = ["L0", "L1", "L2", "L2-baseline", "L1-granian", "L2-granian", "L2-daphne", "litellm"]


async def knee(
    stack: Stack, rates: list[int], seconds: float, own_floor: dict[str, float]
) -> dict[str, Any]:
    """The highest rate each target holds with p99 within 10 ms of L0's at that rate (or of
    its own one-client p99, for a target in ``own_floor`` that is far slower than L0 even
    unloaded: LiteLLM's proxy) and under 0.1% errors. A target is dropped after two steps in
    a row that fail, not one: on a shared machine one scheduling hiccup in a step's few
    seconds puts its p99 over the line at any rate, and one such step ended the climb
    (docs/decisions.md, 'the throughput climb')."""
    names = [name for name in KNEE_TARGETS if name in stack.targets]
    passed: dict[str, int] = dict.fromkeys(names, 0)
    failed_in_a_row: dict[str, int] = dict.fromkeys(names, 0)
    steps: list[dict[str, Any]] = []
    alive = set(names)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        for rate in rates:
            step: dict[str, Any] = {"rate": rate}
            for name in names:
                if name not in alive:
                    continue
                if rate < MIN_KNEE_RATE and name not in own_floor:
                    # Steps this low are there for the slow targets; at 5 requests a second
                    # a step holds 15, and its "p99" is its slowest one.
                    continue
                p99, errors = await open_loop(
                    session, stack.targets[name], stack.key, rate, seconds
                )
                step[name] = {"p99_ms": p99 * 1000, "errors": errors}
            base = step["L0"]["p99_ms"] if "L0" in step else float("inf")
            for name in names:
                if name not in step:
                    continue
                floor = own_floor.get(name, base)
                ok = step[name]["errors"] < 0.001 and step[name]["p99_ms"] <= floor + 10
                if ok:
                    passed[name] = rate
                    failed_in_a_row[name] = 0
                else:
                    failed_in_a_row[name] += 1
                    if failed_in_a_row[name] == 2:
                        alive.discard(name)
            steps.append(step)
            if alive <= {"L0"}:
                break
    return {"knee_rps": passed, "steps": steps}


async def held_streams(
    stack: Stack, counts: list[int], hold: float, name: str = "L2"
) -> dict[str, Any]:
    """RSS of one llmgw process while it relays N slow streams (20 ms between tokens), and
    the longest stall a client saw. Held against L0 too: on a loaded two-core machine the
    engine and the load generator stall on their own, and only the difference is ours. The
    streams are read by a bare protocol (``bench.held``), so the load generator costs little
    beside the engine on their shared core."""
    target = stack.targets[name]
    tokens = int(hold * 1000 / 20) + 5
    body = json.dumps(
        {**CHAT, "max_tokens": tokens, "stream": True, "sim": {"itl_ms": 20}}
    ).encode()
    idle = target.rss_mib() if name != "L0" else 0.0
    out: dict[str, Any] = {"idle_rss_mib": idle, "levels": []}
    for count in counts:
        streams: list[HeldStream] = []
        lost: list[int] = []

        async def consume(streams: list[HeldStream] = streams, lost: list[int] = lost) -> None:
            try:
                stream = await held_stream(target.url, stack.key, body)
            except OSError:
                lost.append(1)
                return
            streams.append(stream)
            if stream.status != 200 or stream.events < tokens:
                lost.append(1)

        cpu_before = target.cpu_seconds()
        tasks = [asyncio.create_task(consume()) for _ in range(count)]
        await asyncio.sleep(hold * 0.6)
        rss = target.rss_mib() if name != "L0" else 0.0
        await asyncio.gather(*tasks)
        events = sum(stream.events for stream in streams)
        stalls = [stream.max_gap for stream in streams]
        out["levels"].append(
            {
                "streams": count,
                "rss_mib": rss,
                "max_stall_ms": max(stalls, default=0) * 1000,
                "p99_stall_ms": percentile(stalls, 0.99) * 1000,
                "ttft_p99_ms": percentile([s.first for s in streams], 0.99) * 1000,
                "incomplete": len(lost),
                "cpu_us_per_event": (target.cpu_seconds() - cpu_before) / max(1, events) * 1e6,
            }
        )
    return out
