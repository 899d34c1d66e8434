"""``make bench``: what llmgw adds over calling the engine directly, measured in one run.

Three levels against the same ``sim`` engine, with the same load generator, interleaved so
drift hits all alike (see ``shared/BENCHMARK.md``):

- L0: the load generator calls ``sim`` directly;
- L1: a ~50-line raw-ASGI relay with llmgw's upstream client (``bench/relay.py``) on the
  server ``manage.py run`` starts (uvicorn with uvloop and httptools);
- L2: llmgw on that server (auth, limits check, routing, usage accounting on).

More targets price single choices: L2 with usage accounting off, L2 with ``/v1`` on Django's
stock handler and middleware (what ``gateway.edge.asgi.V1App`` saves), and the servers side by
side: a raw-ASGI hello world (``bench/hello.py``), L1 and L2 on granian, and L2 on daphne
(what ran the web processes before). Every uvicorn target is the web process ``manage.py run``
starts (the launcher's command line); granian and daphne get their own stock command lines.
Gateway processes are pinned to CPU 1, the engine and the load generator to CPU 0 (not with
``BENCH_PIN=0``). Then the control plane's figures (``bench/control.py``): cold start and
failover. The table is printed and written as JSON to ``$BENCH_JSON`` (default
``var/bench.json``).

    python -m bench [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import uvloop

from bench import control, fresh_store
from bench.held import HeldStream, held_stream
from tests.harness.procs import Proc, free_port, web_process

REPO = Path(__file__).resolve().parent.parent
WORK = REPO / "var" / "bench"
MODEL = "bench"
TICKS = os.sysconf("SC_CLK_TCK")
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 16}


@dataclass
class Target:
    name: str
    url: str  # base, without /v1
    proc: Proc | None = None
    key: str = ""  # a key of its own (LiteLLM's master key), else the stack's

    def cpu_seconds(self) -> float:
        """CPU of the server and its worker processes (granian serves from a child)."""
        if self.proc is None:
            return 0.0
        total = 0.0
        for pid in process_tree(self.proc.pid):
            try:
                with open(f"/proc/{pid}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += (int(fields[11]) + int(fields[12])) / TICKS
        return total

    def rss_mib(self) -> float:
        assert self.proc is not None
        with open(f"/proc/{self.proc.pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return 0.0


@dataclass
class Stack:
    key: str
    targets: dict[str, Target]
    procs: list[Proc] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def stop(self) -> None:
        for proc in self.procs:
            proc.signal(signal.SIGTERM)
        for proc in self.procs:
            proc.stop()


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants, from /proc."""
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        for task in Path(f"/proc/{current}/task").glob("*/children"):
            try:
                todo += [int(child) for child in task.read_text().split()]
            except OSError:
                continue
    return out


# BENCH_PIN=0 leaves every process free to run on any core: on a machine others load, a
# pinned process waits for its one core, and a server that sleeps between requests pays that
# wake-up where one that spins does not (so the pinned latencies favour spinning servers).
PINNING = os.environ.get("BENCH_PIN", "1") != "0"


def pin(proc: Proc, cpu: int) -> Proc:
    if PINNING and hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > cpu:
        for pid in process_tree(proc.pid):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(pid, {cpu})
    return proc


def granian(name: str, app: str, env: dict[str, str]) -> Proc:
    """One granian worker on its own port (it binds its own socket), uvloop, one thread."""
    port = free_port()
    argv = [
        str(Path(sys.executable).with_name("granian")),
        *("--interface", "asgi", "--host", "127.0.0.1", "--port", str(port)),
        *("--workers", "1", "--runtime-mode", "st", "--loop", "uvloop", "--no-ws"),
        *("--log-level", "warning", app),
    ]
    return Proc(name, argv, WORK, env, port=port).start().wait_answering()


LITELLM_KEY = "sk-bench-" + "0" * 32


