"""``manage.py import_catalog FILE [--dry-run]``: create or update catalog entries from a YAML
file (JSON when its name ends in ``.json``), as ``manage.py run --catalog`` does at every start.

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
        "Import profiles, models and static endpoints from a YAML or JSON file (as "
        "export_catalog writes it; '-' reads standard input). Creates and updates; deletes "
        "nothing."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "file", help="The YAML file (JSON if it ends in .json), or - for standard input."
        )
        parser.add_argument(
            "--dry-run", action="store_true", help="Validate and report, but write nothing."
        )

    def handle(self, *args: Any, file: str, dry_run: bool, **options: Any) -> None:
        try:
            if file == "-":
                result = catalog.import_yaml(sys.stdin.read(), dry_run=dry_run)
            else:
                result = catalog.import_file(Path(file), dry_run=dry_run)
        except OSError as exc:
            raise CommandError(f"cannot read {file}: {exc.strerror}") from None
        except catalog.CatalogError as exc:
            raise CommandError(f"{file}: {exc}; nothing was imported") from None
        for label in result.created:
            self.stdout.write(f"created {label}")
        for label in result.updated:
            self.stdout.write(f"updated {label}")
        prefix = "dry run, nothing written: " if dry_run else ""
        self.stdout.write(f"{prefix}{result.summary()}")
