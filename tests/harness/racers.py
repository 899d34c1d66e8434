"""Threads let go at the same instant: one function raced against itself, as processes started
together would run it (each thread has a store connection of its own)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from django.db import connection

T = TypeVar("T")


def at_once(count: int, body: Callable[[], T]) -> list[T | Exception]:
    """Run ``body`` in ``count`` threads released together; what each returned or raised."""
    barrier = threading.Barrier(count)
    outcomes: list[T | Exception] = []

    def racer() -> None:
        barrier.wait()
        try:
            outcomes.append(body())
        except Exception as exc:
            outcomes.append(exc)
        finally:
            connection.close()  # this thread's own

    threads = [threading.Thread(target=racer) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes
