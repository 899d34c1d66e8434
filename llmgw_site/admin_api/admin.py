"""Admin tokens in the Django admin: issued by the add form (shown once), revoked by an action.

Tokens are minted only by ``tokens.issue``; the add form's row is the one it returns, and the
token is rendered into that one response, never into a message, the session or a cookie.
"""

from __future__ import annotations

from typing import Any
from weakref import WeakKeyDictionary

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse

from llmgw_site.admin_api import tokens
from llmgw_site.admin_api.models import AdminToken

_issued: WeakKeyDictionary[HttpRequest, str] = WeakKeyDictionary()


@admin.register(AdminToken)
class AdminTokenAdmin(admin.ModelAdmin[AdminToken]):
    list_display = [
        "prefix",
        "name",
        "scope",
        "created_by",
        "created_at",
        "last_used_at",
        "expires_at",
        "revoked_at",
    ]
    list_filter = ["scope", "revoked_at"]
    search_fields = ["prefix", "name"]
    actions = ["revoke"]
    fields = [
        "name",
        "scope",
        "expires_at",
        "prefix",
        "created_by",
        "created_at",
        "last_used_at",
        "revoked_at",
    ]

    def get_readonly_fields(self, request: HttpRequest, obj: AdminToken | None = None) -> list[str]:
        observed = ["prefix", "created_by", "created_at", "last_used_at", "revoked_at"]
        # A token's power is fixed at issue: widening it would need a new token, and an audit.
        return [*observed, "scope"] if obj is not None else observed

    def has_module_permission(self, request: HttpRequest) -> bool:
        # A read-write token can do what a superuser can: only superusers may mint one.
        return bool(getattr(request.user, "is_superuser", False))

    def has_view_permission(self, request: HttpRequest, obj: AdminToken | None = None) -> bool:
        return self.has_module_permission(request)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return self.has_module_permission(request)

    def has_change_permission(self, request: HttpRequest, obj: AdminToken | None = None) -> bool:
        return self.has_module_permission(request)

    def has_delete_permission(self, request: HttpRequest, obj: AdminToken | None = None) -> bool:
        return False  # revoke instead: the row says who had access, and until when

    def save_model(self, request: HttpRequest, obj: AdminToken, form: Any, change: bool) -> None:
        if change:
            super().save_model(request, obj, form, change)
            return
        issued = tokens.issue(
            obj.name,
            scope=obj.scope,
            created_by=request.user,  # type: ignore[arg-type]
            expires_at=obj.expires_at,
        )
        # The admin goes on with `obj` (history entry, redirect), so it becomes the stored row.
        for name in ("pk", "prefix", "token_hash", "created_at", "created_by_id"):
            setattr(obj, name, getattr(issued.row, name))
        obj._state.adding = False
        obj._state.db = issued.row._state.db
        _issued[request] = issued.token

    def response_add(
        self, request: HttpRequest, obj: AdminToken, post_url_continue: str | None = None
    ) -> HttpResponse:
        token = _issued.pop(request, None)
        if token is None:
            return super().response_add(request, obj, post_url_continue)
        response = TemplateResponse(
            request,
            "admin/admin_api/admintoken/created.html",
            {
                **self.admin_site.each_context(request),
                "title": "Admin token created",
                "admin_token": obj,
                "token": token,
                "opts": self.opts,
            },
        )
        response["Cache-Control"] = "no-store"
        return response

    @admin.action(description="Revoke the selected tokens")
    def revoke(self, request: HttpRequest, queryset: QuerySet[AdminToken]) -> None:
        done = [row.prefix for row in queryset if tokens.revoke(row.pk)]
        if done:
            self.message_user(request, f"Revoked: {', '.join(done)}.", messages.SUCCESS)
        else:
            self.message_user(request, "Those tokens were revoked already.", messages.INFO)
