"""The catalog's routes: profiles, models (with their scale and pin), and the whole catalog as
one document, read and applied. Entries are written through the catalog import
(``llmgw_site.catalog``, what ``manage.py import_catalog`` uses) and operator changes through
``control.operations``, so every edge leaves the same rows.
"""

# No `from __future__ import annotations`: ninja reads the route signatures at import time.

import json
from datetime import datetime
from typing import Any

import yaml
from django.db import transaction
from django.db.models import Count, Q, QuerySet
from django.http import HttpRequest
from django.shortcuts import get_object_or_404
from ninja import Field, Router, Schema, Status
from ninja.pagination import paginate

from control import operations
from control.models import Profile, Replica, ServedModel
from llmgw_site import catalog
from llmgw_site.admin_api.auth import actor_of, reads, sees_secrets
from llmgw_site.admin_api.errors import AdminApiError
from llmgw_site.admin_api.pagination import Page
from llmgw_site.admin_api.schemas import Strict

router = Router(tags=["catalog"])


class ProfileOut(Schema):
    name: str
    engine: str
    args: list[str]
    env: dict[str, str]
    gpus_per_shard: int
    shards_per_replica: int
    gpu_memory_mib: int
    gpu_selector: dict[str, str]
    placement_strategy: str
    health_path: str
    startup_timeout_s: int


class ProfilePatch(Strict):
    engine: str | None = None
    args: list[str] | None = None
    env: dict[str, str] | None = None
    gpus_per_shard: int | None = Field(None, ge=1)
    shards_per_replica: int | None = Field(None, ge=1)
    gpu_memory_mib: int | None = Field(None, ge=0)
    gpu_selector: dict[str, str] | None = None
    placement_strategy: str | None = None
    health_path: str | None = None
    startup_timeout_s: int | None = Field(None, ge=1)


class ProfileIn(ProfilePatch):
    name: str = Field(min_length=1, max_length=100)


class ModelOut(Schema):
    name: str
    aliases: list[str]
    source: str
    default_profile: str
    profiles: list[str]
    min_replicas: int
    max_replicas: int
    idle_timeout_s: int
    pinned: bool
    activation_timeout_s: int
    max_waiting: int
    connect_timeout_s: float | None
    first_byte_timeout_s: float | None
    stream_idle_timeout_s: float | None
    context_length: int | None
    enabled: bool
    replicas_desired: int
    replicas_ready: int
    placement_note: str
    last_request_at: datetime | None


class ModelPatch(Strict):
    aliases: list[str] | None = None
    source: str | None = Field(None, min_length=1, max_length=500)
    default_profile: str | None = None
    profiles: list[str] | None = None
    min_replicas: int | None = Field(None, ge=0)
    max_replicas: int | None = Field(None, ge=1)
    idle_timeout_s: int | None = Field(None, ge=0)
    pinned: bool | None = None
    activation_timeout_s: int | None = Field(None, ge=0)
    max_waiting: int | None = Field(None, ge=0)
    connect_timeout_s: float | None = Field(None, gt=0)
    first_byte_timeout_s: float | None = Field(None, gt=0)
    stream_idle_timeout_s: float | None = Field(None, gt=0)
    context_length: int | None = Field(None, ge=1, le=2**31 - 1)
    enabled: bool | None = None


class ModelIn(ModelPatch):
    name: str = Field(min_length=1, max_length=200)
    source: str = Field(min_length=1, max_length=500)
    default_profile: str


class ScaleIn(Strict):
    min_replicas: int = Field(ge=0)
    max_replicas: int = Field(ge=1)


class PinIn(Strict):
    pinned: bool


def _models() -> QuerySet[ServedModel]:
    running = Q(replicas__desired=Replica.Desired.RUNNING)
    return (
        ServedModel.objects.select_related("default_profile")
        .prefetch_related("profiles")
        .annotate(
            n_desired=Count("replicas", filter=running),
            n_ready=Count("replicas", filter=running & Q(replicas__observed="ready")),
        )
        .order_by("name")
    )


