"""Waiting for an outcome: poll with a generous deadline, never sleep and hope."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_until(
    check: Callable[[], Any], timeout: float = 15.0, what: str = "", interval: float = 0.05
) -> Any:
    """Poll ``check`` until it returns something truthy, and return that; fail after
    ``timeout`` seconds naming ``what`` and the last result."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what or check}; last: {last!r}")
