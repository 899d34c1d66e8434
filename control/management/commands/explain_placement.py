"""`manage.py explain_placement MODEL`: where a new replica of MODEL would go now, or why it
cannot be placed, with the model's replicas and its recorded placement note."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from control import placement
from control.models import ServedModel
from control.reconciler.snapshot import capacity, read_snapshot, replica_request


class Command(BaseCommand):
    help = "Explain where a new replica of MODEL would be placed now, or why it cannot be."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("model", help="The model's API name.")

    def handle(self, *args: Any, model: str, **options: Any) -> None:
        try:
            served = ServedModel.objects.select_related("default_profile").get(name=model)
        except ServedModel.DoesNotExist:
            raise CommandError(f"no model named {model!r} in the catalog") from None
        snapshot = read_snapshot(timezone.now())
        request = replica_request(served)
        profile = served.default_profile
        self.stdout.write(
            f"model {served.name} (profile {profile.name}: {profile.engine}, "
            f"{request.shards} shard(s) × {request.gpus_per_shard} GPU(s)"
            f"{f' with {request.gpu_memory_mib} MiB free each' if request.gpu_memory_mib else ''}"
            f", {request.strategy})"
        )
        replicas = snapshot.replicas_of(served.pk)
        self.stdout.write(
            f"replicas: {len(replicas)} "
            + ", ".join(f"#{r.id} {r.desired}/{r.observed}" for r in replicas)
        )
        if served.placement_note:
            self.stdout.write(f"last note: {served.placement_note}")
        outcome = placement.place(capacity(snapshot), request, settings.LLMGW_PORT_RANGE)
        if isinstance(outcome, placement.Unplaceable):
            self.stdout.write(f"cannot place now: {outcome.reason}")
            raise SystemExit(1)
        for shard in outcome.shards:
            self.stdout.write(
                f"would place rank {shard.rank} on {shard.node}: GPUs "
                f"{list(shard.gpu_indices)}, port {shard.port}"
            )
