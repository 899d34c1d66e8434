"""``manage.py create_team NAME [--members alice,bob]``

Makes a team (a Django group) through the same function as the admin's group page and ``POST
/api/admin/v1/teams``, with an Event naming who did it. Limits are ``set_limits --team``'s.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from gateway.identity import people
from gateway.management.commands._people import PEOPLE_ERRORS, describe_team, names
from gateway.management.commands.set_limits import cli_actor


class Command(BaseCommand):
    help = "Make a team (a Django group) with the given members."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help="The new team's name.")
        parser.add_argument("--members", type=names, default=[], help="Comma-separated usernames.")

    def handle(self, *args: Any, name: str, members: list[str], **options: Any) -> None:
        try:
            team = people.create_team(name, actor=cli_actor(), members=members)
        except PEOPLE_ERRORS as exc:
            raise CommandError(f"{exc.field}: {exc}") from None
        self.stdout.write(
            describe_team(name, sorted(team.user_set.values_list("username", flat=True)))
        )
