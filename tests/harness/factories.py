"""Rows for tests: users, keys, the catalog, nodes with GPUs, replicas and their shards, usage.
Plain functions with keyword overrides; each makes what a test would otherwise spell out."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission, User
from django.db import transaction
from django.utils import timezone

from control import node_tokens
from control.models import Gpu, Node, Profile, Replica, ServedModel, Shard
from gateway.identity import keys
from gateway.models import ApiKey, UsageRecord

PASSWORD = "correct horse battery staple"
GIB = 1024  # MiB
_ids = itertools.count(1)

# Every key the tests issued, so that logs can be searched for them (G15).
ISSUED: list[str] = []


# --------------------------------------------------------------------------- people and keys


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


def make_key(username: str = "alice", **options: Any) -> tuple[str, ApiKey]:
    """A key as ``keys.issue`` makes one (``name``, limits...), for a user made if missing."""
    get_user_model().objects.get_or_create(username=username)
    issued = keys.issue(username, **options)
    ISSUED.append(issued.key)
    return issued.key, issued.api_key


# --------------------------------------------------------------------------- the catalog


def make_profile(name: str = "", **fields: Any) -> Profile:
    defaults: dict[str, Any] = {"engine": "sim", "gpus_per_shard": 1}
    defaults.update(fields)
    return Profile.objects.create(name=name or f"profile-{next(_ids)}", **defaults)


def make_model(
    name: str,
    *,
    profile: Profile | None = None,
    gpus: int = 1,
    shards: int = 1,
    memory_gib: float = 0,
    args: Sequence[str] = (),
    startup_timeout_s: float | None = None,
    **fields: Any,
) -> ServedModel:
    """A catalog model; without ``profile``, one of its own (``NAME-sim``) on the sim engine
    with ``gpus`` per shard, ``shards`` per replica and ``memory_gib`` per GPU."""
    if profile is None:
        extra = {} if startup_timeout_s is None else {"startup_timeout_s": startup_timeout_s}
        profile = make_profile(
            f"{name}-sim",
            args=list(args),
            gpus_per_shard=gpus,
            shards_per_replica=shards,
            gpu_memory_mib=int(memory_gib * GIB),
            **extra,
        )
    fields.setdefault("source", f"org/{name}")
    model = ServedModel.objects.create(name=name, default_profile=profile, **fields)
    model.profiles.add(profile)
    return model


# --------------------------------------------------------------------------- the fleet


def gib(*sizes: float) -> list[tuple[int, int]]:
    """GPUs of these sizes (GiB), nothing in use: ``make_node("a", gpus=gib(80, 80))``."""
    return [(int(size * GIB), 0) for size in sizes]


def make_node(
    name: str,
    *,
    gpus: Iterable[tuple[int, int]] = ((80 * GIB, 0),),
    gpu_model: str = "NVIDIA H100 80GB HBM3",
    health: str = Node.Health.READY,
    schedule: str = Node.Schedule.ACTIVE,
    heartbeat_age_s: float = 1.0,
    **fields: Any,
) -> Node:
    """A node whose agent reported ``gpus`` as ``(memory total MiB, memory used MiB)``;
    without ``addresses``, the local agent's (loopback, its stream over loopback too)."""
    if "addresses" not in fields:
        fields.update(addresses=["127.0.0.1"], connected_over_loopback=True)
    fields.setdefault("agent_version", "0.1.0")
    node = Node.objects.create(
        name=name,
        schedule=schedule,
        health=health,
        last_heartbeat_at=timezone.now() - timedelta(seconds=heartbeat_age_s),
        **fields,
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


def issue_node(name: str, **fields: Any) -> tuple[Node, str]:
    """A node registered the way an operator registers one (its token issued), and the token."""
    token = node_tokens.issue_node_token(name)
    node = Node.objects.get(name=name)
    if fields:
        Node.objects.filter(pk=node.pk).update(**fields)
        node.refresh_from_db()
    return node, token


def make_replica(
    model: ServedModel,
    shards: Sequence[tuple[Node, Sequence[int]]],
    *,
    desired: str = Replica.Desired.RUNNING,
    observed: str = Replica.Observed.READY,
    ready_after_s: float | None = 30.0,
    ports: Sequence[int] = (),
    **fields: Any,
) -> Replica:
    """A replica of ``model`` with one shard per ``(node, GPU indices)``, ranks in order."""
    now = timezone.now()
    replica = Replica.objects.create(
        model=model,
        profile=model.default_profile,
        desired=desired,
        observed=observed,
        created_at=now - timedelta(seconds=ready_after_s or 0),
        ready_at=now if ready_after_s is not None and observed == Replica.Observed.READY else None,
        **fields,
    )
    for rank, (node, indices) in enumerate(shards):
        Shard.objects.create(
            replica=replica,
            node=node,
            rank=rank,
            gpu_indices=list(indices),
            port=ports[rank] if ports else 20000 + next(_ids),
            observed=observed,
        )
    return replica


@dataclass
class Served:
    model: ServedModel
    replicas: list[Replica] = field(default_factory=list)


def serve_model(
    name: str, ports: Iterable[int], *, ready: bool = True, **model_fields: Any
) -> Served:
    """A model with one replica per engine port on loopback, each on a healthy node of its
    own: what the gateway routes to, with no reconciler or agent involved."""
    with transaction.atomic():
        model = make_model(name, source=name, **model_fields)
        served = Served(model)
        for port in ports:
            node = make_node(f"n{next(_ids)}-{port}", gpus=())
            served.replicas.append(
                make_replica(
                    model,
                    [(node, [])],
                    observed=Replica.Observed.READY if ready else Replica.Observed.PENDING,
                    ports=[port],
                )
            )
    return served


# --------------------------------------------------------------------------- usage


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
    **fields: Any,
) -> UsageRecord:
    fields.setdefault("endpoint", "chat")
    fields.setdefault("upstream", "replica:1")
    return UsageRecord.objects.create(
        request_id=f"req-{next(_ids)}",
        api_key=api_key,
        user_id=api_key.user_id if api_key else None,
        model=model,
        status=status,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        ttft_ms=ttft_ms,
        duration_ms=duration_ms,
        finish_reason=finish_reason,
        started_at=started_at or timezone.now(),
        **fields,
    )


def usage_rows(api_key: ApiKey) -> list[UsageRecord]:
    return list(UsageRecord.objects.filter(api_key=api_key).order_by("started_at"))
