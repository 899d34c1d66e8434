"""``make bench-fleet``: the control plane at fleet scale, measured.

What it runs and reports is :mod:`bench.fleet`'s docstring. Run as
``python -m bench.fleet [--nodes 1000] [--models 500] [--duration 600]``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from bench.fleet.figures import print_table, summarize
from bench.fleet.phases import run
from bench.fleet.rig import REPO, WORK, Options


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.fleet", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--models", type=int, default=500)
    parser.add_argument("--wave", type=int, default=200)
    parser.add_argument("--duration", type=float, default=600.0, help="steady seconds (RSS)")
    parser.add_argument("--steady", type=float, default=30.0, help="seconds of tick sampling")
    parser.add_argument("--ready-delay", type=float, default=2.0)
    parser.add_argument(
        "--database-url",
        default=os.environ.get(
            "BENCH_FLEET_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/llmgw_bench_fleet"
        ),
        help="a PostgreSQL database this run drops and creates",
    )
    parser.add_argument("--json", type=Path, default=REPO / "var" / "bench-fleet.json")
    args = parser.parse_args()
    options = Options(
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        models=args.models,
        wave=args.wave,
        duration=args.duration,
        steady=args.steady,
        ready_delay=args.ready_delay,
        database_url=args.database_url,
    )
    os.environ.update(
        DATABASE_URL=options.database_url,
        SECRET_KEY=os.environ.get("SECRET_KEY") or "llmgw-bench-only",
        LLMGW_VAR_DIR=str(WORK),
        DJANGO_SETTINGS_MODULE="llmgw_site.settings",
        LLMGW_LOG_LEVEL="WARNING",
    )
    WORK.mkdir(parents=True, exist_ok=True)
    import django

    django.setup()
    started_at = time.time()
    report = run(options, say=lambda text: print(text, flush=True))
    report["wall_s"] = round(time.time() - started_at, 1)
    report["summary"] = [
        {"figure": f, "measured": m, "goal": g, "reached": ok} for f, m, g, ok in summarize(report)
    ]
    print_table(report)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(f"\nwritten to {args.json}")


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    main()
