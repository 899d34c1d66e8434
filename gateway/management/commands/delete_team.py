"""``manage.py delete_team NAME``: remove a team, with its limits (members keep their own)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from gateway.identity import people
from gateway.management.commands.set_limits import cli_actor


class Command(BaseCommand):
    help = (
        "Delete a team (a Django group) and its limits; its members stay, with their own "
        "limits and keys."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help="The team's name.")

    def handle(self, *args: Any, name: str, **options: Any) -> None:
        if not people.delete_team(name, actor=cli_actor()):
            raise CommandError(f"no team {name!r}")
        self.stdout.write(f"team {name}: deleted")
