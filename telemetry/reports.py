"""Every process's diagnostic answers (``telemetry.diagnostics.gather``) as text to read in a
shell or a browser tab: ``manage.py diagnose`` prints these, the admin's diagnostics page
serves the same as ``.txt``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from telemetry import flamegraph, profiler

Answers = Sequence[Mapping[str, Any]]


def _size(value: object) -> str:
    """A size in bytes, in the unit that reads best."""
    if not isinstance(value, int | float):
        return "-"
    if abs(value) >= 2**20:
        return f"{value / 2**20:.1f} MiB"
    return f"{value / 2**10:.1f} KiB" if abs(value) >= 2**10 else f"{value:.0f} B"


def _ms(value: object) -> str:
    return f"{value:.1f}" if isinstance(value, int | float) else "-"


def heading(answer: Mapping[str, Any]) -> str:
    return f"{answer.get('role', '?')} pid {answer.get('pid', '?')} on {answer.get('host', '?')}"


def _failed(answers: Answers) -> list[str]:
    return [f"{heading(a)}: {a['error']}" for a in answers if "error" in a]


def _answered(answers: Answers) -> Iterable[Mapping[str, Any]]:
    return (a for a in answers if "answer" in a)


def processes(answers: Answers) -> str:
    """One line a process: memory, threads, event-loop lag, connections, tracing."""
    if not answers:
        return "no llmgw process answers on this host (diagnostics off, or none running)\n"
    lines = [
        f"{'process':10} {'pid':>8} {'up s':>9} {'RSS':>11} {'peak':>11} {'threads':>8} "
        f"{'lag ms last/max':>16}  connections"
    ]
    for a in _answered(answers):
        info = a["answer"]
        lag = info.get("loop_lag") or {}
        lag_text = f"{_ms(lag.get('last_ms'))}/{_ms(lag.get('max_ms'))}" if lag else "no loop"
        threads = info["threads"]
        conns = ", ".join(
            f"{c['name']} {c['open'] if c['open'] is not None else '?'}"
            for c in info.get("connections", [])
        )
        tracing = "  [tracemalloc on]" if info.get("tracemalloc") else ""
        memory = info["memory"]
        lines.append(
            f"{a['role']:10} {a['pid']:>8} {info['uptime_s']:>9.0f} "
            f"{_size(memory['rss_bytes']):>11} {_size(memory['rss_peak_bytes']):>11} "
            f"{threads['python']:>3}/{threads['os'] or '?':<4} {lag_text:>16}  {conns}{tracing}"
        )
    return "\n".join([*lines, *_failed(answers), ""])


def _frame_lines(frames: Iterable[Mapping[str, Any]]) -> list[str]:
    out: list[str] = []
    for frame in frames:
        out.append(f'    File "{frame["file"]}", line {frame["line"]}, in {frame["function"]}')
        if frame.get("code"):
            out.append(f"      {frame['code']}")
    return out


def stacks(answers: Answers) -> str:
    """Each process's threads and tasks, as tracebacks print."""
    lines: list[str] = []
    for a in _answered(answers):
        snapshot = a["answer"]
        lines.append(f"=== {heading(a)}")
        for thread in snapshot["threads"]:
            daemon = ", daemon" if thread.get("daemon") else ""
            lines.append(f"  Thread {thread['name']} (native id {thread['native_id']}{daemon})")
            lines.extend(_frame_lines(thread["frames"]))
        for task in snapshot["tasks"]:
            lines.append(f"  Task {task['name']} ({task['coroutine']})")
            lines.extend(_frame_lines(task["frames"]))
            if task.get("awaiting"):
                lines.append(f"    awaiting a {task['awaiting']}")
        lines.append("")
    return "\n".join([*lines, *_failed(answers), ""])


def _where(frames: Sequence[Mapping[str, Any]]) -> list[str]:
    # Innermost first: where the memory was allocated, then who called.
    return [
        f"      {f['file']}:{f['line']}  {f.get('code', '')}".rstrip() for f in reversed(frames)
    ]


