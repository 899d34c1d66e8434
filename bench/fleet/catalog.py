"""The fleet benchmark's catalog: models of mixed shapes, written as the operator would."""

from __future__ import annotations

from typing import Any


def catalog_shapes(count: int) -> list[dict[str, Any]]:
    """``count`` models of mixed shapes, deterministic: 60% one GPU, 20% two, 10% four,
    5% eight, 5% two nodes of eight GPUs; min replicas 0 (45%), 1 (35%) or 2 (20%)."""
    shapes = []
    for i in range(count):
        size = i % 20
        if size < 12:
            gpus, shards = 1, 1
        elif size < 16:
            gpus, shards = 2, 1
        elif size < 18:
            gpus, shards = 4, 1
        elif size < 19:
            gpus, shards = 8, 1
        else:
            gpus, shards = 8, 2
        slot = (i * 7) % 20
        minimum = 0 if slot < 9 else (1 if slot < 16 else 2)
        shapes.append(
            {
                "name": f"m{i:03d}-{gpus * shards}g",
                "gpus": gpus,
                "shards": shards,
                "min": minimum,
                "max": max(1, minimum + 1),
            }
        )
    return shapes


def write_catalog(shapes: list[dict[str, Any]]) -> None:
    from control.models import Profile, ServedModel

    profiles = {}
    for gpus, shards in sorted({(s["gpus"], s["shards"]) for s in shapes}):
        profiles[(gpus, shards)] = Profile.objects.create(
            name=f"sim-{gpus}x{shards}",
            engine="sim",
            gpus_per_shard=gpus,
            shards_per_replica=shards,
            startup_timeout_s=120,
        )
    for shape in shapes:
        profile = profiles[(shape["gpus"], shape["shards"])]
        model = ServedModel.objects.create(
            name=shape["name"],
            source=f"bench/{shape['name']}",
            default_profile=profile,
            min_replicas=shape["min"],
            max_replicas=shape["max"],
            idle_timeout_s=24 * 3600,  # no scale-down while measuring
            activation_timeout_s=600,
        )
        model.profiles.add(profile)
