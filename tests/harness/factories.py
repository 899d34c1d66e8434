"""Small factory functions for the operations tests: users, a catalog, nodes with GPUs,
replicas placed on them, usage rows. Plain functions with keyword overrides."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from itertools import count
from typing import Any

from django.contrib.auth.models import Permission, User
from django.utils import timezone

from control.models import Gpu, Node, Profile, Replica, ServedModel, Shard
from gateway import keys
from gateway.models import ApiKey, UsageRecord

PASSWORD = "correct horse battery staple"
_ids = count(1)


def make_user(
    username: str, *, staff: bool = False, superuser: bool = False, perms: Sequence[str] = ()
) -> User:
    """``perms`` are ``app_label.codename`` strings, e.g. ``"gateway.view_apikey"``."""
    if superuser:
        user = User.objects.create_superuser(username=username, password=PASSWORD)
    else:
        user = User.objects.create_user(username=username, password=PASSWORD, is_staff=staff)
    for perm in perms:
        app_label, codename = perm.split(".")
        user.user_permissions.add(
            Permission.objects.get(content_type__app_label=app_label, codename=codename)
        )
    return user


def make_key(username: str, name: str = "") -> tuple[str, ApiKey]:
    issued = keys.issue(username, name=name)
    return issued.key, issued.api_key


def make_profile(name: str = "sim-1gpu", **fields: Any) -> Profile:
    defaults: dict[str, Any] = {"engine": "sim", "gpus_per_shard": 1, "gpu_memory_mib": 1024}
    defaults.update(fields)
    return Profile.objects.create(name=name, **defaults)


def make_model(name: str, profile: Profile | None = None, **fields: Any) -> ServedModel:
    profile = profile or Profile.objects.first() or make_profile()
    defaults: dict[str, Any] = {"source": f"sim/{name}", "min_replicas": 0, "max_replicas": 2}
    defaults.update(fields)
    model = ServedModel.objects.create(name=name, default_profile=profile, **defaults)
    model.profiles.add(profile)
    return model


def make_node(
    name: str,
    *,
    gpus: Sequence[tuple[int, int]] = ((81920, 0),),
    gpu_model: str = "NVIDIA H100 80GB HBM3",
    health: str = Node.Health.READY,
    schedule: str = Node.Schedule.ACTIVE,
    heartbeat_age_s: float = 1.0,
) -> Node:
    """``gpus`` are ``(memory total MiB, memory used MiB)`` per index."""
    node = Node.objects.create(
        name=name,
        addresses=["127.0.0.1"],
        schedule=schedule,
        health=health,
        last_heartbeat_at=timezone.now() - timedelta(seconds=heartbeat_age_s),
        agent_version="0.1.0",
    )
    Gpu.objects.bulk_create(
        Gpu(
            node=node,
            index=i,
            uuid=f"GPU-{name}-{i}",
            model=gpu_model,
            memory_total_mib=total,
            memory_used_mib=used,
        )
        for i, (total, used) in enumerate(gpus)
    )
    return node


def make_replica(
    model: ServedModel,
    shards: Sequence[tuple[Node, Sequence[int]]],
    *,
    desired: str = Replica.Desired.RUNNING,
    observed: str = Replica.Observed.READY,
    ready_after_s: float | None = 30.0,
) -> Replica:
    now = timezone.now()
    replica = Replica.objects.create(
        model=model,
        profile=model.default_profile,
        desired=desired,
        observed=observed,
        created_at=now - timedelta(seconds=ready_after_s or 0),
        ready_at=now if ready_after_s is not None and observed == Replica.Observed.READY else None,
    )
    for rank, (node, indices) in enumerate(shards):
        Shard.objects.create(
            replica=replica,
            node=node,
            rank=rank,
            gpu_indices=list(indices),
            port=20000 + next(_ids),
            observed=observed,
        )
    return replica


def make_usage(
    *,
    model: str,
    api_key: ApiKey | None = None,
    started_at: datetime | None = None,
    status: int = 200,
    prompt_tokens: int = 10,
    completion_tokens: int = 20,
    ttft_ms: float | None = 120.0,
    duration_ms: float = 400.0,
    finish_reason: str = "stop",
) -> UsageRecord:
    return UsageRecord.objects.create(
        request_id=f"req-{next(_ids)}",
        api_key=api_key,
        user_id=api_key.user_id if api_key else None,
        model=model,
        endpoint="chat",
        upstream="replica:1",
        status=status,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        ttft_ms=ttft_ms,
        duration_ms=duration_ms,
        finish_reason=finish_reason,
        started_at=started_at or timezone.now(),
    )
