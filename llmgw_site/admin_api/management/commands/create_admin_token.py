"""``manage.py create_admin_token NAME [--scope read|write] [--expires 90d]``

Prints the new token once, on standard output and nowhere else; only its hash is stored.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from gateway.identity.keys import parse_expiry
from llmgw_site.admin_api import tokens
from llmgw_site.admin_api.models import AdminToken


class Command(BaseCommand):
    help = "Issue a token for the admin API (/api/admin/v1/) and print it once."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help="What uses the token, e.g. ci-catalog.")
        parser.add_argument(
            "--scope",
            default=AdminToken.Scope.READ,
            choices=AdminToken.Scope.values,
            help="read (the default): GET only; write: every route.",
        )
        parser.add_argument("--expires", default="", help="A date (2027-01-01) or duration (90d).")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            expires = parse_expiry(options["expires"]) if options["expires"] else None
        except ValueError:
            raise CommandError(
                f"--expires {options['expires']!r} is not a date (2027-01-01) or a duration "
                "(90d, 12h)"
            ) from None
        issued = tokens.issue(options["name"], scope=options["scope"], expires_at=expires)
        self.stdout.write(issued.token)
        self.stderr.write(
            f"Created {issued.row.get_scope_display()} admin token {issued.row.prefix}… "
            f"({issued.row.name}); it is shown only this once."
        )