def litellm(program: str, upstream: str, env: dict[str, str]) -> Proc:
    """LiteLLM's proxy in front of the same engine, one worker: the side-by-side target. It is
    never a dependency of ours: ``LITELLM_BIN`` names a ``litellm`` from its own virtualenv."""
    port = free_port()
    config = WORK / "litellm.yaml"
    model = {"model": f"openai/{MODEL}", "api_base": upstream + "/v1", "api_key": "none"}
    config.write_text(
        json.dumps(
            {
                "model_list": [{"model_name": MODEL, "litellm_params": model}],
                "general_settings": {"master_key": LITELLM_KEY},
            }
        )
    )
    argv = [program, "--config", str(config), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--num_workers", "1"]
    clean = {
        k: v for k, v in env.items() if not k.startswith(("DATABASE_URL", "DJANGO", "PYTHONPATH"))
    }
    # Its bundled price list, not one fetched at start (with no network, three retries).
    clean["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    proc = Proc("litellm", argv, WORK, clean, port=port).start()
    return proc.wait_answering("/health/liveliness", timeout=180)


def daphne(name: str, app: str, env: dict[str, str]) -> Proc:
    port = free_port()
    argv = [str(Path(sys.executable).with_name("daphne")), "-b", "127.0.0.1", "-p", str(port)]
    argv += ["--verbosity", "0", app]
    return Proc(name, argv, WORK, env, port=port).start().wait_answering()


def start_engine(stack: Stack, env: dict[str, str]) -> Proc:
    """The ``sim`` engine (L0) on CPU 0, and the model routed to it."""
    from tests.harness.factories import serve_model  # after django.setup()

    port = free_port()
    argv = [sys.executable, "-m", "agents.sim", "--port", str(port), "--model", MODEL]
    sim = Proc("sim", argv, WORK, env, port=port).start()
    stack.procs.append(sim)
    pin(sim.wait_listening(), cpu=0)
    serve_model(MODEL, [sim.port])
    stack.targets["L0"] = Target("L0", sim.url, sim)
    return sim


def start_targets(stack: Stack, env: dict[str, str]) -> None:
    """The engine (L0) and every gateway in front of it, each kept in ``stack`` as it starts."""
    sim = start_engine(stack, env)
    # Every gateway is the web server `manage.py run` starts (the launcher's argv); L1 and the
    # stock handler only serve another application on it.
    variants = {
        "L1": ("bench.relay:app", {"BENCH_UPSTREAM": sim.url}),
        "L2": ("", {}),
        "L2-no-usage": ("", {"LLMGW_USAGE_ACCOUNTING": "false"}),
        "L2-stock-handler": ("bench.stock:app", {}),
    }
    for name, (app, extra) in variants.items():
        web = web_process(name, WORK, {**env, **extra}, app=app)
        stack.procs.append(pin(web, cpu=1))
        stack.targets[name] = Target(name, web.url, web)
    relay_env = {**env, "BENCH_UPSTREAM": sim.url}

    def keep(name: str, proc: Proc, key: str = "") -> None:
        stack.procs.append(pin(proc, cpu=1))
        stack.targets[name] = Target(name, proc.url, proc, key)

    keep("L2-daphne", daphne("L2-daphne", "llmgw_site.asgi:application", env))
    if Path(sys.executable).with_name("granian").exists():
        keep("L1-granian", granian("L1-granian", "bench.relay:app", relay_env))
        keep("L2-granian", granian("L2-granian", "llmgw_site.asgi:application", env))
        keep("hello-granian", granian("hello-granian", "bench.hello:app", env))
    else:
        print("granian is not installed (requirements-dev.txt): its rows are skipped")
    keep("hello-uvicorn", web_process("hello-uvicorn", WORK, env, app="bench.hello:app"))
    litellm_bin = os.environ.get("LITELLM_BIN")
    if litellm_bin:
        keep("litellm", litellm(litellm_bin, sim.url, env), LITELLM_KEY)
    else:
        stack.skipped["litellm"] = (
            "skipped: set LITELLM_BIN to a litellm[proxy] install's `litellm`"
        )


def prepare() -> tuple[dict[str, str], str]:
    """A fresh SQLite store with one key; the environment every process gets."""
    return fresh_store(WORK, "bench")


def started(start: Callable[[Stack, dict[str, str]], object]) -> Stack:
    """A fresh store, then ``start``'s processes; this process on CPU 0 with the engine."""
    env, key = prepare()
    stack = Stack(key, {})
    try:
        start(stack, env)
    except BaseException:
        stack.stop()  # a target that failed to start must not leave the others running
        raise
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1:
        if PINNING:
            os.sched_setaffinity(0, {0})
    return stack


def setup() -> Stack:
    """The engine and every gateway in front of it."""
    return started(start_targets)


def setup_engine_and_gateway() -> Stack:
    """The engine and one llmgw web process (L2) only (``bench.profile``)."""

    def start(stack: Stack, env: dict[str, str]) -> None:
        start_engine(stack, env)
        web = web_process("L2", WORK, env)
        stack.procs.append(pin(web, cpu=1))
        stack.targets["L2"] = Target("L2", web.url, web)

    return started(start)


# --- measurements -------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


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


async def latency_rounds(stack: Stack, rounds: int, per_round: int) -> dict[str, Any]:
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
                results[name]["p50"].append(pct(samples, 0.5))
                results[name]["p99"].append(pct(samples, 0.99))
    return {
        name: {
            "p50_ms": statistics.median(r["p50"]) * 1000,
            "p99_ms": statistics.median(r["p99"]) * 1000,
            "cpu_ms_per_request": cpu[name] / counted[name] * 1000,
        }
        for name, r in results.items()
    }


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
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
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
    p99 that ``pct`` takes would be the slowest one); then instant streams for CPU per event."""
    paced = json.dumps(
        {**CHAT, "max_tokens": 20, "stream": True, "sim": {"itl_ms": 5, "ttft_ms": 5}}
    ).encode()
    instant = json.dumps({**CHAT, "max_tokens": 400, "stream": True}).encode()
    names = [n for n in ("L0", "L1", "L2", "L2-granian") if n in stack.targets]
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
            "ttft_p50_ms": pct(ttft[name], 0.5) * 1000,
            "ttft_p99_ms": pct(ttft[name], 0.99) * 1000,
            "gap_p50_ms": pct(gap[name], 0.5) * 1000,
            "gap_p99_ms": pct(gap[name], 0.99) * 1000,
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
    return pct(latencies, 0.99), errors / total


# The lowest rate every target is stepped through; below it only the slow ones (LiteLLM's).
MIN_KNEE_RATE = 50
KNEE_TARGETS = ["L0", "L1", "L2", "L1-granian", "L2-granian", "L2-daphne", "litellm"]


async def knee(
    stack: Stack, rates: list[int], seconds: float, own_floor: dict[str, float]
) -> dict[str, Any]:
    """The highest rate each target holds with p99 within 10 ms of L0's at that rate (or of
    its own one-client p99, for a target in ``own_floor`` that is far slower than L0 even
    unloaded: LiteLLM's proxy) and under 0.1% errors. A target is dropped after two steps in
    a row that fail, not one: on a shared machine one scheduling hiccup in a step's few
    seconds puts its p99 over the line at any rate (seen: L0 itself at 5 to 9 ms p99 at
    50 rps, and the floor relay's knee read as 25 rps), and one such step ended the climb."""
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
                "p99_stall_ms": pct(stalls, 0.99) * 1000,
                "ttft_p99_ms": pct([s.first for s in streams], 0.99) * 1000,
                "incomplete": len(lost),
                "cpu_us_per_event": (target.cpu_seconds() - cpu_before) / max(1, events) * 1e6,
            }
        )
    return out


