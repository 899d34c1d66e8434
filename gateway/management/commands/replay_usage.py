"""``manage.py replay_usage``: write the usage rows left in the journals of web processes that
are gone (``kill -9``, power loss), closing their in-flight requests as interrupted.

Web processes do this themselves in the background; ``manage.py run`` can call it once before
starting them so rows are complete before the first request arrives.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandParser

from gateway.ledger import usage


class Command(BaseCommand):
    help = "Replay the usage journals of web processes that are no longer running."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--dir",
            type=Path,
            default=None,
            help="The journal folder (default: LLMGW_USAGE_JOURNAL_DIR).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        replayed = usage.sweep(options["dir"] or settings.LLMGW_USAGE_JOURNAL_DIR)
        self.stdout.write(f"{replayed} usage rows replayed")
