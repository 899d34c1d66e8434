"""``make bench-accounting``: what usage accounting costs per request, accounting on vs off.

The slice of ``make bench`` that prices accounting alone, quick enough to run before and after
a change to it: one ``sim`` engine, llmgw twice (``LLMGW_USAGE_ACCOUNTING`` on and off), the
same key (with a token budget, so limits, reservations and their settling are priced too),
non-streamed and streamed requests at one client, the targets interleaved round by round.
Reports the median p50 per target, the difference, and CPU per request of the gateway
process. Writes JSON to ``$BENCH_JSON`` (default ``var/bench-accounting.json``).

    python -m bench.accounting [--rounds 7] [--per-round 300]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench import cpu_seconds, django_on
from tests.harness.procs import Proc, free_port, web_process

REPO = Path(__file__).resolve().parent.parent
WORK = REPO / "var" / "bench-accounting"
MODEL = "bench"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 16}


def setup() -> tuple[str, dict[str, Proc], list[Proc]]:
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    env = django_on(f"sqlite:///{WORK / 'bench.sqlite3'}", WORK)
    from tests.harness.factories import make_key, serve_model

    key, _ = make_key("bench", budget=10**12)
    port = free_port()
    argv = [sys.executable, "-m", "agents.sim", "--port", str(port), "--model", MODEL]
    sim = Proc("sim", argv, WORK, env, port=port).start().wait_listening()
    serve_model(MODEL, [sim.port])
    procs = [sim]
    targets = {}
    for name, extra in (("on", {}), ("off", {"LLMGW_USAGE_ACCOUNTING": "false"})):
        web = web_process(f"accounting-{name}", WORK, {**env, **extra})
        procs.append(web)
        targets[name] = web
    return key, targets, procs


async def one(session: aiohttp.ClientSession, url: str, key: str, body: bytes) -> float:
    started = time.perf_counter()
    async with session.post(
        url + "/v1/chat/completions",
        data=body,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    ) as response:
        await response.read()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}")
    return time.perf_counter() - started


async def measure(
    key: str, targets: dict[str, Proc], rounds: int, per_round: int
) -> dict[str, Any]:
    bodies = {
        "plain": json.dumps(CHAT).encode(),
        "stream": json.dumps({**CHAT, "stream": True}).encode(),
    }
    out: dict[str, Any] = {}
    async with aiohttp.ClientSession() as session:
        for web in targets.values():
            for body in bodies.values():
                for _ in range(200):
                    await one(session, web.url, key, body)
        for kind, body in bodies.items():
            p50s: dict[str, list[float]] = {name: [] for name in targets}
            cpu = dict.fromkeys(targets, 0.0)
            for _ in range(rounds):
                for name, web in targets.items():
                    before = cpu_seconds(web.pid)
                    samples = [await one(session, web.url, key, body) for _ in range(per_round)]
                    cpu[name] += cpu_seconds(web.pid) - before
                    p50s[name].append(statistics.median(samples))
            result: dict[str, Any] = {
                name: {
                    "p50_us": statistics.median(p50s[name]) * 1e6,
                    "cpu_us_per_request": cpu[name] / (rounds * per_round) * 1e6,
                }
                for name in targets
            }
            result["added_p50_us"] = result["on"]["p50_us"] - result["off"]["p50_us"]
            result["added_cpu_us"] = (
                result["on"]["cpu_us_per_request"] - result["off"]["cpu_us_per_request"]
            )
            out[kind] = result
    return out


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.accounting")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--per-round", type=int, default=300)
    args = parser.parse_args()
    key, targets, procs = setup()
    try:
        report = asyncio.run(measure(key, targets, args.rounds, args.per_round))
    finally:
        for proc in procs:
            proc.signal(signal.SIGTERM)
        for proc in procs:
            proc.stop()
    for kind, result in report.items():
        on, off = result["on"], result["off"]
        print(
            f"{kind:7} p50 on {on['p50_us']:7.0f} us  off {off['p50_us']:7.0f} us  "
            f"added {result['added_p50_us']:+6.0f} us | CPU/request on "
            f"{on['cpu_us_per_request']:6.0f} us  off {off['cpu_us_per_request']:6.0f} us  "
            f"added {result['added_cpu_us']:+5.0f} us"
        )
    path = Path(os.environ.get("BENCH_JSON", REPO / "var" / "bench-accounting.json"))
    path.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