def run(quick: bool) -> dict[str, Any]:
    stack = setup()
    try:
        # The load generator on uvloop, as the servers: its own cost per read is a share of
        # every figure at L0, and beside the engine on one core, the less the better.
        loop = uvloop.new_event_loop()
        step: Callable[[Awaitable[Any]], Any] = loop.run_until_complete
        report: dict[str, Any] = {"quick": quick, "cpus": os.cpu_count(), "pinned": PINNING}
        report["litellm_skipped"] = stack.skipped.get("litellm", "")
        report["latency"] = step(latency_rounds(stack, 3 if quick else 7, 200 if quick else 400))
        report["streaming"] = step(stream_rounds(stack, 3 if quick else 5, 10 if quick else 40))
        rates = [MIN_KNEE_RATE, 100, 150, 200, 300, 400, 600, 800, 1000, 1300, 1600, 2000]
        rates += [2500, 3000]
        slow = {n: report["latency"][n]["p99_ms"] for n in ("litellm",) if n in stack.targets}
        if slow:  # LiteLLM's proxy holds far less than our lowest step: start lower for it
            rates = [5, 10, 25, *rates]
        report["throughput"] = step(knee(stack, rates, 1.5 if quick else 3.0, slow))
        report["memory"] = step(held_streams(stack, [250, 500, 1000], 3.0 if quick else 5.0))
        report["memory_L0"] = step(
            held_streams(stack, [250, 500, 1000], 3.0 if quick else 5.0, "L0")
        )
        loop.close()
    finally:
        stack.stop()
    if os.sched_getaffinity(0) != set(range(os.cpu_count() or 1)):
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))  # the whole machine again
    report["cold_start"] = control.cold_start(WORK / "control", samples=1 if quick else 3)
    report["failover"] = control.failover(WORK / "control")
    return report


