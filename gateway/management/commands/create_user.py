"""``manage.py create_user USERNAME [--email E] [--staff] [--inactive] [--teams a,b]
[--sso-username NAME]``

Makes a user through the same function as the admin's add page and ``POST
/api/admin/v1/users``, with an Event naming who did it. No password is set: the user signs in
by single sign-on, or with one set later (``manage.py changepassword``, the admin). Their first
single sign-on links the account if the provider vouches for the email, or signs in
``--sso-username``.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from gateway.identity import people
from gateway.management.commands._people import PEOPLE_ERRORS, describe_user, names
from gateway.management.commands.set_limits import cli_actor


class Command(BaseCommand):
    help = (
        "Make a user (no password: they sign in by single sign-on, or with one set later by "
        "changepassword or in the admin)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("username", help="The new user's username.")
        parser.add_argument("--email", default="", help="Their email address.")
        parser.add_argument("--staff", action="store_true", help="May sign in to the admin.")
        parser.add_argument(
            "--inactive", action="store_true", help="Made unable to sign in (until set_user)."
        )
        parser.add_argument("--teams", type=names, default=[], help="Comma-separated teams.")
        parser.add_argument(
            "--sso-username",
            default="",
            help="Their name at the single sign-on provider, whose first sign-in links them.",
        )

    def handle(self, *args: Any, username: str, **options: Any) -> None:
        try:
            user = people.create_user(
                username,
                actor=cli_actor(),
                email=options["email"],
                is_staff=options["staff"],
                is_active=not options["inactive"],
                teams=options["teams"],
                sso_username=options["sso_username"],
            )
        except PEOPLE_ERRORS as exc:
            raise CommandError(f"{exc.field}: {exc}") from None
        self.stdout.write(describe_user(user))
