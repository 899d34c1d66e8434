"""``make bench``: what llmgw adds over calling the engine directly, measured in one run.

Three levels against the same ``sim`` engine, with the same load generator, interleaved so
drift hits all alike (see ``shared/BENCHMARK.md``):

- L0: the load generator calls ``sim`` directly;
- L1: a ~50-line raw-ASGI relay with llmgw's upstream client (``bench/relay.py``) on the
  server ``manage.py run`` starts (uvicorn with uvloop and httptools);
- L2: llmgw on that server (auth, limits check, routing, usage accounting on).

More targets price single choices: L2 with usage accounting off, L2 with the processes'
diagnostics off (``LLMGW_DIAGNOSTICS=false``: what having them available costs), L2 with
``/v1`` on Django's stock handler and middleware (what ``gateway.edge.asgi.V1App`` saves), L2
with OpenTelemetry traces on (L2-traced, exporting to an OTLP/HTTP receiver: ``bench/tracing.py``),
with ``--baseline DIR`` L2 served from another checkout's code (L2-baseline), and the servers
side by side: a raw-ASGI hello world (``bench/hello.py``), L1 and L2 on granian, and L2 on
daphne (what ran the web processes before). Every uvicorn target is the web process ``manage.py
run`` starts (the launcher's command line); granian and daphne get their own stock command
lines.
Gateway processes are pinned to CPU 1, the engine and the load generator to CPU 0 (not with
``BENCH_PIN=0``). Then the control plane's figures (``bench/control.py``): cold start and
failover; and the CPU of one routing decision by the cache (``bench/routing_cost.py``). The
table is printed and written as JSON to ``$BENCH_JSON`` (default
``var/bench.json``).

``--baseline DIR`` (or ``BENCH_BASELINE=DIR``) prices a change side by side: one more target,
L2-baseline, is llmgw's web process started as L2 is but running the code checked out in DIR
(an earlier commit), taking its turn right after L2 in the latency, streaming and knee rounds;
the table adds rows "L2 vs L2-baseline".

    python -m bench [--quick] [--baseline DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import uvloop

from bench import control
from bench.figures import print_table, summarize
from bench.load import MIN_KNEE_RATE, held_streams, knee, latency_rounds, stream_rounds
from bench.targets import PINNING, REPO, WORK, Stack, setup


def diagnostics_rss(stack: Stack) -> dict[str, float]:
    """Resident memory of L2 with its diagnostics available and without, after the same load."""
    return {name: stack.targets[name].rss_mib() for name in ("L2", "L2-no-diagnostics")}


def run(quick: bool, baseline: Path | None = None) -> dict[str, Any]:
    stack = setup(baseline)
    pair = ("L2", "L2-baseline") if baseline else ()
    try:
        # The load generator on uvloop, as the servers: its own cost per read is a share of
        # every figure at L0, and beside the engine on one core, the less the better.
        loop = uvloop.new_event_loop()
        step: Callable[[Awaitable[Any]], Any] = loop.run_until_complete
        report: dict[str, Any] = {"quick": quick, "cpus": os.cpu_count(), "pinned": PINNING}
        report["litellm_skipped"] = stack.skipped.get("litellm", "")
        if baseline:
            report["baseline"] = stack.baseline
        report["latency"] = step(
            latency_rounds(stack, 3 if quick else 7, 200 if quick else 400, keep_rounds=pair)
        )
        report["diagnostics_rss_mib"] = diagnostics_rss(stack)
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
    report["routing"] = json.loads(
        subprocess.run(
            [sys.executable, "-m", "bench.routing_cost"],
            cwd=REPO,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    )
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (about a minute)")
    parser.add_argument(
        "--baseline",
        type=Path,
        default=os.environ.get("BENCH_BASELINE") or None,
        metavar="DIR",
        help="also run L2 on the llmgw code checked out in DIR, side by side ($BENCH_BASELINE)",
    )
    args = parser.parse_args()
    baseline = args.baseline.resolve() if args.baseline else None
    if baseline and not (baseline / "llmgw_site" / "webserver.py").is_file():
        parser.error(f"--baseline {baseline}: not an llmgw tree (no llmgw_site/webserver.py)")
    report = run(args.quick, baseline)
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
