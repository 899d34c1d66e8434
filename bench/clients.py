"""Why the relay's upstream client is aiohttp: httpx and aiohttp against the same ``sim``, one
connection and 64 concurrent requests, interleaved, the client process pinned to one core.

    python -m bench.clients
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import httpx

from tests.harness.procs import Proc, free_port

BODY = json.dumps(
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
).encode()
HEADERS = {"Content-Type": "application/json"}


async def measure(kind: str, url: str, concurrency: int, total: int) -> dict[str, float]:
    one: Callable[[], Awaitable[None]]
    if kind == "httpx":
        client = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=1000, max_keepalive_connections=1000),
            timeout=None,
        )

        async def one() -> None:
            response = await client.post(url, content=BODY, headers=HEADERS)
            await response.aread()

        close: Callable[[], Awaitable[None]] = client.aclose
    else:
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

        async def one() -> None:
            async with session.post(url, data=BODY, headers=HEADERS) as response:
                await response.read()

        close = session.close
    for _ in range(200):
        await one()
    latencies: list[float] = []

    async def worker(count: int) -> None:
        for _ in range(count):
            started = time.perf_counter()
            await one()
            latencies.append(time.perf_counter() - started)

    before = resource.getrusage(resource.RUSAGE_SELF)
    started = time.perf_counter()
    await asyncio.gather(*(worker(total // concurrency) for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_SELF)
    await close()
    latencies.sort()
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return {
        "rps": len(latencies) / elapsed,
        "p50_ms": latencies[len(latencies) // 2] * 1000,
        "p99_ms": latencies[int(len(latencies) * 0.99)] * 1000,
        "cpu_us_per_request": cpu / len(latencies) * 1e6,
    }


def main() -> None:
    port = free_port()
    argv = [sys.executable, "-m", "agents.sim", "--port", str(port), "--model", "m"]
    sim = Proc("sim", argv, Path(tempfile.mkdtemp(prefix="bench-clients-")), port=port)
    sim.start().wait_listening()
    try:
        if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1:
            os.sched_setaffinity(sim.pid, {0})
            os.sched_setaffinity(0, {1})
        url = f"{sim.url}/v1/chat/completions"
        for _ in range(2):
            for kind in ("httpx", "aiohttp"):
                for concurrency in (1, 64):
                    row = asyncio.run(measure(kind, url, concurrency, 3000))
                    print(
                        f"{kind:8} c={concurrency:<3} {row['rps']:7.0f} rps  "
                        f"p50 {row['p50_ms']:7.2f} ms  p99 {row['p99_ms']:7.2f} ms  "
                        f"CPU {row['cpu_us_per_request']:5.0f} us/request"
                    )
    finally:
        sim.stop()


if __name__ == "__main__":
    main()
