"""``manage.py pin_model MODEL [--unpin]``: never evict this model to make room."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from control import operations
from control.management.commands._node_schedule import cli_actor
from control.models import ServedModel


class Command(BaseCommand):
    help = (
        "Pin a model: its idle replicas are never evicted to make room for another model "
        "(--unpin undoes it)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("model", help="The model's API name.")
        parser.add_argument("--unpin", action="store_true", help="Unpin instead.")

    def handle(self, *args: Any, model: str, unpin: bool, **options: Any) -> None:
        row = ServedModel.objects.filter(name=model).only("pk").first()
        if row is None:
            raise CommandError(f"no model {model!r}")
        changed = operations.pin_model(row.pk, pinned=not unpin, actor=cli_actor())
        verb = "unpinned" if unpin else "pinned"
        self.stdout.write(f"{model}: {verb}" if changed else f"{model}: already {verb}")
