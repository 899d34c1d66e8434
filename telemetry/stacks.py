"""The stack of every thread of this process, and the await chain of every asyncio task of its
event loop, now: what ``py-spy dump`` shows, from inside, without ptrace or a dependency.

Read from another thread (the diagnostics channel's) while the others run on: a thread's
frames come from ``sys._current_frames()``, a task's from its coroutine's ``cr_await`` chain
(``Task.get_stack`` gives only a suspended task's outermost frame). Both are plain data, each
frame outermost first, as a traceback prints them.
"""

from __future__ import annotations

import asyncio
import linecache
import sys
import threading
from types import FrameType
from typing import Any, TypedDict

# A task awaiting this deep is a runaway recursion: what is shown is enough to say so.
_AWAIT_DEPTH = 128


class Frame(TypedDict):
    file: str
    line: int
    function: str
    code: str


def frame_of(frame: FrameType) -> Frame:
    code = frame.f_code
    line = frame.f_lineno or 0
    return {
        "file": code.co_filename,
        "line": line,
        "function": code.co_qualname,
        "code": linecache.getline(code.co_filename, line).strip(),
    }


def _outermost_first(frame: FrameType | None) -> list[Frame]:
    frames: list[Frame] = []
    while frame is not None:
        frames.append(frame_of(frame))
        frame = frame.f_back
    frames.reverse()
    return frames


def threads() -> list[dict[str, Any]]:
    """Every Python thread of this process (the caller's included) and where it is now."""
    named = {thread.ident: thread for thread in threading.enumerate()}
    out: list[dict[str, Any]] = []
    for ident, frame in sys._current_frames().items():
        thread = named.get(ident)
        out.append(
            {
                "ident": ident,
                "name": thread.name if thread else f"thread {ident}",
                "native_id": thread.native_id if thread else None,
                "daemon": thread.daemon if thread else None,
                "frames": _outermost_first(frame),
            }
        )
    out.sort(key=lambda thread: (thread["name"] != "MainThread", str(thread["name"])))
    return out


def _await_chain(awaitable: Any) -> tuple[list[Frame], str | None]:
    """The frames of a coroutine and of what it awaits, down to the innermost; and, where the
    chain ends in something that is no coroutine (a Future, a C awaitable), its type."""
    frames: list[Frame] = []
    while awaitable is not None and len(frames) < _AWAIT_DEPTH:
        frame = next(
            (
                getattr(awaitable, name)
                for name in ("cr_frame", "gi_frame", "ag_frame")
                if getattr(awaitable, name, None) is not None
            ),
            None,
        )
        if frame is None:
            return frames, type(awaitable).__name__
        frames.append(frame_of(frame))
        awaitable = next(
            (
                getattr(awaitable, name)
                for name in ("cr_await", "gi_yieldfrom", "ag_await")
                if getattr(awaitable, name, None) is not None
            ),
            None,
        )
    return frames, None


def tasks(loop: asyncio.AbstractEventLoop | None) -> list[dict[str, Any]]:
    """Every pending task of ``loop`` and its await chain (none without a loop)."""
    if loop is None or loop.is_closed():
        return []
    out: list[dict[str, Any]] = []
    for task in asyncio.all_tasks(loop):
        coro = task.get_coro()
        frames, awaiting = _await_chain(coro)
        out.append(
            {
                "name": task.get_name(),
                "coroutine": getattr(coro, "__qualname__", type(coro).__name__),
                "frames": frames,
                "awaiting": awaiting,
            }
        )
    out.sort(key=lambda task: str(task["name"]))
    return out


def snapshot(loop: asyncio.AbstractEventLoop | None) -> dict[str, Any]:
    """Threads and tasks, now."""
    return {"threads": threads(), "tasks": tasks(loop)}
