"""Waiting for an outcome: poll with a generous deadline, never sleep and hope.

The deadline only bounds a hang; a loaded machine makes a wait longer, never a test red. On
timeout the message names what was awaited, the last value seen, and the log tails of the
processes involved. A wait may also name processes that must stay up meanwhile: one that exits
ends the wait at once, with its log, rather than at the deadline.

These two functions are the one way to wait in the tests and the benchmarks, in a thread
(:func:`wait_until`) and on an event loop (:func:`await_until`); a helper that waits for
something in particular says what it waits for and calls one of them.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any, Literal, TypeVar

if TYPE_CHECKING:
    from tests.harness.procs import Proc

T = TypeVar("T")

# Generous: long enough for a machine whose cores are all busy with something else.
TIMEOUT = 60.0


def _failure(timeout: float, what: str, last: Any, logs: Iterable[Proc]) -> AssertionError:
    tails = "".join(f"\n--- {p.name} ({p.log_path}) ---\n{p.tail()}" for p in logs)
    return AssertionError(f"timed out after {timeout:g}s waiting for {what}; last: {last!r}{tails}")


def _still_running(running: Iterable[Proc], what: str) -> None:
    for proc in running:
        if not proc.running():
            code = proc.popen.returncode if proc.popen else None
            raise AssertionError(
                f"{proc.name} exited ({code}) while waiting for {what}:\n{proc.tail()}"
            )


def wait_until(
    check: Callable[[], T | Literal[False] | None],
    timeout: float = TIMEOUT,
    what: str = "",
    *,
    interval: float = 0.05,
    logs: Iterable[Proc] = (),
    running: Iterable[Proc] = (),
) -> T:
    """Poll ``check`` until it returns something truthy, and return that. ``logs``: whose log
    tails a timeout shows; ``running``: processes that must not exit meanwhile."""
    deadline = time.monotonic() + timeout
    what = what or getattr(check, "__name__", "it")
    last: Any = None
    while True:
        # Before the check: an answer from a port the exited process never held is not its.
        _still_running(running, what)
        last = check()
        if last:
            return last  # type: ignore[no-any-return]
        if time.monotonic() > deadline:
            raise _failure(timeout, what, last, logs)
        time.sleep(interval)


async def await_until(
    check: Callable[[], Any] | Callable[[], Awaitable[Any]],
    timeout: float = TIMEOUT,
    what: str = "",
    *,
    interval: float = 0.05,
    logs: Iterable[Proc] = (),
    running: Iterable[Proc] = (),
) -> Any:
    """The twin of :func:`wait_until` for a running event loop; ``check`` may be a coroutine
    function."""
    deadline = time.monotonic() + timeout
    what = what or getattr(check, "__name__", "it")
    last: Any = None
    while True:
        _still_running(running, what)
        last = check()
        if inspect.isawaitable(last):
            last = await last
        if last:
            return last
        if time.monotonic() > deadline:
            raise _failure(timeout, what, last, logs)
        await asyncio.sleep(interval)