def summarize(report: dict[str, Any]) -> list[tuple[str, str, str, bool | None]]:
    """(figure, measured, goal, reached) rows for the table."""
    lat = report["latency"]
    l0, l1, l2 = lat["L0"], lat["L1"], lat["L2"]
    stream = report["streaming"]
    added_p50 = l2["p50_ms"] - l0["p50_ms"]
    added_p99 = l2["p99_ms"] - l0["p99_ms"]
    hops = added_p50 / max(1e-9, l1["p50_ms"] - l0["p50_ms"])
    ttft99 = stream["L2"]["ttft_p99_ms"] - stream["L0"]["ttft_p99_ms"]
    gap99 = (stream["L2"]["gap_p99_ms"] - stream["L0"]["gap_p99_ms"]) * 1000
    knees = report["throughput"]["knee_rps"]
    knee_ratio = knees["L2"] / knees["L1"] if knees["L1"] else 0.0
    mem = report["memory"]
    per_1000 = next((lv for lv in mem["levels"] if lv["streams"] == 1000), None)
    held_ok = (
        per_1000 is not None and per_1000["max_stall_ms"] <= 200 and not per_1000["incomplete"]
    )
    slope = (per_1000["rss_mib"] - mem["idle_rss_mib"]) if per_1000 else float("nan")
    accounting = lat["L2"]["p50_ms"] - lat["L2-no-usage"]["p50_ms"]
    cold = report["cold_start"]["overhead_s"]
    failover = report["failover"]
    stock = lat["L2-stock-handler"]["p50_ms"] - lat["L2"]["p50_ms"]
    return [
        (
            "added latency c=1 p50 / p99",
            f"{added_p50:.2f} / {added_p99:.2f} ms",
            "<= 0.5 / 2 ms",
            added_p50 <= 0.5 and added_p99 <= 2,
        ),
        ("L2 / L0 (p50)", f"{l2['p50_ms'] / l0['p50_ms']:.2f}x", "", None),
        ("Python hops (L2-L0)/(L1-L0), p50", f"{hops:.2f}", "", None),
        ("added TTFT p99 (stream)", f"{ttft99:.2f} ms", "<= 3 ms", ttft99 <= 3),
        ("added gap between chunks p99", f"{gap99:.0f} us", "<= 300 us", gap99 <= 300),
        (
            "CPU per non-streamed request (L2)",
            f"{l2['cpu_ms_per_request']:.3f} ms",
            "<= 0.3 ms",
            l2["cpu_ms_per_request"] <= 0.3,
        ),
        (
            "CPU per relayed SSE event (L2)",
            f"{stream['L2']['cpu_us_per_event']:.1f} us",
            "<= 15 us",
            stream["L2"]["cpu_us_per_event"] <= 15,
        ),
        (
            "throughput knee L2 / L1",
            f"{knees['L2']} / {knees['L1']} rps = {knee_ratio:.2f}",
            ">= 0.7",
            knee_ratio >= 0.7,
        ),
        (
            "1,000 streams at 20 ms, max stall",
            f"{per_1000['max_stall_ms']:.0f} ms, {per_1000['incomplete']} incomplete"
            if per_1000
            else "n/a",
            "<= 200 ms, none lost",
            held_ok,
        ),
        (
            "1,000 streams, max stall at L0 (engine direct) / L2",
            " / ".join(
                f"{held['levels'][-1]['max_stall_ms']:.0f}"
                for held in (report["memory_L0"], report["memory"])
            )
            + " ms",
            "",
            None,
        ),
        (
            "idle RSS per web process",
            f"{mem['idle_rss_mib']:.0f} MiB",
            "<= 150 MB",
            mem["idle_rss_mib"] <= 143,
        ),
        ("RSS per 1,000 open streams", f"+{slope:.0f} MiB", "<= +64 MiB", slope <= 64),
        (
            "usage accounting on vs off, p50",
            f"{accounting * 1000:+.0f} us",
            "<= +50 us",
            accounting * 1000 <= 50,
        ),
        ("stock Django handler + middleware vs ours, p50", f"{stock * 1000:+.0f} us", "", None),
        (
            "cold start overhead (first token - engine start)",
            f"{cold:.2f} s",
            "<= 1.5 s",
            cold <= 1.5,
        ),
        *server_rows(report),
        *litellm_rows(report),
        (
            "leader killed: new leader / next placement",
            f"{failover['new_leader_after_s']:.1f} / {failover['placement_after_s']:.1f} s",
            "",
            None,
        ),
    ]


