"""``manage.py delete_profile PROFILE``: remove a profile from the catalog."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from control import operations
from control.management.commands._node_schedule import cli_actor
from control.models import Profile


class Command(BaseCommand):
    help = (
        "Delete a profile from the catalog; models that also offered it stop offering it. "
        "Refused while it is a model's default profile or a replica runs under it."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("profile", help="The profile's name.")

    def handle(self, *args: Any, profile: str, **options: Any) -> None:
        row = Profile.objects.filter(name=profile).only("pk").first()
        if row is None:
            raise CommandError(f"no profile {profile!r}")
        try:
            operations.delete_profile(row.pk, actor=cli_actor())
        except operations.InUse as exc:
            raise CommandError(exc.message) from None
        self.stdout.write(f"{profile}: deleted")
