"""``manage.py revoke_api_key PREFIX...``: revoke keys by their prefix (or the whole key).

Revocation reaches every web process within ``LLMGW_KEY_CACHE_TTL`` seconds.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from gateway.identity import keys
from gateway.models import ApiKey


def find(given: str) -> ApiKey | None:
    """A key by its shown prefix, or by the whole key (looked up by hash, never stored)."""
    if keys.well_formed(given):
        return ApiKey.objects.filter(key_hash=keys.hash_key(given)).first()
    return ApiKey.objects.filter(prefix=given.rstrip("…")).first()


class Command(BaseCommand):
    help = "Revoke API keys, named by the prefix the admin shows (llmgw-XXXXXXXX) or in full."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("keys", nargs="+", metavar="PREFIX", help="Key prefixes or keys.")

    def handle(self, *args: Any, keys: list[str], **options: Any) -> None:
        found = {given: find(given) for given in keys}
        # Never echo what was given: it may be a whole key.
        missing = [i + 1 for i, given in enumerate(keys) if found[given] is None]
        if missing:
            raise CommandError(
                f"no API key matches argument {', '.join(map(str, missing))}; nothing was "
                "revoked (prefixes are listed in the admin under API keys)"
            )
        for api_key in found.values():
            assert api_key is not None
            state = "revoked" if _revoke(api_key) else "already revoked"
            self.stdout.write(f"{api_key.prefix}… ({api_key.user}): {state}")


def _revoke(api_key: ApiKey) -> bool:
    return keys.revoke(api_key.pk)
