"""``manage.py export_catalog [-o FILE] [--with-secrets]``: profiles, models and static endpoints
as YAML. Secrets in profile environments are masked unless ``--with-secrets``: a catalog file
tends to end up in a repository or a CI log, and a masked one imports back without touching
the stored secrets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from llmgw_site import catalog


class Command(BaseCommand):
    help = "Export the catalog (profiles, models, static endpoints) as YAML, for import_catalog."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("-o", "--output", help="Write to this file (default: standard output).")
        parser.add_argument(
            "--with-secrets",
            action="store_true",
            help="Write secrets in profile environments as they are (default: masked).",
        )

    def handle(self, *args: Any, output: str | None, **options: Any) -> None:
        text = catalog.export_yaml(reveal_secrets=options["with_secrets"])
        if output is None:
            self.stdout.write(text, ending="")
            return
        try:
            Path(output).write_text(text, encoding="utf-8")
        except OSError as exc:
            raise CommandError(f"cannot write {output}: {exc.strerror}") from None
        self.stderr.write(f"catalog written to {output}")
