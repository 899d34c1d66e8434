"""``manage.py restart_replica ID...``: start these replicas' shards afresh, now."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from control import operations
from control.management.commands._node_schedule import cli_actor


class Command(BaseCommand):
    help = (
        "Restart replicas (ids as list_replicas shows them): a new generation, so the agents "
        "stop the old engine processes and start new ones; a failure backoff is cut short."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("replicas", nargs="+", type=int, metavar="ID", help="Replica ids.")

    def handle(self, *args: Any, replicas: list[int], **options: Any) -> None:
        actor = cli_actor()
        for replica_id in replicas:
            try:
                changed = operations.restart_replica(replica_id, actor=actor)
            except operations.NotFound as exc:
                raise CommandError(str(exc)) from None
            if changed:
                self.stdout.write(f"replica #{replica_id}: restarting")
            else:
                self.stdout.write(f"replica #{replica_id}: not wanted running, left alone")
