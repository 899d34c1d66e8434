"""``make bench-tracing``: what OpenTelemetry traces cost a request, alone (``make bench`` has the
same rows among the rest).

Targets, each the web process ``manage.py run`` starts, on one CPU: L2 (tracing off), L2-traced
(on: every request's span and its attempt's exported with the SDK's defaults to an OTLP/HTTP
receiver that counts what it gets, ``tests.harness.otlp``), L2-traced-1% (on, 1% of the traces
sampled), and, with
``BENCH_BASELINE=<a checkout of an earlier commit>``, L2-baseline (that code, which has no
tracing). Non-streamed requests one at a time, the targets taking turns each round
(``bench.load.latency_rounds``); the figure is each web process's CPU per request, its
exporting thread included. The receiver's count shows the spans did go out.

    python -m bench.tracing [--quick]
"""

from __future__ import annotations

import argparse
import json
import urllib.request
from typing import Any

import uvloop

from bench.figures import tracing_rows
from bench.load import latency_rounds
from bench.targets import setup_tracing


def run(quick: bool) -> dict[str, Any]:
    stack = setup_tracing()
    try:
        loop = uvloop.new_event_loop()
        rounds, per_round = (3, 200) if quick else (7, 400)
        report: dict[str, Any] = {"quick": quick}
        report["latency"] = loop.run_until_complete(latency_rounds(stack, rounds, per_round))
        loop.close()
        (receiver,) = [proc for proc in stack.procs if proc.name == "otlp"]
        with urllib.request.urlopen(receiver.url + "/stats", timeout=10) as answer:
            report["exported"] = json.loads(answer.read())
    finally:
        stack.stop()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    report = run(parser.parse_args().quick)
    print(f"\n{'target':14} {'p50 ms':>8} {'p99 ms':>8} {'CPU ms/req':>11}")
    for name, row in report["latency"].items():
        print(
            f"{name:14} {row['p50_ms']:8.3f} {row['p99_ms']:8.3f} {row['cpu_ms_per_request']:11.3f}"
        )
    exported = report["exported"]
    print(f"\nexported by L2-traced: {exported['posts']} OTLP requests, {exported['bytes']} bytes")
    for figure, measured, _, _ in tracing_rows(report):
        print(f"{figure:52} {measured}")


if __name__ == "__main__":
    main()
