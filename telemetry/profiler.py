"""A sampling CPU profiler in pure Python: a thread that looks at every other thread's stack
about a hundred times a second for the seconds asked, and nothing at all otherwise.

Chosen over py-spy (which reads another process's memory: ptrace rights, a binary to install
on every host) and over ``cProfile`` (which instruments every call of the profiled process,
slowing it several times over while it runs): the sampler costs only while a profile is
taken, a few per cent of one core at 100 Hz, and costs nothing when idle because it does not
exist then. What it cannot see is time spent in C without the GIL released to it; a thread
holding the GIL in one long C call delays the samples (the ``samples`` count says so).

A *CPU* profile: each sample of a thread is weighted by the CPU that thread consumed since
the previous sample (its own CPU clock, ``pthread_getcpuclockid``), so threads that wait
(a worker pool's idle threads, a loop in ``epoll_wait``) weigh nothing. ``wall`` mode weighs
every sample alike instead: where the threads *are*, busy or not. Either way the result is in
the "folded" format (``frame;frame;frame weight``, root first) that flame graph tools read,
weights in microseconds.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from types import CodeType, FrameType
from typing import Any

MODES = ("cpu", "wall")
DEFAULT_HZ = 100.0
_MAX_DEPTH = 256


def _label(code: CodeType, short: dict[str, str]) -> str:
    """``qualified.name (path)``, the path relative to where it was imported from."""
    filename = code.co_filename
    path = short.get(filename)
    if path is None:
        path = filename
        for root in sorted((p for p in sys.path if p), key=len, reverse=True):
            if filename.startswith(root.rstrip(os.sep) + os.sep):
                path = filename[len(root.rstrip(os.sep)) + 1 :]
                break
        short[filename] = path
    # The folded format separates frames with ";" (and the weight with the line's last space).
    return f"{code.co_qualname} ({path})".replace(";", ":")


def _folded(
    thread: str, frame: FrameType | None, labels: dict[CodeType, str], short: dict[str, str]
) -> str:
    names: list[str] = []
    while frame is not None and len(names) < _MAX_DEPTH:
        code = frame.f_code
        label = labels.get(code)
        if label is None:
            label = labels[code] = _label(code, short)
        names.append(label)
        frame = frame.f_back
    names.append(thread.replace(";", ":"))
    names.reverse()
    return ";".join(names)


def _cpu_clock(ident: int) -> int | None:
    try:
        return time.pthread_getcpuclockid(ident)
    except (AttributeError, OSError):
        return None


def profile(
    seconds: float, *, hz: float = DEFAULT_HZ, mode: str = "cpu", unseen: str = ""
) -> dict[str, Any]:
    """Sample every other thread of this process for ``seconds`` (but those whose names start
    with ``unseen``: the profiler's own company); the folded stacks."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}")
    if mode == "cpu" and not hasattr(time, "pthread_getcpuclockid"):
        mode = "wall"  # no per-thread CPU clocks here: where the threads are is what is left
    me = threading.get_ident()
    interval = 1.0 / hz
    wall_weight = round(interval * 1e6)
    folded: Counter[str] = Counter()
    labels: dict[CodeType, str] = {}
    short: dict[str, str] = {}
    clocks: dict[int, int | None] = {}
    spent: dict[int, int] = {}
    samples = 0
    started = time.monotonic()
    due = started
    while True:
        due += interval
        pause = due - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        if time.monotonic() - started >= seconds:
            break
        samples += 1
        names = {thread.ident: thread.name for thread in threading.enumerate()}
        current = sys._current_frames()
        for ident, frame in current.items():
            name = names.get(ident, f"thread {ident}")
            if ident == me or (unseen and name.startswith(unseen)):
                continue
            weight = wall_weight
            if mode == "cpu":
                if ident not in clocks:
                    clocks[ident] = _cpu_clock(ident) if ident in names else None
                clock = clocks[ident]
                if clock is None:
                    continue
                try:
                    now = time.clock_gettime_ns(clock)
                except OSError:  # the thread ended between the two looks
                    clocks[ident] = None
                    continue
                before = spent.get(ident)
                spent[ident] = now
                weight = (now - before) // 1000 if before is not None else 0
                if weight <= 0:
                    continue
            folded[_folded(name, frame, labels, short)] += weight
        del current  # the frames keep their locals alive until the next look
    return {
        "mode": mode,
        "hz": hz,
        "seconds": round(time.monotonic() - started, 3),
        "samples": samples,
        "expected_samples": int(seconds * hz),
        "unit": "microseconds",
        "folded": dict(folded),
    }


def merged(profiles: Iterable[tuple[str, Mapping[str, int]]]) -> dict[str, int]:
    """Several processes' folded stacks as one, each under a root frame naming its process."""
    out: Counter[str] = Counter()
    for process, folded in profiles:
        root = process.replace(";", ":")
        for stack, weight in folded.items():
            out[f"{root};{stack}"] += int(weight)
    return dict(out)


def folded_text(folded: Mapping[str, int]) -> str:
    """The folded format's text: one ``stack weight`` a line (speedscope, flamegraph.pl and
    inferno read it)."""
    return "".join(f"{stack} {weight}\n" for stack, weight in sorted(folded.items()))


def hottest(folded: Mapping[str, int], top: int = 25) -> list[tuple[str, int, int]]:
    """(frame, self weight, total weight) of the frames that weigh most by themselves."""
    own: Counter[str] = Counter()
    total: Counter[str] = Counter()
    for stack, weight in folded.items():
        frames = stack.split(";")
        own[frames[-1]] += weight
        for name in set(frames):
            total[name] += weight
    return [(name, weight, total[name]) for name, weight in own.most_common(top)]
