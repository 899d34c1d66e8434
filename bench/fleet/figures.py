"""The fleet benchmark's figures against their goals, and the table printed."""

from __future__ import annotations

from typing import Any

GOALS = {
    "tick_p99_s": 1.0,
    "tick_p50_s": 0.25,
    "storm_s": 30.0,
    "placement_s": 60.0,
}


def summarize(report: dict[str, Any]) -> list[tuple[str, str, str, bool | None]]:
    rows: list[tuple[str, str, str, bool | None]] = []
    steady, wave = report.get("steady", {}), report.get("wave", {})
    if steady:
        rows.append(
            (
                "reconcile tick, steady, p50 / p99",
                f"{steady['tick_p50_s'] * 1000:.0f} / {steady['tick_p99_s'] * 1000:.0f} ms",
                "< 250 / < 1000 ms",
                steady["tick_p50_s"] < GOALS["tick_p50_s"]
                and steady["tick_p99_s"] < GOALS["tick_p99_s"],
            )
        )
        rows.append(
            (
                "heartbeat (node row) writes at the store",
                f"{steady['node_row_writes_per_s']:.1f}/s",
                "",
                None,
            )
        )
        rows.append(("commits at the store", f"{steady['commits_per_s']:.1f}/s", "", None))
        rows.append(
            (
                "connections opened at the store",
                f"{steady['sessions_opened_per_s']:.1f}/s",
                "",
                None,
            )
        )
    if wave:
        rows.append(
            (
                f"reconcile tick, wave of {wave['models']}, p50 / p99",
                f"{wave['tick_p50_s'] * 1000:.0f} / {wave['tick_p99_s'] * 1000:.0f} ms",
                "< 250 / < 1000 ms",
                wave["tick_p50_s"] < GOALS["tick_p50_s"]
                and wave["tick_p99_s"] < GOALS["tick_p99_s"],
            )
        )
        rows.append(
            (f"wave of {wave['models']} activations ready", f"{wave['ready_s']:.1f} s", "", None)
        )
    placement = report.get("placement")
    if placement:
        rows.append(
            (
                f"catalog from empty ({placement['replicas']} replicas) placed / ready",
                f"{placement['placed_s']:.1f} / {placement['ready_s']:.1f} s",
                "< 60 s",
                placement["ready_s"] < GOALS["placement_s"],
            )
        )
    conns = report.get("connections")
    if conns:
        rows.append(("DB connections held by web processes (max)", str(conns["web_max"]), "", None))
    memory = report.get("memory")
    if memory:
        slopes = ", ".join(f"{k} {v:+.1f}" for k, v in memory["rss_slope_mib_per_h"].items())
        ends = ", ".join(f"{k} {v:.0f}" for k, v in memory["rss_mib_end"].items())
        rows.append((f"web RSS after {memory['seconds']:.0f}s (MiB)", ends, "", None))
        rows.append(("web RSS slope (MiB/hour)", slopes, "flat", None))
    storm = report.get("storm")
    if storm:
        rows.append(
            (
                "reconnect storm: all back and served",
                f"{storm['seconds']:.1f} s, {storm['refused']} refused, "
                f"{len(storm['store_errors'])} store errors",
                "< 30 s, 0, 0",
                storm["seconds"] < GOALS["storm_s"]
                and storm["refused"] == 0
                and not storm["store_errors"],
            )
        )
    inv = report.get("invariants", {})
    bad = len(inv.get("store_violations", [])) + len(inv.get("fleet_gpu_conflicts", []))
    rows.append(("double allocations seen", str(bad), "0", bad == 0))
    return rows


def print_table(report: dict[str, Any]) -> None:
    print(f"\n{'figure':56} {'measured':40} {'goal':18} reached")
    for figure, measured, goal, ok in summarize(report):
        mark = "" if ok is None else ("yes" if ok else "NO")
        print(f"{figure:56} {measured:40} {goal:18} {mark}")
