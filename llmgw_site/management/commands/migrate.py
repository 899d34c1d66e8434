"""`manage.py migrate`, one process at a time on a store: Django's own command, holding the
store's start-up lock (``llmgw_site.startup``) while it runs.

Django's ``migrate`` reads which migrations are applied once, then applies the rest: two
processes started together on one store (every host of a deploy running it, two ``manage.py
run`` at once) both apply the first migration, and the second fails half-way. Holding the
lock, the second waits, then finds nothing left to apply.
"""

from __future__ import annotations

from typing import Any

from django.core.management.commands import migrate

from llmgw_site import startup


class Command(migrate.Command):
    def handle(self, *args: Any, **options: Any) -> None:
        with startup.one_at_a_time(options["database"]):
            super().handle(*args, **options)
