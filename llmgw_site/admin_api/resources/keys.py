"""API keys' routes: list, read, issue (the key shown once) and revoke, through
``gateway.identity.keys``. In the OpenAPI document they carry the ``people`` tag: a key is
its owner's.
"""

# No `from __future__ import annotations`: ninja reads the route signatures at import time.

from datetime import datetime
from typing import Any, Literal

from django.contrib.auth.models import User
from django.http import HttpRequest
from django.shortcuts import get_object_or_404
from ninja import Field, Router, Schema, Status
from ninja.pagination import paginate

from gateway.identity import keys
from gateway.models import ApiKey
from llmgw_site.admin_api.auth import reads
from llmgw_site.admin_api.errors import AdminApiError
from llmgw_site.admin_api.pagination import Page
from llmgw_site.admin_api.schemas import Changed, Strict

router = Router(tags=["people"])


class KeyOut(Schema):
    id: int
    prefix: str
    name: str
    user: str = Field(alias="user.username")
    allowed_models: list[str]
    rpm_limit: int | None
    tpm_limit: int | None
    token_budget: int | None
    budget_period: str
    expires_at: datetime | None
    created_at: datetime
    last_used_at: datetime | None
    revoked_at: datetime | None


class KeyIn(Strict):
    user: str
    name: str = Field("", max_length=100)
    models: list[str] = []
    rpm_limit: int | None = Field(None, ge=0)
    tpm_limit: int | None = Field(None, ge=0)
    token_budget: int | None = Field(None, ge=0)
    budget_period: Literal["day", "week", "month"] = "month"
    expires_at: datetime | None = None


class IssuedKeyOut(Schema):
    key: str = Field(description="Shown this once; only its hash is kept.")
    api_key: KeyOut


@router.get("/keys", response=list[KeyOut], auth=reads("gateway.view_apikey"))
@paginate(Page)
def list_keys(request: HttpRequest, user: str | None = None, revoked: bool | None = None) -> Any:
    rows = ApiKey.objects.select_related("user").order_by("-created_at", "-id")
    if user:
        rows = rows.filter(user__username=user)
    if revoked is not None:
        rows = rows.filter(revoked_at__isnull=not revoked)
    return rows


@router.get("/keys/{key_id}", response=KeyOut, auth=reads("gateway.view_apikey"))
def get_key(request: HttpRequest, key_id: int) -> Any:
    return get_object_or_404(ApiKey.objects.select_related("user"), pk=key_id)


@router.post("/keys", response={201: IssuedKeyOut})
def issue_key(request: HttpRequest, payload: KeyIn) -> Any:
    if not User.objects.filter(username=payload.user).exists():
        raise AdminApiError(
            422, code="not_found", message=f"no user {payload.user!r}", field="user"
        )
    issued = keys.issue(
        payload.user,
        name=payload.name,
        models=payload.models,
        expires_at=payload.expires_at,
        rpm=payload.rpm_limit,
        tpm=payload.tpm_limit,
        budget=payload.token_budget,
        budget_period=payload.budget_period,
    )
    row = ApiKey.objects.select_related("user").get(pk=issued.api_key.pk)
    return Status(201, {"key": issued.key, "api_key": row})


@router.post("/keys/{key_id}/revoke", response=Changed)
def revoke_key(request: HttpRequest, key_id: int) -> Any:
    """The key stops working within the gateway's key cache time (seconds)."""
    get_object_or_404(ApiKey, pk=key_id)
    return {"changed": keys.revoke(key_id)}