def _model_out(model: ServedModel) -> dict[str, Any]:
    columns = catalog._columns(ServedModel)
    return {
        **catalog._values(model, columns),
        "default_profile": model.default_profile.name,
        "profiles": sorted(p.name for p in model.profiles.all()),
        "replicas_desired": getattr(model, "n_desired", 0),
        "replicas_ready": getattr(model, "n_ready", 0),
        "placement_note": model.placement_note,
        "last_request_at": model.last_request_at,
    }


def _profile_out(request: HttpRequest, profile: Profile) -> dict[str, Any]:
    """The profile as the caller may see it: secrets in its environment masked unless they
    may see them."""
    values = catalog.profile_values(profile, reveal_secrets=sees_secrets(request))
    return {"name": profile.name, **values}


def _import_one(section: str, entry: dict[str, Any]) -> None:
    """Create or update one catalog entry through the catalog import (the function
    ``manage.py import_catalog`` uses): the same checks, the same rows."""
    try:
        catalog.import_data({section: [entry]})
    except catalog.CatalogError as exc:
        field = exc.field.removeprefix(f"{section}[0]").lstrip(".")
        raise AdminApiError(422, code="invalid", message=str(exc), field=field) from None


def _model(name: str) -> ServedModel:
    model = ServedModel.objects.filter(name=name).first()
    if model is None:
        raise AdminApiError(404, code="not_found", message=f"no model {name!r}", field="name")
    return model


@router.get("/profiles", response=list[ProfileOut], auth=reads("control.view_profile"))
@paginate(Page)
def list_profiles(request: HttpRequest) -> Any:
    return [_profile_out(request, p) for p in Profile.objects.order_by("name")]


@router.get("/profiles/{name}", response=ProfileOut, auth=reads("control.view_profile"))
def get_profile(request: HttpRequest, name: str) -> Any:
    return _profile_out(request, get_object_or_404(Profile, name=name))


@router.post("/profiles", response={201: ProfileOut})
def create_profile(request: HttpRequest, payload: ProfileIn) -> Any:
    if Profile.objects.filter(name=payload.name).exists():
        raise AdminApiError(
            409, code="exists", message=f"profile {payload.name!r} exists", field="name"
        )
    _import_one("profiles", payload.dict(exclude_unset=True))
    return Status(201, _profile_out(request, Profile.objects.get(name=payload.name)))


@router.patch("/profiles/{name}", response=ProfileOut)
def update_profile(request: HttpRequest, name: str, payload: ProfilePatch) -> Any:
    get_object_or_404(Profile, name=name)
    _import_one("profiles", {"name": name, **payload.dict(exclude_unset=True)})
    return _profile_out(request, Profile.objects.get(name=name))


@router.delete("/profiles/{name}", response={204: None})
def delete_profile(request: HttpRequest, name: str) -> Any:
    profile = get_object_or_404(Profile, name=name)
    try:
        operations.delete_profile(profile.pk, actor=actor_of(request))
    except operations.InUse as exc:
        raise AdminApiError(409, code="in_use", message=exc.message, field=exc.field) from None
    return Status(204, None)


@router.get("/models", response=list[ModelOut], auth=reads("control.view_servedmodel"))
@paginate(Page)
def list_models(request: HttpRequest) -> Any:
    return [_model_out(m) for m in _models()]


@router.get("/models/{name}", response=ModelOut, auth=reads("control.view_servedmodel"))
def get_model(request: HttpRequest, name: str) -> Any:
    return _model_out(get_object_or_404(_models(), name=name))


@router.post("/models", response={201: ModelOut})
def create_model(request: HttpRequest, payload: ModelIn) -> Any:
    if ServedModel.objects.filter(name=payload.name).exists():
        raise AdminApiError(
            409, code="exists", message=f"model {payload.name!r} exists", field="name"
        )
    _import_one("models", payload.dict(exclude_unset=True))
    return Status(201, _model_out(_models().get(name=payload.name)))


