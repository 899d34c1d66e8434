"""The gateway in the Django admin: keys, static endpoints, usage."""

from __future__ import annotations

from django.contrib import admin

from gateway.models import ApiKey, Endpoint, UsageRecord


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin[ApiKey]):
    list_display = ["prefix", "name", "user", "created_at", "expires_at", "revoked_at"]
    list_filter = ["revoked_at"]
    search_fields = ["prefix", "name", "user__username"]
    readonly_fields = ["prefix", "created_at", "revoked_at", "last_used_at"]


@admin.register(Endpoint)
class EndpointAdmin(admin.ModelAdmin[Endpoint]):
    list_display = ["slug", "url", "model_names", "weight", "enabled"]
    list_filter = ["enabled"]


@admin.register(UsageRecord)
class UsageRecordAdmin(admin.ModelAdmin[UsageRecord]):
    list_display = [
        "started_at",
        "model",
        "api_key",
        "status",
        "prompt_tokens",
        "completion_tokens",
        "finish_reason",
        "duration_ms",
    ]
    list_filter = ["model", "status", "finish_reason"]
    date_hierarchy = "started_at"

    def has_add_permission(self, request: object) -> bool:
        return False

    def has_change_permission(self, request: object, obj: object = None) -> bool:
        return False
