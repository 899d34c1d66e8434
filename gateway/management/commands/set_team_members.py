"""``manage.py set_team_members NAME --members alice,bob``

Makes these users, and only these, the team's members, through the same function as the
admin's group page and ``PUT /api/admin/v1/teams/{name}/members``; an Event says who left and
who joined. ``--members ""`` empties the team.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from gateway.identity import people
from gateway.management.commands._people import PEOPLE_ERRORS, describe_team, names
from gateway.management.commands.set_limits import cli_actor


class Command(BaseCommand):
    help = "Set a team's members: exactly the users given (others leave the team)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help="The team's name.")
        parser.add_argument(
            "--members",
            type=names,
            required=True,
            help='Comma-separated usernames ("" for none).',
        )

    def handle(self, *args: Any, name: str, members: list[str], **options: Any) -> None:
        try:
            team = people.set_team_members(name, members, actor=cli_actor())
        except PEOPLE_ERRORS as exc:
            raise CommandError(f"{exc.field}: {exc}") from None
        self.stdout.write(
            describe_team(name, sorted(team.user_set.values_list("username", flat=True)))
        )
