"""``make bench-routing``: how well llmgw routes over engines with prefix caches, side by side
with SGLang's Model Gateway (``shared/BENCHMARK.md``, section 2).

Each workload (``bench/routing/workloads.py``) is sent to each target (``targets.py``) in one
run; the targets take turns, the first one moving along with each workload, so drift hits all
alike. Every (workload, target) gets four fresh ``sim`` replicas (``sims.py``, their settings in
the table at its top) and a freshly started router, so none inherits another's warm cache or
what a router learned. Per cell: prefix hit ratio from the engines' own counters
(``vllm:prefix_cache_hits`` over ``vllm:prefix_cache_queries``, deltas over the workload) and
from the usage the clients got (``cached_tokens`` over ``prompt_tokens``), TTFT p50/p99,
output tokens a second, the busiest replica's share of requests (each engine's own request
counters), the engines' longest waiting queue, and errors. Then the goals, as pass/fail rows.
The table is printed and the JSON written to ``var/bench-routing.json``.

``--repeat N`` runs the whole set N times, each round starting every workload with the next
target, and judges the goals on each cell's median over the rounds (requests and errors
summed, the engines' counts added up); each round's cell is kept in the JSON (``rounds``) and
the table shows the spread of TTFT p99. A tail set by one burst (a few requests of hundreds) moves
by milliseconds from run to run with the load generator's own timing, so one run can say no
more than that.

    python -m bench.routing [--quick] [--workload NAME ...] [--target NAME ...]
                            [--repeat N] [--sim-source DIR] [--json PATH]

``--sim-source`` (or ``BENCH_SIM_SOURCE``) runs the sim from another checkout, read only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import uvloop

from bench import fresh_store, percentile
from bench.routing.sims import (
    REPLICAS,
    SIM_SETTINGS,
    SimKind,
    Sims,
    default_source,
    detect,
    engine_counts,
    sample_waiting,
    scrape,
    start_sims,
)
from bench.routing.targets import TARGETS, Running, Target, ensure_sglang_router
from bench.routing.workloads import (
    FULL,
    MORE_WORKLOADS,
    QUICK,
    RATES,
    WORKLOADS,
    Client,
    Run,
    Size,
)
from tests.harness.procs import REPO_ROOT

WORK = REPO_ROOT / "var" / "bench-routing"
JSON_OUT = REPO_ROOT / "var" / "bench-routing.json"
# As many connections as the busiest workload keeps open at once (``shared``'s clients).
WARM_UP_CONNECTIONS = 64
WARM_UP_WAVES = 2


async def warm_up(client: Client) -> None:
    """One-token requests of a few words (less than one of the engines' cache blocks, nothing
    any workload's prompts open with), one for each connection the busiest workload keeps
    open, twice: the first wave opens the client's connections, each taken by whichever web
    process accepts it, the second goes over them as the workload will, so every process of
    a router has connections open to every engine. A workload that opens with a burst
    (``multi-turn``: 24 sessions at once) then measures the routing, not connections opened
    in the middle of it: eight requests at once left one of llmgw's two web processes without
    a connection to some engines, or to any, in most starts (docs/decisions.md, 'the routing
    bench's warm-up'). They are over before the engines' counters are read."""
    for _ in range(WARM_UP_WAVES):
        outcomes = await asyncio.gather(
            *(
                client.chat([{"role": "user", "content": f"hello {n}"}], 1)
                for n in range(WARM_UP_CONNECTIONS)
            )
        )
        failed = [o.error for o in outcomes if not o.ok]
        if failed:
            raise RuntimeError(f"warm-up failed: {failed[0]}")


def figures(
    run: Run,
    before: list[dict[str, float]],
    after: list[dict[str, float]],
    peaks: list[float],
    cache_model: bool,
) -> dict[str, Any]:
    ok = [o for o in run.outcomes if o.ok]
    ttfts = [o.ttft * 1000 for o in ok]
    counts = [(engine_counts(b), engine_counts(a)) for b, a in zip(before, after, strict=True)]
    taken = [new.requests - old.requests for old, new in counts]
    total = sum(taken)
    queries = hits = 0.0
    counted = all(None not in (c.prefix_queries, c.prefix_hits) for pair in counts for c in pair)
    for old, new in counts if counted else ():
        queries += (new.prefix_queries or 0) - (old.prefix_queries or 0)
        hits += (new.prefix_hits or 0) - (old.prefix_hits or 0)
    prompt = sum(o.prompt_tokens for o in ok)
    cached = sum(o.cached_tokens for o in ok)
    errors = sorted({o.error for o in run.outcomes if not o.ok})
    return {
        "requests": len(run.outcomes),
        "errors": len(run.outcomes) - len(ok),
        "error_kinds": errors[:5],
        "seconds": run.seconds,
        "ttft_p50_ms": percentile(ttfts, 0.5),
        "ttft_p99_ms": percentile(ttfts, 0.99),
        "output_tokens_per_s": sum(o.completion_tokens for o in ok) / max(1e-9, run.seconds),
        "hit_ratio_engine": hits / queries if counted and queries else None,
        "hit_ratio_usage": cached / prompt if cache_model and prompt else None,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "engine_requests": taken,
        "busiest_share": max(taken) / total if total else None,
        "busiest_over_mean": max(taken) * len(taken) / total if total else None,
        "peak_waiting": peaks,
    }


async def measure(
    workload: str, size: Size, router: Running, sims: Sims, cache_model: bool
) -> dict[str, Any]:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        client = Client(session, router.url, router.key)
        await warm_up(client)
        before = await scrape(session, sims.urls)
        peaks = [0.0] * len(sims.urls)
        sampler = asyncio.create_task(sample_waiting(session, sims.urls, peaks))
        try:
            run = await (WORKLOADS | MORE_WORKLOADS)[workload](client.chat, size)
        finally:
            sampler.cancel()
        after = await scrape(session, sims.urls)
    return figures(run, before, after, peaks, cache_model)


def run_cell(
    step: Callable[[Any], Any],
    workload: str,
    target: Target,
    size: Size,
    kind: SimKind,
    env: dict[str, str],
    key: str,
) -> dict[str, Any]:
    """Four fresh engines, a fresh router in front, the workload; then both stopped."""
    logs = WORK / "logs" / f"{workload}-{target.name}"
    sims = start_sims(kind, env, logs, WORK / "pycache")
    try:
        started = time.perf_counter()
        router = target.start(sims.urls, env, key, logs)
        ready_after = time.perf_counter() - started
        try:
            cell: dict[str, Any] = step(measure(workload, size, router, sims, kind.cache_model))
        finally:
            router.stop()
    finally:
        sims.stop()
    cell["router_ready_s"] = ready_after
    cell["argv"] = router.argv
    cell["env"] = router.env
    return cell


def print_cell(workload: str, target: str, cell: dict[str, Any]) -> None:
    print(
        f"{workload} / {target}: {cell['requests']} requests in {cell['seconds']:.1f} s, "
        f"TTFT p50 {cell['ttft_p50_ms']:.0f} ms p99 {cell['ttft_p99_ms']:.0f} ms, "
        f"hit ratio {ratio(cell['hit_ratio_engine'])}, {cell['errors']} errors",
        flush=True,
    )


# Summed over rounds, not the median: what was sent, and what failed of it.
SUMMED = ("requests", "errors", "prompt_tokens", "cached_tokens")


def combine(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One cell of several rounds: each figure's median (None where any round had none), the
    counts summed, the engines' requests added up and their peaks the highest; the rounds kept."""
    if len(rounds) == 1:
        return rounds[0]
    cell: dict[str, Any] = {}
    for key, first in rounds[0].items():
        values = [r[key] for r in rounds]
        if key in SUMMED:
            cell[key] = sum(values)
        elif key == "engine_requests":
            cell[key] = [sum(taken) for taken in zip(*values, strict=True)]
        elif key == "peak_waiting":
            cell[key] = [max(peaks) for peaks in zip(*values, strict=True)]
        elif key == "error_kinds":
            cell[key] = sorted({kind for kinds in values for kind in kinds})[:5]
        elif isinstance(first, (int, float)) or first is None:
            numbers = [v for v in values if isinstance(v, (int, float))]
            cell[key] = statistics.median(numbers) if len(numbers) == len(values) else None
        else:
            cell[key] = first
    cell["rounds"] = rounds
    return cell


def ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


# --- the goals (shared/BENCHMARK.md) -----------------------------------------------------------

OURS = "llmgw"
CACHE_AWARE = "sglang-cache-aware"
ROUND_ROBIN = "sglang-round-robin"
LEAST_OUTSTANDING = "llmgw-least-outstanding"

Row = tuple[str, str, str, bool | None]


def hit_ratio(cell: dict[str, Any]) -> float | None:
    """What the engines counted, else what their usage said."""
    engine: float | None = cell["hit_ratio_engine"]
    return engine if engine is not None else cell["hit_ratio_usage"]


def figure(key: str) -> Callable[[dict[str, Any]], float | None]:
    return lambda cell: cell[key]


@dataclass(frozen=True)
class Goal:
    """One goal of BENCHMARK.md: llmgw's figure in a workload against ``other``'s (or alone,
    when ``other`` is empty)."""

    workload: str
    figure: str
    read: Callable[[dict[str, Any]], float | None]
    other: str
    goal: str
    holds: Callable[[float, float], bool]


GOALS = (
    *(
        goal
        for workload in ("shared", "multi-turn")
        for goal in (
            Goal(workload, "hit ratio, llmgw / cache_aware", hit_ratio, CACHE_AWARE,
                 ">= cache_aware's", lambda a, b: a >= b),
            Goal(workload, "TTFT p50 ms, llmgw / cache_aware", figure("ttft_p50_ms"),
                 CACHE_AWARE, "<= 0.8x", lambda a, b: a <= 0.8 * b),
            Goal(workload, "TTFT p99 ms, llmgw / cache_aware", figure("ttft_p99_ms"),
                 CACHE_AWARE, "<= 1.0x", lambda a, b: a <= b),
        )
    ),
    Goal("shared", "output tok/s, llmgw / round robin", figure("output_tokens_per_s"),
         ROUND_ROBIN, ">= 2x", lambda a, b: a >= 2 * b),
    Goal("no-sharing", "TTFT p99 ms, llmgw / least-outstanding", figure("ttft_p99_ms"),
         LEAST_OUTSTANDING, "<= 1.1x", lambda a, b: a <= 1.1 * b),
    Goal("hot-prefix", "busiest replica / mean, llmgw", figure("busiest_over_mean"), "",
         "< 1.3x", lambda a, _: a < 1.3),
    Goal("hot-prefix", "TTFT p99 ms, llmgw / round robin", figure("ttft_p99_ms"),
         ROUND_ROBIN, "<= 1.0x", lambda a, b: a <= b),
)  # fmt: skip


def evaluate(goal: Goal, cells: dict[str, dict[str, Any]]) -> Row:
    """Unmeasured when a cell is missing or lacks the figure; not reached when llmgw's cell
    had errors (a figure over the requests that failed is no figure)."""
    name = f"{goal.workload}: {goal.figure}"
    ours, theirs = cells.get(OURS), cells.get(goal.other) if goal.other else {}
    if ours is None or theirs is None:
        return (name, "not run", goal.goal, None)
    a = goal.read(ours)
    b = goal.read(theirs) if goal.other else 1.0
    if a is None or b is None:
        return (name, "n/a (the engines report no cache)", goal.goal, None)
    if goal.read is hit_ratio:
        measured = f"{a:.2f} / {b:.2f}"
    elif goal.other:
        measured = f"{a:.0f} / {b:.0f} = {a / b:.2f}x"
    else:
        measured = f"{a:.2f}x"
    if ours["errors"]:
        return (name, f"{measured}, {ours['errors']} errors", goal.goal, False)
    return (name, measured, goal.goal, goal.holds(a, b))


def goals(report: dict[str, Any]) -> list[Row]:
    return [evaluate(goal, report["cells"].get(goal.workload, {})) for goal in GOALS]


def print_table(report: dict[str, Any]) -> None:
    head = (
        f"\n{'workload':11} {'target':24} {'hit eng':>7} {'hit use':>7} {'TTFT p50':>9} "
        f"{'TTFT p99':>9} {'out tok/s':>9} {'busiest':>7} {'/mean':>6} {'wait':>5} "
        f"{'err':>4} {'reqs':>5} {'secs':>6}"
    )
    print(head)
    for workload, row in report["cells"].items():
        for target, cell in row.items():
            share = cell["busiest_share"]
            spread = ""
            if "rounds" in cell:
                p99s = sorted(r["ttft_p99_ms"] for r in cell["rounds"])
                spread = f"  p99 of the rounds {' '.join(f'{v:.0f}' for v in p99s)}"
            print(
                f"{workload:11} {target:24} {ratio(cell['hit_ratio_engine']):>7} "
                f"{ratio(cell['hit_ratio_usage']):>7} {cell['ttft_p50_ms']:9.0f} "
                f"{cell['ttft_p99_ms']:9.0f} {cell['output_tokens_per_s']:9.0f} "
                f"{ratio(share):>7} {ratio(cell['busiest_over_mean']):>6} "
                f"{max(cell['peak_waiting']):5.0f} {cell['errors']:4d} {cell['requests']:5d} "
                f"{cell['seconds']:6.1f}{spread}"
            )
    print(
        "(TTFT in ms; busiest: the busiest replica's share of requests; wait: the longest "
        "waiting queue an engine showed)"
    )
    print(f"\n{'goal':54} {'measured':34} {'goal':16} reached")
    for figure, measured, goal, ok in report["goals_rows"]:
        mark = "" if ok is None else ("yes" if ok else "NO")
        print(f"{figure:54} {measured:34} {goal:16} {mark}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests (development)")
    parser.add_argument(
        "--workload",
        action="append",
        choices=list(WORKLOADS | MORE_WORKLOADS),
        default=[],
        help="only this workload (repeatable; the default is the four with goals)",
    )
    parser.add_argument(
        "--target",
        action="append",
        choices=[t.name for t in TARGETS],
        default=[],
        help="only this target (repeatable)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="N",
        help="run everything N times, interleaved; goals on each cell's median",
    )
    parser.add_argument(
        "--sim-source",
        type=Path,
        default=default_source(),
        help="the folder whose agents.sim to run (read only; default this "
        "repository, or BENCH_SIM_SOURCE)",
    )
    parser.add_argument("--json", type=Path, default=JSON_OUT, help="where the JSON goes")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.repeat < 1:
        raise SystemExit("--repeat: at least 1")
    workloads = args.workload or list(WORKLOADS)
    targets = [t for t in TARGETS if not args.target or t.name in args.target]
    env, key = fresh_store(WORK, "bench-routing")
    kind = detect(args.sim_source, env, WORK / "pycache")
    from django.conf import settings

    report: dict[str, Any] = {
        "quick": args.quick,
        "cpus": os.cpu_count(),
        "replicas": REPLICAS,
        "sim": kind.describe(),
        "sim_settings": [s.__dict__ for s in SIM_SETTINGS],
        "rates_per_s": RATES,
        # Until llmgw has the setting, both llmgw targets route alike.
        "llmgw_routing_policy_setting": hasattr(settings, "LLMGW_ROUTING_POLICY"),
        "skipped": {},
        "cells": {},
    }
    if not kind.cache_model:
        print(
            f"the sim in {kind.source} has no cache model ({', '.join(kind.missing)} missing): "
            "fallback timing, hit ratios n/a"
        )
    if any(t.sglang for t in targets):
        why = ensure_sglang_router()
        if why:
            report["skipped"] = {t.name: why for t in targets if t.sglang}
            targets = [t for t in targets if not t.sglang]
    size = QUICK if args.quick else FULL
    report["repeat"] = args.repeat
    rounds: dict[str, dict[str, list[dict[str, Any]]]] = {
        w: {t.name: [] for t in targets} for w in workloads
    }
    loop = uvloop.new_event_loop()
    try:
        for turn in range(args.repeat):
            for index, workload in enumerate(workloads):
                first = (index + turn) % len(targets)
                for target in targets[first:] + targets[:first]:
                    cell = run_cell(loop.run_until_complete, workload, target, size, kind, env, key)
                    rounds[workload][target.name].append(cell)
                    print_cell(workload, target.name, cell)
    finally:
        loop.close()
    # The table reads in the targets' own order, whatever order they ran in.
    report["cells"] = {
        workload: {name: combine(cells) for name, cells in row.items()}
        for workload, row in rounds.items()
    }
    rows = goals(report)
    report["goals_rows"] = rows
    report["goals"] = [
        {"figure": f, "measured": m, "goal": g, "reached": ok} for f, m, g, ok in rows
    ]
    print_table(report)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps({k: v for k, v in report.items() if k != "goals_rows"}, indent=2)
    )
    print(f"\nwritten to {args.json}")


if __name__ == "__main__":
    main()
