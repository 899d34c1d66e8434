"""``manage.py list_replicas [--model NAME] [--all] [--json]``: what runs where."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from control.management.commands.list_nodes import table
from control.models import Replica, ServedModel


class Command(BaseCommand):
    help = "List replicas: model, profile, desired and observed state, failures, shards."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--model", help="Only this model's replicas.")
        parser.add_argument(
            "--all",
            action="store_true",
            dest="include_stopped",
            help="Include replicas that are stopped for good.",
        )
        parser.add_argument(
            "--json", action="store_true", dest="as_json", help="Print JSON instead of a table."
        )

    def handle(
        self,
        *args: Any,
        model: str | None,
        include_stopped: bool,
        as_json: bool,
        **options: Any,
    ) -> None:
        replicas = Replica.objects.select_related("model", "profile").prefetch_related(
            "shards__node"
        )
        if model is not None:
            if not ServedModel.objects.filter(name=model).exists():
                raise CommandError(f"no model {model!r} in the catalog")
            replicas = replicas.filter(model__name=model)
        if not include_stopped:
            replicas = replicas.exclude(
                desired=Replica.Desired.STOPPED,
                observed__in=[Replica.Observed.STOPPED, Replica.Observed.FAILED],
            )
        data: list[dict[str, Any]] = [
            {
                "id": r.pk,
                "model": r.model.name,
                "profile": r.profile.name,
                "desired": r.desired,
                "observed": r.observed,
                "generation": r.generation,
                "failures": r.failures,
                "failure_class": r.failure_class,
                "shards": [
                    {
                        "rank": s.rank,
                        "node": s.node.name,
                        "gpus": list(s.gpu_indices),
                        "port": s.port,
                        "observed": s.observed,
                    }
                    for s in r.shards.all()
                ],
            }
            for r in replicas.order_by("model__name", "id")
        ]
        if as_json:
            self.stdout.write(json.dumps(data, indent=2))
            return
        if not data:
            self.stdout.write("no replicas")
            return
        rows = [("ID", "MODEL", "PROFILE", "DESIRED", "OBSERVED", "FAILURES", "SHARDS")]
        for r in data:
            shards = " ".join(
                f"{s['node']}:{','.join(map(str, s['gpus'])) or '-'}:{s['port']}"
                for s in r["shards"]
            )
            failures = f"{r['failures']} ({r['failure_class']})" if r["failures"] else "0"
            rows.append(
                (
                    str(r["id"]),
                    r["model"],
                    r["profile"],
                    r["desired"],
                    r["observed"],
                    failures,
                    shards or "-",
                )
            )
        self.stdout.write(table(rows))