def server_rows(report: dict[str, Any]) -> list[tuple[str, str, str, bool | None]]:
    """The servers side by side: the figures the web processes' server was chosen by."""
    lat = report["latency"]
    knees = report["throughput"]["knee_rps"]

    def trio(names: list[str], key: str, fmt: str) -> str:
        return " / ".join(format(lat[n][key], fmt) if n in lat else "-" for n in names)

    hello = ["hello-uvicorn", "hello-granian"]
    l1 = ["L1", "L1-granian"]
    l2 = ["L2", "L2-granian", "L2-daphne"]
    return [
        (
            "server: hello world p50, uvicorn / granian",
            trio(hello, "p50_ms", ".3f") + " ms",
            "",
            None,
        ),
        (
            "server: hello world CPU/req, uvicorn / granian",
            trio(hello, "cpu_ms_per_request", ".3f") + " ms",
            "",
            None,
        ),
        ("server: L1 p50, uvicorn / granian", trio(l1, "p50_ms", ".3f") + " ms", "", None),
        (
            "server: L1 CPU/req, uvicorn / granian",
            trio(l1, "cpu_ms_per_request", ".3f") + " ms",
            "",
            None,
        ),
        ("server: L2 p50, uvicorn / granian / daphne", trio(l2, "p50_ms", ".3f") + " ms", "", None),
        (
            "server: L2 CPU/req, uvicorn / granian / daphne",
            trio(l2, "cpu_ms_per_request", ".3f") + " ms",
            "",
            None,
        ),
        (
            "server: knee L1 uvicorn / granian; L2 uvicorn / granian / daphne",
            " / ".join(str(knees.get(n, 0)) for n in l1)
            + "; "
            + " / ".join(str(knees.get(n, 0)) for n in l2)
            + " rps",
            "",
            None,
        ),
    ]