@router.patch("/models/{name}", response=ModelOut)
def update_model(request: HttpRequest, name: str, payload: ModelPatch) -> Any:
    """Change a model's entry. Its replica counts and its pin are operator changes of their
    own, recorded with who made them: they go through the functions of ``…/scale`` and
    ``…/pin`` (and the admin's, and ``manage.py scale_model``/``pin_model``). All or nothing."""
    model = _model(name)
    changes = payload.dict(exclude_unset=True)
    minimum, maximum = changes.pop("min_replicas", None), changes.pop("max_replicas", None)
    pinned = changes.pop("pinned", None)
    actor = actor_of(request)
    with transaction.atomic():
        if changes:
            entry = {"name": name, "default_profile": model.default_profile.name}
            _import_one("models", {**entry, **changes})
        if minimum is not None or maximum is not None:
            try:
                operations.scale_model(
                    model.pk,
                    min_replicas=model.min_replicas if minimum is None else minimum,
                    max_replicas=model.max_replicas if maximum is None else maximum,
                    actor=actor,
                )
            except operations.Invalid as exc:
                raise AdminApiError(
                    422, code="invalid", message=exc.message, field=exc.field
                ) from None
        if pinned is not None:
            operations.pin_model(model.pk, pinned=pinned, actor=actor)
    return _model_out(_models().get(name=name))


@router.delete("/models/{name}", response={204: None})
def delete_model(request: HttpRequest, name: str) -> Any:
    operations.delete_model(_model(name).pk, actor=actor_of(request))
    return Status(204, None)


@router.post("/models/{name}/scale", response=ModelOut)
def scale_model(request: HttpRequest, name: str, payload: ScaleIn) -> Any:
    try:
        operations.scale_model(
            _model(name).pk,
            min_replicas=payload.min_replicas,
            max_replicas=payload.max_replicas,
            actor=actor_of(request),
        )
    except operations.Invalid as exc:
        raise AdminApiError(422, code="invalid", message=exc.message, field=exc.field) from None
    return _model_out(_models().get(name=name))


@router.post("/models/{name}/pin", response=ModelOut)
def pin_model(request: HttpRequest, name: str, payload: PinIn) -> Any:
    operations.pin_model(_model(name).pk, pinned=payload.pinned, actor=actor_of(request))
    return _model_out(_models().get(name=name))


class CatalogResult(Schema):
    dry_run: bool
    created: list[str]
    updated: list[str]
    unchanged: list[str]
    changes: dict[str, dict[str, dict[str, Any]]]


@router.get(
    "/catalog",
    response=dict[str, Any],
    auth=reads("control.view_profile", "control.view_servedmodel", "gateway.view_endpoint"),
)
def get_catalog(request: HttpRequest) -> Any:
    """The whole catalog, as ``manage.py export_catalog`` writes it (JSON): secrets in
    profile environments as they are for superusers and read-write tokens, masked for
    everybody else (a masked document applied back keeps the stored secrets)."""
    return catalog.export(reveal_secrets=sees_secrets(request))


@router.put(
    "/catalog",
    response=CatalogResult,
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": {"type": "object"}},
                "application/yaml": {"schema": {"type": "string"}},
            },
        }
    },
)
def put_catalog(request: HttpRequest, dry_run: bool = False) -> Any:
    """Apply a catalog document (the ``export_catalog`` format, JSON or YAML): entries are
    created or updated, all or nothing; applying the same document twice changes nothing the
    second time. ``?dry_run=true`` answers what would change, field by field, and writes
    nothing. Entries absent from the document are left alone."""
    kind = request.content_type or ""
    try:
        if "yaml" in kind:
            document = yaml.safe_load(request.body.decode("utf-8"))
        else:
            document = json.loads(request.body)
    except (ValueError, yaml.YAMLError) as exc:
        raise AdminApiError(
            400, code="bad_document", message=f"not a JSON or YAML document: {exc}"
        ) from None
    try:
        result = catalog.import_data(document, dry_run=dry_run)
    except catalog.CatalogError as exc:
        raise AdminApiError(422, code="invalid", message=str(exc), field=exc.field) from None
    return {"dry_run": dry_run, **result.as_dict()}
