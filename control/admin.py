"""The control plane in the Django admin. Operators edit desired state; observed state is
read-only here because only agents and the reconciler may write it."""

from __future__ import annotations

from django.contrib import admin

from control.models import Event, Gpu, Lease, Node, Profile, Replica, ServedModel, Shard


@admin.register(Profile)
class ProfileAdmin(admin.ModelAdmin[Profile]):
    list_display = ["name", "engine", "gpus_per_shard", "shards_per_replica", "gpu_memory_mib"]
    list_filter = ["engine"]
    search_fields = ["name"]


@admin.register(ServedModel)
class ServedModelAdmin(admin.ModelAdmin[ServedModel]):
    list_display = [
        "name",
        "default_profile",
        "min_replicas",
        "max_replicas",
        "idle_timeout_s",
        "pinned",
        "enabled",
        "last_request_at",
    ]
    list_filter = ["enabled", "pinned"]
    search_fields = ["name", "source"]
    filter_horizontal = ["profiles"]
    readonly_fields = ["created_at", "last_request_at", "demand_at"]


class GpuInline(admin.TabularInline[Gpu, Node]):
    model = Gpu
    extra = 0
    can_delete = False
    readonly_fields = [
        "index",
        "uuid",
        "model",
        "memory_total_mib",
        "memory_used_mib",
        "updated_at",
    ]

    def has_add_permission(self, request: object, obj: object = None) -> bool:
        return False


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin[Node]):
    list_display = ["name", "state", "schedule", "health", "last_heartbeat_at", "agent_version"]
    list_filter = ["schedule", "health"]
    search_fields = ["name"]
    inlines = [GpuInline]
    readonly_fields = [
        "health",
        "last_heartbeat_at",
        "agent_version",
        "boot_id",
        "token_prefix",
        "token_issued_at",
        "created_at",
    ]


class ShardInline(admin.TabularInline[Shard, Replica]):
    model = Shard
    extra = 0
    can_delete = False
    readonly_fields = [
        "node",
        "rank",
        "gpu_indices",
        "port",
        "observed",
        "exit_code",
        "failure_class",
        "last_log",
        "updated_at",
    ]

    def has_add_permission(self, request: object, obj: object = None) -> bool:
        return False


@admin.register(Replica)
class ReplicaAdmin(admin.ModelAdmin[Replica]):
    list_display = ["__str__", "profile", "desired", "observed", "failures", "failure_class"]
    list_filter = ["desired", "observed", "failure_class"]
    inlines = [ShardInline]
    readonly_fields = [
        "observed",
        "failures",
        "failure_class",
        "backoff_until",
        "generation",
        "epoch",
        "created_at",
        "ready_at",
        "last_request_at",
    ]


@admin.register(Lease)
class LeaseAdmin(admin.ModelAdmin[Lease]):
    list_display = ["name", "owner", "epoch", "expires_at"]

    def has_add_permission(self, request: object) -> bool:
        return False

    def has_change_permission(self, request: object, obj: object = None) -> bool:
        return False

    def has_delete_permission(self, request: object, obj: object = None) -> bool:
        return False


@admin.register(Event)
class EventAdmin(admin.ModelAdmin[Event]):
    list_display = ["created_at", "kind", "subject", "message", "epoch"]
    list_filter = ["kind"]
    search_fields = ["subject", "message"]

    def has_add_permission(self, request: object) -> bool:
        return False

    def has_change_permission(self, request: object, obj: object = None) -> bool:
        return False

    def has_delete_permission(self, request: object, obj: object = None) -> bool:
        return False
