"""`manage.py lease`: who leads, at which epoch, for how long; the exit status says whether
this process could lead now (0: yes, 1: another process holds the lease, 2: store unreachable).
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from django.db import DatabaseError

from control import leases


class Command(BaseCommand):
    help = (
        "Show the leadership lease: holder, epoch and time left. Exit 0 if this process could lead."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--name", default=leases.RECONCILER, help="Lease name (default: %(default)s)."
        )

    def handle(self, *args: Any, name: str, **options: Any) -> None:
        try:
            view = leases.read(name)
        except DatabaseError as exc:
            self.stderr.write(f"store unreachable: {type(exc).__name__}: {exc}")
            raise SystemExit(2) from None
        if view is None:
            self.stdout.write(f"lease {name}: never claimed; this process could lead")
            return
        if view.held:
            self.stdout.write(
                f"lease {name}: held by {view.owner}, epoch {view.epoch}, "
                f"{view.expires_in:.1f}s left"
            )
            raise SystemExit(1)
        holder = view.owner or "nobody (released)"
        self.stdout.write(
            f"lease {name}: expired {-view.expires_in:.1f}s ago (last holder {holder}, "
            f"epoch {view.epoch}); this process could lead"
        )
