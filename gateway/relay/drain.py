"""Graceful stop of one web process, as the request path sees it.

A stop has two steps (``llmgw_site.webserver`` drives them). *Draining* begins at SIGTERM:
the server has stopped accepting connections, ``/healthz`` answers 503 ``draining``, and every
request already in flight runs on. At the end of ``LLMGW_SHUTDOWN_GRACE`` the requests still
running are *cut*: each is cancelled with ``CUT``, and the relay ends it with an OpenAI-shaped
error (an error event on a stream whose headers are out) and records it as interrupted.
"""

from __future__ import annotations

import asyncio

CUT = "llmgw: the web process is stopping and its shutdown grace is over"


class Drain:
    """This process's stop state and the relay requests it would have to cut."""

    def __init__(self) -> None:
        self.draining = False
        self.cut = False
        self.requests: set[asyncio.Task[None]] = set()

    def begin(self) -> None:
        self.draining = True

    def cut_remaining(self) -> int:
        """Cancel every relay request still running; returns how many there were."""
        self.cut = True
        running = [task for task in self.requests if not task.done()]
        for task in running:
            task.cancel(CUT)
        return len(running)


drain = Drain()
