"""``manage.py set_user USERNAME [--email E] [--staff on|off] [--active on|off] [--teams a,b]
[--sso-username NAME]``

Changes a user through the same function as the admin's user page and ``PATCH
/api/admin/v1/users/{username}``; options not given keep their value, and one Event lists what
changed. ``--active off`` stops their sign-ins (revoke their keys with ``revoke_api_key``).
``--sso-username`` gives an account without a password the provider name whose first single
sign-on links it ("" for none).
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth.models import User
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction

from gateway.identity import people
from gateway.management.commands._people import PEOPLE_ERRORS, describe_user, names
from gateway.management.commands.set_limits import cli_actor, on_off


class Command(BaseCommand):
    help = "Change a user's email, names, staff, superuser and active flags or teams."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("username", help="The user's username.")
        parser.add_argument("--email", help='Their email address ("" for none).')
        parser.add_argument("--first-name", help="Their given name.")
        parser.add_argument("--last-name", help="Their family name.")
        parser.add_argument("--staff", type=on_off, help="on/off: may sign in to the admin.")
        parser.add_argument(
            "--superuser", type=on_off, help="on/off: every permission, and API writes."
        )
        parser.add_argument("--active", type=on_off, help="on/off: may sign in at all.")
        parser.add_argument(
            "--teams", type=names, help='Comma-separated teams, replacing theirs ("" for none).'
        )
        parser.add_argument(
            "--sso-username",
            help="Their name at the single sign-on provider, whose first sign-in links this "
            'account ("" for none).',
        )

    def handle(self, *args: Any, username: str, **options: Any) -> None:
        changes: dict[str, Any] = {
            field: options[option]
            for option, field in (
                ("email", "email"),
                ("first_name", "first_name"),
                ("last_name", "last_name"),
                ("staff", "is_staff"),
                ("superuser", "is_superuser"),
                ("active", "is_active"),
            )
            if options[option] is not None
        }
        link = options["sso_username"]
        if not changes and options["teams"] is None and link is None:
            raise CommandError("give something to change (--email, --staff, --teams, ...)")
        try:
            with transaction.atomic():  # all of it or none
                if changes or options["teams"] is not None:
                    people.update_user(
                        username, actor=cli_actor(), teams=options["teams"], **changes
                    )
                if link is not None:
                    people.set_sso_username(username, link, actor=cli_actor())
        except PEOPLE_ERRORS as exc:
            raise CommandError(f"{exc.field}: {exc}") from None
        self.stdout.write(describe_user(User.objects.get(username=username)))
