"""Where a web process spends its time on the request path: py-spy samples one llmgw web
process (pinned to one core, as in ``make bench``) while the load generator drives it, once
with non-streamed requests at a constant rate and once with paced streams.

For each load it writes py-spy's collapsed stacks (``var/profile/*.txt``: feed them to any
flame-graph tool, e.g. ``flamegraph.pl`` or speedscope.app) and an SVG flame graph, and prints
the functions that hold the most samples, by their own time and with what they call. py-spy is
not a dependency: ``pip install py-spy`` (it needs ptrace; run as root or allow it).

    python -m bench.profile [--seconds 8] [--rate 800] [--streams 500]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import uvloop

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "var" / "profile"


def summarize(collapsed: Path, top: int = 25) -> str:
    """The functions holding the most samples: own time, and inclusive of what they call.
    Threads idling in a wait (the database thread's executor) are left out."""
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if "concurrent/futures/thread.py" in stack and "_WorkItem.run" not in stack:
            continue  # an executor thread waiting for work
        frames = [frame.split(" (")[0] + _where(frame) for frame in stack.split(";")]
        samples = int(count)
        total += samples
        own[frames[-1]] += samples
        for frame in set(frames):
            inclusive[frame] += samples
    lines = [f"{total} samples", "  own time:"]
    lines += [f"    {n * 100 / total:5.1f}%  {name}" for name, n in own.most_common(top)]
    lines.append("  inclusive:")
    lines += [f"    {n * 100 / total:5.1f}%  {name}" for name, n in inclusive.most_common(top)]
    return "\n".join(lines)


def _where(frame: str) -> str:
    if " (" not in frame:
        return ""
    path = frame.split(" (", 1)[1].split(":", maxsplit=1)[0]
    return f" ({'/'.join(path.split('/')[-2:])})"


def record(pid: int, name: str, seconds: float, form: str = "raw") -> subprocess.Popen[bytes]:
    """py-spy on ``pid`` for ``seconds``: ``raw`` (collapsed stacks) or ``flamegraph`` (SVG)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    suffix = "svg" if form == "flamegraph" else "txt"
    argv = [spy, "record", "-p", str(pid), "-d", str(int(seconds)), "-r", "250", "-f", form]
    return subprocess.Popen(
        [*argv, "-o", str(OUT / f"{name}.{suffix}")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


async def constant_rate(url: str, key: str, rate: int, seconds: float) -> int:
    from bench.load import CHAT, one_request
    from bench.targets import Target

    body = json.dumps(CHAT).encode()
    target = Target("L2", url)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as session:
        start = time.perf_counter()
        tasks = []
        for i in range(int(rate * seconds)):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one_request(session, target, key, body)))
        return len(await asyncio.gather(*tasks))


async def paced_streams(url: str, key: str, count: int, seconds: float) -> int:
    from bench.held import held_stream
    from bench.load import CHAT

    tokens = int(seconds * 1000 / 20)
    body = json.dumps({**CHAT, "max_tokens": tokens, "stream": True, "sim": {"itl_ms": 20}})
    streams = await asyncio.gather(*(held_stream(url, key, body.encode()) for _ in range(count)))
    return sum(stream.events for stream in streams)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--rate", type=int, default=800, help="non-streamed requests a second")
    parser.add_argument("--streams", type=int, default=500, help="paced streams held at once")
    args = parser.parse_args()
    from bench.targets import setup_engine_and_gateway

    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    stack = setup_engine_and_gateway()
    gateway = stack.targets["L2"]
    assert gateway.proc is not None
    try:
        loop = uvloop.new_event_loop()
        loop.run_until_complete(constant_rate(gateway.url, stack.key, args.rate, 2.0))  # warm
        loads = {
            "requests": lambda: constant_rate(gateway.url, stack.key, args.rate, args.seconds),
            "streams": lambda: paced_streams(gateway.url, stack.key, args.streams, args.seconds),
        }
        for name, load in loads.items():
            spies = [
                record(gateway.proc.pid, name, args.seconds - 1),
                record(gateway.proc.pid, f"{name}-flame", args.seconds - 1, "flamegraph"),
            ]
            count = loop.run_until_complete(load())
            for spy in spies:
                spy.wait()
            print(f"\n== {name}: {count} {'requests' if name == 'requests' else 'events'}")
            print(summarize(OUT / f"{name}.txt"))
        loop.close()
    finally:
        stack.stop()
    print(f"\ncollapsed stacks and flame graphs in {OUT}")


if __name__ == "__main__":
    main()
