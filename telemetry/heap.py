"""What this process's memory holds: the largest allocation sites and their growth between two
snapshots (``tracemalloc``, switched on and off while the process runs), objects by type, and
the cyclic collector's statistics.

``tracemalloc`` slows every allocation while it traces (by half or more) and keeps a record of
each one, so it is off until asked for: :func:`start` switches it on and takes the baseline,
:func:`report` compares the heap now with the baseline (growth: what was allocated since and is
still alive, by the traceback that allocated it), :func:`rebase` takes a new baseline and
:func:`stop` switches it off again and drops both.
"""

from __future__ import annotations

import gc
import linecache
import threading
import time
import tracemalloc
from collections import Counter
from pathlib import Path
from typing import Any

DEFAULT_FRAMES = 10
# Tracing's own records, the imports, and what answering costs: the source lines read for the
# reports (linecache keeps them) and this package's own work.
_IGNORED = (
    tracemalloc.Filter(False, tracemalloc.__file__),
    tracemalloc.Filter(False, linecache.__file__),
    tracemalloc.Filter(False, str(Path(__file__).parent / "*")),
    tracemalloc.Filter(False, "<frozen importlib._bootstrap>"),
    tracemalloc.Filter(False, "<frozen importlib._bootstrap_external>"),
    tracemalloc.Filter(False, "<unknown>"),
)

_lock = threading.Lock()
_baseline: tracemalloc.Snapshot | None = None
_baseline_at = 0.0


def _snapshot() -> tracemalloc.Snapshot:
    return tracemalloc.take_snapshot().filter_traces(_IGNORED)


def start(frames: int = DEFAULT_FRAMES) -> dict[str, Any]:
    """Trace allocations from now on, keeping ``frames`` frames of each, and take the baseline
    (already tracing: nothing changes)."""
    global _baseline, _baseline_at
    with _lock:
        if not tracemalloc.is_tracing():
            tracemalloc.start(max(1, min(frames, 100)))
            _baseline, _baseline_at = _snapshot(), time.monotonic()
    return status()


def rebase() -> dict[str, Any]:
    """The heap now becomes the baseline that growth is measured from."""
    global _baseline, _baseline_at
    with _lock:
        if tracemalloc.is_tracing():
            _baseline, _baseline_at = _snapshot(), time.monotonic()
    return status()


def stop() -> dict[str, Any]:
    """Stop tracing and forget what was traced."""
    global _baseline
    with _lock:
        tracemalloc.stop()
        _baseline = None
    return status()


def status() -> dict[str, Any]:
    tracing = tracemalloc.is_tracing()
    current, peak = tracemalloc.get_traced_memory() if tracing else (0, 0)
    return {
        "tracing": tracing,
        "frames": tracemalloc.get_traceback_limit() if tracing else 0,
        "traced_bytes": current,
        "traced_peak_bytes": peak,
        # What tracing itself costs in memory: its own records of every allocation.
        "overhead_bytes": tracemalloc.get_tracemalloc_memory() if tracing else 0,
        "baseline_age_s": round(time.monotonic() - _baseline_at, 1) if _baseline else None,
    }


def _frames(traceback: tracemalloc.Traceback) -> list[dict[str, Any]]:
    # Outermost first, as a traceback prints (and as tracemalloc keeps them).
    return [
        {
            "file": f.filename,
            "line": f.lineno,
            "code": linecache.getline(f.filename, f.lineno).strip(),
        }
        for f in traceback
    ]


def report(top: int = 20) -> dict[str, Any]:
    """The largest allocation sites now, and the tracebacks that grew most since the baseline;
    only the status while not tracing."""
    with _lock:
        baseline = _baseline
        if not tracemalloc.is_tracing() or baseline is None:
            return {**status(), "sites": [], "growth": []}
        now = _snapshot()
    sites = [
        {"size": s.size, "count": s.count, "frames": _frames(s.traceback)}
        for s in now.statistics("lineno")[:top]
    ]
    growth = [
        {
            "size_diff": d.size_diff,
            "count_diff": d.count_diff,
            "size": d.size,
            "count": d.count,
            "frames": _frames(d.traceback),
        }
        for d in [d for d in now.compare_to(baseline, "traceback") if d.size_diff > 0][:top]
    ]
    return {**status(), "sites": sites, "growth": growth}


def _type_name(kind: type) -> str:
    module = kind.__module__
    return kind.__qualname__ if module == "builtins" else f"{module}.{kind.__qualname__}"


def objects(top: int = 30) -> dict[str, Any]:
    """The commonest types among the objects the collector tracks, and its statistics.

    Objects frozen at start-up (``gc.freeze``) are out of the count, as are those it never
    tracks (numbers, strings): what grows since start-up is what shows. Counting visits every
    tracked object with the GIL held, a few tens of milliseconds in a web process."""
    counts = Counter(_type_name(type(o)) for o in gc.get_objects())
    return {
        "tracked": sum(counts.values()),
        "types": [{"type": name, "count": count} for name, count in counts.most_common(top)],
        "gc": collector(),
    }


def collector() -> dict[str, Any]:
    """The cyclic collector: on or off, its thresholds, the counts towards the next collection
    of each generation, the frozen objects, and each generation's collections so far."""
    return {
        "enabled": gc.isenabled(),
        "thresholds": list(gc.get_threshold()),
        "counts": list(gc.get_count()),
        "frozen": gc.get_freeze_count(),
        "generations": gc.get_stats(),
    }
