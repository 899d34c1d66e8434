"""``manage.py signin_link USERNAME [--minutes 15] [--base https://llmgw.example.com]``

Prints a one-time sign-in link for the user: the way in when their password sign-in is locked
or paced. It works once, within the minutes given; only its hash is stored; printing it and
using it are Events.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from gateway.identity import signin_links
from gateway.management.commands._people import PEOPLE_ERRORS
from gateway.management.commands.set_limits import cli_actor


class Command(BaseCommand):
    help = (
        "Print a one-time sign-in link for a user (single use, short-lived): the way in when "
        "their password sign-in is locked out or slowed down."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("username", help="Whom the link signs in.")
        parser.add_argument(
            "--minutes", type=int, default=15, help="How long it works (default 15, at most 1440)."
        )
        parser.add_argument(
            "--base",
            default="",
            help="The site's address, e.g. https://llmgw.example.com; without it, the path.",
        )

    def handle(self, *args: Any, username: str, **options: Any) -> None:
        try:
            issued = signin_links.issue(
                username, actor=cli_actor(), lifetime=timedelta(minutes=options["minutes"])
            )
        except PEOPLE_ERRORS as exc:
            raise CommandError(f"{exc.field}: {exc}") from None
        self.stdout.write(options["base"].rstrip("/") + issued.path)
        self.stderr.write(
            f"One-time sign-in link for {username}, good once until "
            f"{issued.row.expires_at:%Y-%m-%d %H:%M:%S} UTC."
        )
