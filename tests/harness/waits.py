"""Waiting for an outcome: poll with a generous deadline, never sleep and hope.

The deadline only bounds a hang; a loaded machine makes a wait longer, never a test red. On
timeout the message names what was awaited, the last value seen, and the log tails of the
processes involved.
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


def wait_until(
    check: Callable[[], T | Literal[False] | None],
    timeout: float = TIMEOUT,
    what: str = "",
    *,
    interval: float = 0.05,
    logs: Iterable[Proc] = (),
) -> T:
    """Poll ``check`` until it returns something truthy, and return that."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        last = check()
        if last:
            return last  # type: ignore[no-any-return]
        if time.monotonic() > deadline:
            raise _failure(timeout, what or getattr(check, "__name__", "it"), last, logs)
        time.sleep(interval)


async def await_until(
    check: Callable[[], Any] | Callable[[], Awaitable[Any]],
    timeout: float = TIMEOUT,
    what: str = "",
    *,
    interval: float = 0.05,
    logs: Iterable[Proc] = (),
) -> Any:
    """The twin of :func:`wait_until` for a running event loop; ``check`` may be a coroutine
    function."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        last = check()
        if inspect.isawaitable(last):
            last = await last
        if last:
            return last
        if time.monotonic() > deadline:
            raise _failure(timeout, what or getattr(check, "__name__", "it"), last, logs)
        await asyncio.sleep(interval)
