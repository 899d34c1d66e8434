"""``manage.py delete_model MODEL``: remove a model from the catalog, with its replicas."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from control import operations
from control.management.commands._node_schedule import cli_actor
from control.models import ServedModel


class Command(BaseCommand):
    help = (
        "Delete a model from the catalog: its replicas stop on their nodes and its weights "
        "are removed there once unused. Clients asking for it get 404 from then on."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("model", help="The model's API name.")

    def handle(self, *args: Any, model: str, **options: Any) -> None:
        row = ServedModel.objects.filter(name=model).only("pk").first()
        if row is None:
            raise CommandError(f"no model {model!r}")
        operations.delete_model(row.pk, actor=cli_actor())
        self.stdout.write(f"{model}: deleted")
