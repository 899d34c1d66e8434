"""``manage.py revoke_admin_token PREFIX``: the token stops working at once."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from llmgw_site.admin_api import tokens
from llmgw_site.admin_api.models import AdminToken


class Command(BaseCommand):
    help = "Revoke an admin token by its prefix (as the admin and the API list it)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("prefix", help="The token's visible prefix, e.g. llmgw-admin-AbCd1234.")

    def handle(self, *args: Any, prefix: str, **options: Any) -> None:
        prefix = prefix.rstrip("…")
        row = AdminToken.objects.filter(prefix=prefix).first()
        if row is None:
            raise CommandError(f"no admin token with prefix {prefix!r}")
        if tokens.revoke(row.pk):
            self.stdout.write(f"{row.prefix}: revoked")
        else:
            self.stdout.write(f"{row.prefix}: already revoked")
