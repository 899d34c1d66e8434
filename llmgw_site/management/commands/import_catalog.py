"""``manage.py import_catalog FILE [--dry-run]``: create or update catalog entries from YAML.

Idempotent (a second import of the same file changes nothing), all-or-nothing (a bad entry
leaves the catalog as it was), and never deletes what the file does not mention.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from llmgw_site import catalog


class Command(BaseCommand):
    help = (
        "Import profiles, models and static endpoints from a YAML file (as export_catalog "
        "writes it; '-' reads standard input). Creates and updates; deletes nothing."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("file", help="The YAML file, or - for standard input.")
        parser.add_argument(
            "--dry-run", action="store_true", help="Validate and report, but write nothing."
        )

    def handle(self, *args: Any, file: str, dry_run: bool, **options: Any) -> None:
        try:
            text = sys.stdin.read() if file == "-" else Path(file).read_text(encoding="utf-8")
        except OSError as exc:
            raise CommandError(f"cannot read {file}: {exc.strerror}") from None
        try:
            result = catalog.import_yaml(text, dry_run=dry_run)
        except catalog.CatalogError as exc:
            raise CommandError(f"{file}: {exc}; nothing was imported") from None
        for label in result.created:
            self.stdout.write(f"created {label}")
        for label in result.updated:
            self.stdout.write(f"updated {label}")
        prefix = "dry run, nothing written: " if dry_run else ""
        self.stdout.write(f"{prefix}{result.summary()}")
