"""``manage.py create_api_key USERNAME [--models a,b] [--expires 2027-01-01|30d] ...``

Prints the new key once, on standard output and nowhere else; only its hash is stored.
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser

from gateway.identity import keys
from gateway.models import ApiKey


class Command(BaseCommand):
    help = "Create an API key for a user and print it once."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("username")
        parser.add_argument("--name", default="", help="A label for the key.")
        parser.add_argument("--models", default="", help="Comma-separated models (default: all).")
        parser.add_argument("--expires", default="", help="A date (2027-01-01) or duration (30d).")
        parser.add_argument("--rpm", type=int, default=None, help="Requests per minute.")
        parser.add_argument("--tpm", type=int, default=None, help="Tokens per minute.")
        parser.add_argument("--budget", type=int, default=None, help="Tokens per budget period.")
        parser.add_argument(
            "--budget-period",
            default=ApiKey.BudgetPeriod.MONTH,
            choices=[c.value for c in ApiKey.BudgetPeriod],
        )
        parser.add_argument(
            "--create-user", action="store_true", help="Create the user if it does not exist."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        username: str = options["username"]
        users = get_user_model().objects
        if not users.filter(username=username).exists():
            if not options["create_user"]:
                raise CommandError(f"no user {username!r} (add --create-user to create it)")
            users.create_user(username=username)
        for name in ("rpm", "tpm", "budget"):
            if options[name] is not None and options[name] < 0:
                raise CommandError(f"--{name} must not be negative")
        try:
            expires = keys.parse_expiry(options["expires"]) if options["expires"] else None
        except ValueError:
            raise CommandError(
                f"--expires {options['expires']!r} is not a date (2027-01-01) or a duration "
                "(30d, 12h, 90m)"
            ) from None
        issued = keys.issue(
            username,
            name=options["name"],
            models=[m.strip() for m in options["models"].split(",") if m.strip()],
            expires_at=expires,
            rpm=options["rpm"],
            tpm=options["tpm"],
            budget=options["budget"],
            budget_period=options["budget_period"],
        )
        self.stdout.write(issued.key)
        self.stderr.write(
            f"Created key {issued.api_key.prefix}… for {username}; it is shown only this once."
        )
