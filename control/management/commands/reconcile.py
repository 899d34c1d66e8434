"""`manage.py reconcile --once | --loop`: the reconciler tick without Celery."""

from __future__ import annotations

import signal
import threading
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from control.reconciler.runner import process_reconciler, run_loop
from telemetry import tracing


class Command(BaseCommand):
    help = (
        "Run the reconciler: one tick (--once) or every LLMGW_RECONCILE_INTERVAL seconds "
        "until SIGTERM/Ctrl-C (--loop). Acts only while this process holds the lease."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        mode = parser.add_mutually_exclusive_group(required=True)
        mode.add_argument("--once", action="store_true", help="Run one tick and exit.")
        mode.add_argument("--loop", action="store_true", help="Tick until stopped.")
        parser.add_argument(
            "--interval",
            type=float,
            default=None,
            help="Seconds between ticks (default: LLMGW_RECONCILE_INTERVAL).",
        )

    def handle(
        self, *args: Any, once: bool, loop: bool, interval: float | None, **opts: Any
    ) -> None:
        tracing.start("reconciler")  # exports at exit (telemetry.tracing's atexit hook)
        if once:
            result = process_reconciler().run_once()
            process_reconciler().shutdown()
            if not result.acted:
                raise CommandError("did not act: another process leads, or the store is down")
            self.stdout.write(
                f"tick done (epoch {result.epoch}): {result.placed} placed, "
                f"{result.changed} changed"
            )
            return
        interval = interval if interval is not None else settings.LLMGW_RECONCILE_INTERVAL
        if interval <= 0:
            raise CommandError("--interval must be positive")
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        run_loop(interval, stop)