def heap(answers: Answers, *, depth: int = 6) -> str:
    """Each process's tracing, largest allocation sites and growth since the baseline."""
    lines: list[str] = []
    for a in _answered(answers):
        report = a["answer"]
        lines.append(f"=== {heading(a)}")
        if not report.get("tracing"):
            lines += ["  tracemalloc is off (start it to see allocation sites and growth)", ""]
            continue
        lines.append(
            f"  traced {_size(report['traced_bytes'])} (peak {_size(report['traced_peak_bytes'])}),"
            f" tracing costs {_size(report['overhead_bytes'])}, baseline "
            f"{report['baseline_age_s']} s ago"
        )
        lines.append("  largest allocation sites:")
        for site in report.get("sites", []):
            where = site["frames"][-1] if site["frames"] else {"file": "?", "line": 0}
            lines.append(
                f"    {_size(site['size']):>11} {site['count']:>9} blocks  "
                f"{where['file']}:{where['line']}  {where.get('code', '')}".rstrip()
            )
        lines.append("  growth since the baseline:")
        for grown in report.get("growth", []):
            lines.append(
                f"    +{_size(grown['size_diff'])} (+{grown['count_diff']} blocks), now "
                f"{_size(grown['size'])} in {grown['count']} blocks, allocated at:"
            )
            lines.extend(_where(grown["frames"])[:depth])
        lines.append("")
    return "\n".join([*lines, *_failed(answers), ""])


def objects(answers: Answers) -> str:
    """Each process's commonest object types and its collector's statistics."""
    lines: list[str] = []
    for a in _answered(answers):
        report = a["answer"]
        collector = report["gc"]
        lines.append(f"=== {heading(a)}: {report['tracked']} tracked objects")
        lines.append(
            f"  gc {'on' if collector['enabled'] else 'OFF'}, thresholds "
            f"{collector['thresholds']}, counts {collector['counts']}, "
            f"frozen {collector['frozen']}"
        )
        for generation, stats in enumerate(collector["generations"]):
            lines.append(
                f"  generation {generation}: {stats['collections']} collections, "
                f"{stats['collected']} collected, {stats['uncollectable']} uncollectable"
            )
        lines.extend(f"  {t['count']:>9}  {t['type']}" for t in report["types"])
        lines.append("")
    return "\n".join([*lines, *_failed(answers), ""])


def profile(folded: Mapping[str, int], answers: Answers, *, top: int = 25) -> str:
    """The frames that took the most CPU by themselves, over every process profiled."""
    lines = [
        f"{heading(a)}: {a['answer']['samples']} samples in {a['answer']['seconds']} s "
        f"({a['answer']['mode']})"
        for a in _answered(answers)
    ]
    total = max(1, sum(folded.values()))
    lines.append(f"\n{'self ms':>10} {'self %':>7} {'total ms':>10}  frame")
    for name, own, whole in profiler.hottest(folded, top):
        lines.append(f"{own / 1000:>10.1f} {own / total:>7.1%} {whole / 1000:>10.1f}  {name}")
    return "\n".join([*lines, *_failed(answers), ""])


def merged_profile(answers: Answers) -> dict[str, int]:
    """The answered processes' profiles as one, each under its own root."""
    return profiler.merged(
        (f"{a['role']} {a['pid']}", a["answer"]["folded"]) for a in _answered(answers)
    )


def flame_graph(answers: Answers, *, mode: str, seconds: float) -> str:
    """The answered processes' profiles as one flame graph (SVG), each process a tower."""
    names = ", ".join(heading(a) for a in _answered(answers))
    return flamegraph.svg(
        merged_profile(answers),
        title=f"llmgw {mode} profile, {seconds:g} s",
        subtitle=f"{names} (hover a box for its time)" if names else "no process answered",
    )
