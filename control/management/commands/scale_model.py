"""``manage.py scale_model MODEL --min N --max M``: how many replicas a model may have."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from control import operations
from control.management.commands._node_schedule import cli_actor
from control.models import ServedModel


class Command(BaseCommand):
    help = (
        "Set a model's minimum and maximum replica counts. The reconciler places up to the "
        "minimum on its next tick; a minimum of 0 lets the model scale to zero when idle."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("model", help="The model's API name.")
        parser.add_argument("--min", type=int, required=True, dest="min_replicas")
        parser.add_argument("--max", type=int, required=True, dest="max_replicas")

    def handle(
        self, *args: Any, model: str, min_replicas: int, max_replicas: int, **_: Any
    ) -> None:
        row = ServedModel.objects.filter(name=model).only("pk").first()
        if row is None:
            raise CommandError(f"no model {model!r}")
        try:
            changed = operations.scale_model(
                row.pk, min_replicas=min_replicas, max_replicas=max_replicas, actor=cli_actor()
            )
        except operations.Invalid as exc:
            raise CommandError(f"--{exc.field.split('_')[0]}: {exc.message}") from None
        state = "scaled" if changed else "already"
        self.stdout.write(f"{model}: {state} {min_replicas}..{max_replicas} replicas")
