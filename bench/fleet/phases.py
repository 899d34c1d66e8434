"""One run of the fleet benchmark, phase by phase (see :mod:`bench.fleet`): the report each
phase adds to, and the invariants checked throughout."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from typing import Any

from bench import percentile, rss_mib
from bench.fleet.catalog import catalog_shapes, write_catalog
from bench.fleet.rig import Options, StoreChecker, started
from bench.fleet.store import (
    committed,
    connections_by_app,
    fresh_database,
    log_size,
    node_heartbeat_writes,
    replica_counts,
    store_errors,
    table_writes,
    wanted_replicas,
)


def slope_per_hour(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MiB), in MiB per hour."""
    if len(samples) < 2:
        return 0.0
    xs = [t for t, _ in samples]
    ys = [v for _, v in samples]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mean_x) ** 2 for x in xs)
    if den == 0:
        return 0.0
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / den * 3600


def run(options: Options, say: Callable[[str], None] = print) -> dict[str, Any]:
    from django.utils import timezone

    from control.models import Node, ServedModel

    if options.create_database:
        fresh_database(options.database_url)
        from django.core.management import call_command

        call_command("migrate", verbosity=0)
    report: dict[str, Any] = {"options": {**options.__dict__, "work": str(options.work)}}
    report["options"].pop("settings", None)
    shapes = catalog_shapes(options.models)
    database = options.database_url.rsplit("/", 1)[1]
    with started(options) as rig:
        n = options.nodes
        checker = StoreChecker()
        checker.start()
        try:
            # 1. every node connected, then the catalog from empty
            took = rig.wait(
                "every node connected",
                lambda: (
                    rig.fleet_stats().get("served", 0) >= n
                    and Node.objects.filter(health=Node.Health.READY).count() >= n
                ),
                300,
            )
            say(f"{n} nodes connected in {took:.1f}s")
            write_catalog(shapes)
            catalog_at = time.time()
            wanted = wanted_replicas()
            placed_s = rig.wait("the catalog placed", lambda: replica_counts()[0] >= wanted, 600)
            ready_s = (
                rig.wait("the catalog ready", lambda: replica_counts()[1] >= wanted, 600) + placed_s
            )
            report["placement"] = {
                "replicas": wanted,
                "gpus": sum(s["gpus"] * s["shards"] * s["min"] for s in shapes),
                "placed_s": round(placed_s, 2),
                "ready_s": round(ready_s, 2),
                "ticks": len(rig.tick_runtimes(catalog_at)[0]),
            }
            say(f"catalog: {wanted} replicas placed in {placed_s:.1f}s, ready in {ready_s:.1f}s")

            # 2. steady state
            steady_from = time.time()
            writes0, beats0, commits0 = table_writes(), node_heartbeat_writes(), committed()
            time.sleep(options.steady)
            elapsed = time.time() - steady_from
            writes1, beats1, commits1 = table_writes(), node_heartbeat_writes(), committed()
            ticks, failed = rig.tick_runtimes(steady_from)
            report["steady"] = {
                "seconds": round(elapsed, 1),
                "ticks": len(ticks),
                "ticks_failed": failed,
                "tick_p50_s": round(percentile(ticks, 0.5), 4),
                "tick_p99_s": round(percentile(ticks, 0.99), 4),
                "node_row_writes_per_s": round((beats1 - beats0) / elapsed, 1),
                "row_writes_per_s": {
                    k: round((writes1.get(k, 0) - v) / elapsed, 1)
                    for k, v in writes0.items()
                    if writes1.get(k, 0) != v
                },
                "commits_per_s": round((commits1[0] - commits0[0]) / elapsed, 1),
                "sessions_opened_per_s": round((commits1[1] - commits0[1]) / elapsed, 1),
            }
            say(f"steady: {json.dumps(report['steady'])}")

            # 3. a wave of activations
            cold = [s["name"] for s in shapes if s["min"] == 0][: options.wave]
            wave_from = time.time()
            now = timezone.now()
            ServedModel.objects.filter(name__in=cold).update(demand_at=now, last_request_at=now)
            from control import serving

            serving.request_tick()
            target = wanted + len(cold)
            wave_s = rig.wait("the wave ready", lambda: replica_counts()[1] >= target, 600)
            ticks, failed = rig.tick_runtimes(wave_from)
            report["wave"] = {
                "models": len(cold),
                "ready_s": round(wave_s, 2),
                "ticks": len(ticks),
                "ticks_failed": failed,
                "tick_p50_s": round(percentile(ticks, 0.5), 4),
                "tick_p99_s": round(percentile(ticks, 0.99), 4),
            }
            say(f"wave: {json.dumps(report['wave'])}")

            # 4. a long steady state: memory and connections
            rss: dict[str, list[tuple[float, float]]] = {k: [] for k in rig.web_pids()}
            conns: list[dict[str, int]] = []
            started_at = time.monotonic()
            while True:
                t = time.monotonic() - started_at
                for name, pid in rig.web_pids().items():
                    rss[name].append((t, rss_mib(pid)))
                conns.append(connections_by_app())
                if t >= options.duration:
                    break
                time.sleep(min(10.0, max(1.0, options.duration / 30)))
            web_conns = [
                sum(v for k, v in c.items() if k in ("llmgw-cp1", "llmgw-cp2")) for c in conns
            ]
            report["memory"] = {
                "seconds": round(time.monotonic() - started_at, 1),
                "rss_mib_start": {k: round(v[0][1], 1) for k, v in rss.items()},
                "rss_mib_end": {k: round(v[-1][1], 1) for k, v in rss.items()},
                "rss_slope_mib_per_h": {k: round(slope_per_hour(v), 1) for k, v in rss.items()},
            }
            report["connections"] = {
                "web_max": max(web_conns),
                "by_process_last": conns[-1],
                "by_process_max": {k: max(c.get(k, 0) for c in conns) for k in set().union(*conns)},
            }
            say(f"memory: {json.dumps(report['memory'])}")
            say(f"connections: {json.dumps(report['connections'])}")

            # 5. the reconnect storm
            before = rig.fleet_stats()
            log_from = log_size()
            killed_url = rig.web1.url
            rig.web1.kill()
            rig.worker.kill()
            rig.beat.kill()
            storm_s = rig.wait(
                "every node back and served",
                lambda: (
                    (s := rig.fleet_stats()).get("served", 0) >= n
                    and s.get("connected", 0) >= n
                    and not any(
                        killed_url.replace("http", "ws") in url
                        for url in s.get("connected_by_url", {})
                    )
                ),
                300,
            )
            time.sleep(1)
            after = rig.fleet_stats()
            report["storm"] = {
                "seconds": round(storm_s, 2),
                "refused": after.get("refused", 0) - before.get("refused", 0),
                "reconnections": after.get("connections", 0) - before.get("connections", 0),
                "store_errors": store_errors(log_from, database)[:20],
                "web_connections_after": connections_by_app(),
            }
            say(f"storm: {json.dumps(report['storm'])}")
        finally:
            checker.stop()
            final = rig.fleet_stats()
            report["invariants"] = {
                "store_checks": checker.checks,
                "store_violations": checker.violations[:20],
                "fleet_gpu_conflicts": final.get("gpu_conflicts", []),
                "fleet_stale_rejected": final.get("stale_rejected", 0),
            }
    return report
