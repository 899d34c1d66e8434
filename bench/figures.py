"""``make bench``'s figures: each measured against its goal, and the table printed."""

from __future__ import annotations

import statistics
from typing import Any

from bench.load import KNEE_TARGETS


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
        diagnostics_row(report),
        ("stock Django handler + middleware vs ours, p50", f"{stock * 1000:+.0f} us", "", None),
        (
            "cold start overhead (first token - engine start)",
            f"{cold:.2f} s",
            "<= 1.5 s",
            cold <= 1.5,
        ),
        (
            "routing decision CPU, 32,000-character prompt",
            f"{report['routing']['decision_cpu_us']:.1f} us"
            f" (held too: {report['routing']['held_cpu_us']:.1f}; load alone:"
            f" {report['routing']['least_outstanding']['cpu_us_per_request']:.1f})",
            "<= 30 us",
            report["routing"]["decision_cpu_us"] <= 30,
        ),
        *tracing_rows(report),
        *server_rows(report),
        *baseline_rows(report),
        *litellm_rows(report),
        (
            "leader killed: new leader / next placement",
            f"{failover['new_leader_after_s']:.1f} / {failover['placement_after_s']:.1f} s",
            "",
            None,
        ),
    ]


def diagnostics_row(report: dict[str, Any]) -> tuple[str, str, str, bool | None]:
    """L2 with the processes' diagnostics available (the default) against L2 without: their
    channel's thread waits in accept() and the event loop runs one lag callback every half
    second, so the request path should not tell them apart."""
    on, off = report["latency"]["L2"], report["latency"]["L2-no-diagnostics"]
    p50_us = (on["p50_ms"] - off["p50_ms"]) * 1000
    cpu = on["cpu_ms_per_request"] / off["cpu_ms_per_request"] - 1
    rss = report["diagnostics_rss_mib"]
    return (
        "diagnostics available vs off: p50, CPU/req, RSS",
        f"{p50_us:+.0f} us, {cpu:+.1%}, {rss['L2'] - rss['L2-no-diagnostics']:+.1f} MiB",
        "<= +20 us, <= +5%",
        p50_us <= 20 and cpu <= 0.05,
    )


def tracing_rows(report: dict[str, Any]) -> list[tuple[str, str, str, bool | None]]:
    """What traces cost a request's web process (its exporting thread included): on against
    off, and off against the code before tracing came (``BENCH_BASELINE``, when given)."""
    cpu = {name: row["cpu_ms_per_request"] for name, row in report["latency"].items()}
    off = cpu["L2"]
    rows: list[tuple[str, str, str, bool | None]] = []
    if "L2-traced" in cpu:
        on, sampled = cpu["L2-traced"], cpu["L2-traced-1%"]
        rows.append(
            (
                "tracing on (all / 1% sampled) vs off, CPU/req",
                f"{on:.3f} / {sampled:.3f} / {off:.3f} ms"
                f" ({(on - off) * 1000:+.0f} / {(sampled - off) * 1000:+.0f} us)",
                "",
                None,
            )
        )
    if "L2-baseline" in cpu:
        before = cpu["L2-baseline"]
        rows.append(
            (
                "tracing off vs before it (BENCH_BASELINE), CPU/req",
                f"{off:.3f} / {before:.3f} ms ({(off - before) * 1000:+.0f} us)",
                "",
                None,
            )
        )
    return rows


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


def baseline_rows(report: dict[str, Any]) -> list[tuple[str, str, str, bool | None]]:
    """L2 and L2-baseline (the same web process on an earlier tree's code) side by side, each
    figure as L2's / the baseline's and the difference, when the run had a baseline."""
    lat, stream = report["latency"], report["streaming"]
    if "L2-baseline" not in lat:
        return []
    ours, theirs = lat["L2"], lat["L2-baseline"]
    l0 = lat["L0"]

    def pair(now: float, then: float, unit: str = "ms") -> str:
        """L2's / the baseline's, and L2's minus the baseline's in microseconds."""
        if unit == "ms":
            return f"{now:.3f} / {then:.3f} ms, {(now - then) * 1000:+.0f} us"
        return f"{now:.1f} / {then:.1f} {unit}, {now - then:+.1f} {unit}"

    # Each round's p50 L2 minus the baseline's: both took their turns in it, one after the
    # other, so the round's drift hits both; their spread is the noise of the difference.
    paired = [
        (a - b) * 1000 for a, b in zip(ours["p50_rounds_ms"], theirs["p50_rounds_ms"], strict=True)
    ]
    knees = report["throughput"]["knee_rps"]
    knee_now, knee_then = knees.get("L2", 0), knees.get("L2-baseline", 0)
    s0, s2, sb = stream["L0"], stream["L2"], stream["L2-baseline"]
    figures = [
        ("added p50 c=1", pair(ours["p50_ms"] - l0["p50_ms"], theirs["p50_ms"] - l0["p50_ms"])),
        (
            "p50 per round: median (range)",
            f"{statistics.median(paired):+.0f} us ({min(paired):+.0f} to {max(paired):+.0f})",
        ),
        ("added p99 c=1", pair(ours["p99_ms"] - l0["p99_ms"], theirs["p99_ms"] - l0["p99_ms"])),
        ("CPU per request", pair(ours["cpu_ms_per_request"], theirs["cpu_ms_per_request"])),
        (
            "added TTFT p99 (stream)",
            pair(s2["ttft_p99_ms"] - s0["ttft_p99_ms"], sb["ttft_p99_ms"] - s0["ttft_p99_ms"]),
        ),
        ("gap between chunks p99", pair(s2["gap_p99_ms"], sb["gap_p99_ms"])),
        ("CPU per relayed SSE event", pair(s2["cpu_us_per_event"], sb["cpu_us_per_event"], "us")),
        (
            "throughput knee",
            f"{knee_now} / {knee_then} rps"
            + (f" = {knee_now / knee_then:.2f}" if knee_then else ""),
        ),
    ]
    return [(f"L2 vs L2-baseline: {figure}", measured, "", None) for figure, measured in figures]


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
    if "baseline" in report:
        told = report["baseline"]
        print(f"\nL2-baseline: the code in {told['dir']} at {told['commit']}; {told['store']}")
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