def litellm_rows(report: dict[str, Any]) -> list[tuple[str, str, str, bool | None]]:
    lat = report["latency"]
    if "litellm" not in lat:
        return [("LiteLLM proxy side by side", report.get("litellm_skipped", "skipped"), "", None)]
    l0 = lat["L0"]["p50_ms"]
    ours = lat["L2"]["p50_ms"] - l0
    theirs = lat["litellm"]["p50_ms"] - l0
    knees = report["throughput"]["knee_rps"]
    theirs_knee = knees.get("litellm", 0)
    lowest = report["throughput"]["steps"][0]["rate"]
    # Below the lowest step its knee is unknown, so the ratio is only a lower bound.
    knee_ratio = knees["L2"] / (theirs_knee or lowest)
    return [
        (
            "vs LiteLLM proxy: added p50 ours / theirs",
            f"{ours:.2f} / {theirs:.2f} ms = 1/{theirs / max(1e-9, ours):.0f}",
            "<= 1/30",
            theirs / max(1e-9, ours) >= 30,
        ),
        (
            "vs LiteLLM proxy: knee ours / theirs",
            f"{knees['L2']} / {theirs_knee} rps = {knee_ratio:.1f}x"
            if theirs_knee
            else f"{knees['L2']} / below {lowest} rps: >= {knee_ratio:.1f}x",
            ">= 25x",
            knee_ratio >= 25,
        ),
    ]


def print_table(report: dict[str, Any]) -> None:
    lat, stream = report["latency"], report["streaming"]
    print("\nper target (non-streamed c=1, median of rounds)")
    print(f"{'target':18} {'p50 ms':>8} {'p99 ms':>8} {'CPU ms/req':>11}")
    for name, row in lat.items():
        print(
            f"{name:18} {row['p50_ms']:8.3f} {row['p99_ms']:8.3f} {row['cpu_ms_per_request']:11.3f}"
        )
    print(
        f"\n{'streaming':18} {'TTFT p50':>9} {'TTFT p99':>9} {'gap p50':>8} {'gap p99':>8} "
        f"{'CPU us/event':>12}"
    )
    for name, row in stream.items():
        print(
            f"{name:18} {row['ttft_p50_ms']:9.3f} {row['ttft_p99_ms']:9.3f} "
            f"{row['gap_p50_ms']:8.3f} {row['gap_p99_ms']:8.3f} {row['cpu_us_per_event']:12.1f}"
        )
    print(
        "\nthroughput (open loop): "
        + ", ".join(
            f"{s['rate']} rps: "
            + " ".join(
                f"{n} p99 {s[n]['p99_ms']:.1f}ms err {s[n]['errors']:.1%}"
                for n in KNEE_TARGETS
                if n in s
            )
            for s in report["throughput"]["steps"]
        )
    )
    for name, held in (("L2", report["memory"]), ("L0", report["memory_L0"])):
        print(
            f"\nheld streams, {name}: "
            + ", ".join(
                f"{lv['streams']}: RSS {lv['rss_mib']:.0f} MiB, max stall {lv['max_stall_ms']:.0f}"
                f" ms (p99 {lv['p99_stall_ms']:.0f}), TTFT p99 {lv['ttft_p99_ms']:.0f} ms, "
                f"{lv['cpu_us_per_event']:.1f} us CPU/event, {lv['incomplete']} incomplete"
                for lv in held["levels"]
            )
        )
    print(f"\n{'figure':48} {'measured':32} {'goal':20} reached")
    for figure, measured, goal, ok in summarize(report):
        mark = "" if ok is None else ("yes" if ok else "NO")
        print(f"{figure:48} {measured:32} {goal:20} {mark}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (about a minute)")
    args = parser.parse_args()
    report = run(args.quick)
    report["summary"] = [
        {"figure": f, "measured": m, "goal": g, "reached": ok} for f, m, g, ok in summarize(report)
    ]
    print_table(report)
    out = Path(os.environ.get("BENCH_JSON", REPO / "var" / "bench.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
