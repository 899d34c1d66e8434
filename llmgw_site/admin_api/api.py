"""``/api/admin/v1/``: the operators' API (django-ninja), with its own OpenAPI document at
``/api/admin/v1/openapi.json`` (interactive docs at ``/api/admin/v1/docs``).

An edge: each route parses its input, calls the one domain function for the change (the same the
admin's actions and the ``manage.py`` commands call: ``control.operations``,
``control.node_tokens``, ``gateway.identity.keys``, ``gateway.identity.people``,
``llmgw_site.catalog``) and formats the result. Errors are ``{"error": {"code", "message",
"field"}}``; every list is paginated with ``limit`` and ``offset`` and answers ``{"items",
"count"}``.

Routes are synchronous: this is an operator's API, not the request path, and the ORM calls
would need a thread each anyway.
"""

# No `from __future__ import annotations`: ninja reads the route signatures at import time.

import functools
import json
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import yaml
from django.conf import settings
from django.contrib.auth.models import Group, User
from django.core.exceptions import ValidationError as DjangoValidationError
from django.db import DataError, transaction
from django.db.models import Count, F, Q, QuerySet, Sum
from django.db.models.functions import Coalesce
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404
from ninja import Field, NinjaAPI, Query, Router, Schema, Status
from ninja.errors import AuthenticationError, HttpError, ValidationError
from ninja.pagination import LimitOffsetPagination, paginate
from pydantic import ConfigDict, field_validator

from control import leases, node_certs, node_tokens, operations
from control.models import Event, Node, Profile, Replica, ServedModel
from gateway.identity import allowances, keys
from gateway.identity import people as gateway_people
from gateway.ledger import reports
from gateway.models import ApiKey, TeamLimits, UsageRecord, UserLimits
from llmgw_site import catalog
from llmgw_site.admin_api.auth import AdminAuth, Caller, Denied

MAX_PAGE = 500


class ApiError(Exception):
    """An answer other than success: HTTP status, a stable code, and the field at fault."""

    def __init__(self, status: int, code: str, message: str, field: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.field = field


def caller(request: HttpRequest) -> Caller:
    who = request.auth  # type: ignore[attr-defined]
    assert isinstance(who, Caller)
    return who


class ErrorDetail(Schema):
    code: str
    message: str
    field: str | None


class FieldError(Schema):
    field: str
    message: str


class ErrorOut(Schema):
    error: ErrorDetail
    errors: list[FieldError] | None = None


# Every route may answer these (authentication, power, lockout, input); the document says so,
# so that a client generated from it knows the error shape.
ERRORS = {
    "401": "no admin token or staff session, or a wrong one",
    "403": "a read-only token or account writing, or a signed-in write without CSRF",
    "404": "no such row",
    "409": "the name is taken, or the row is in use",
    "422": "a value is wrong; `field` names it",
    "429": "too many failed sign-ins from this address or for this token",
}


class AdminNinjaAPI(NinjaAPI):
    def get_openapi_operation_id(self, operation: Any) -> str:
        # "drain_node", not "llmgw_site_admin_api_api_drain_node": what generated clients call.
        return str(operation.view_func.__name__)

    def get_openapi_schema(self, *args: Any, **kwargs: Any) -> Any:
        schema = super().get_openapi_schema(*args, **kwargs)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        body = ErrorOut.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(body.pop("$defs", {}))
        components["ErrorOut"] = body
        content = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorOut"}}}
        for path in schema["paths"].values():
            for operation in path.values():
                responses = operation.setdefault("responses", {})
                for status, description in ERRORS.items():
                    responses.setdefault(status, {"description": description, "content": content})
                if operation.get("operationId") == "put_catalog":
                    responses.setdefault(
                        "400", {"description": "not a JSON or YAML document", "content": content}
                    )
        return schema


api = AdminNinjaAPI(
    title="llmgw admin API",
    version="1",
    description="Operate llmgw from programs: the catalog, nodes, replicas, users, teams, "
    "API keys, usage, events and the lease. Authenticate with an admin token "
    "(Authorization: Bearer llmgw-admin-…) or a staff session with its CSRF token.",
    urls_namespace="admin_api",
    auth=AdminAuth(),
)


def one_transaction(view: Callable[..., Any]) -> Callable[..., Any]:
    """Each route in one transaction: a change is all or nothing, and a value the store
    refuses (a NUL character, a time zone PostgreSQL does not know, a number past its
    integers) is the caller's 422, not a half-done request or a 500."""

    @functools.wraps(view)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            with transaction.atomic():
                return view(*args, **kwargs)
        except (DataError, OverflowError) as exc:
            raise ApiError(
                422, "invalid", f"a value the store cannot hold: {str(exc).splitlines()[0]}"
            ) from None

    return wrapper


api.add_decorator(one_transaction)


def _error(request: HttpRequest, status: int, code: str, message: str, field: str = "") -> Any:
    return api.create_response(
        request,
        {"error": {"code": code, "message": message, "field": field or None}},
        status=status,
    )


@api.exception_handler(ApiError)
def _api_error(request: HttpRequest, exc: ApiError) -> HttpResponse:
    return _error(request, exc.status, exc.code, exc.message, exc.field)  # type: ignore[no-any-return]


@api.exception_handler(Denied)
def _denied(request: HttpRequest, exc: Denied) -> HttpResponse:
    return _error(request, exc.status, exc.code, exc.message)  # type: ignore[no-any-return]


@api.exception_handler(AuthenticationError)
def _unauthenticated(request: HttpRequest, exc: AuthenticationError) -> HttpResponse:
    return _error(request, 401, "unauthorized", "send an admin token or sign in as staff")  # type: ignore[no-any-return]


def _field_of(loc: list[Any] | tuple[Any, ...]) -> str:
    # ninja's locations are ("body", <parameter>, field...) or ("query", field...).
    parts = [str(p) for p in loc]
    if parts and parts[0] == "body":
        parts = parts[2:] if len(parts) > 2 else parts[1:]
    elif parts and parts[0] in {"query", "path"}:
        parts = parts[1:]
    return ".".join(parts)


@api.exception_handler(ValidationError)
def _invalid(request: HttpRequest, exc: ValidationError) -> HttpResponse:
    errors = [
        {"field": _field_of(e.get("loc", ())), "message": str(e.get("msg", "invalid"))}
        for e in exc.errors
    ]
    first = errors[0] if errors else {"field": "", "message": "invalid request"}
    response = api.create_response(
        request,
        {
            "error": {
                "code": "invalid",
                "message": first["message"],
                "field": first["field"] or None,
            },
            "errors": errors,
        },
        status=422,
    )
    return response


@api.exception_handler(HttpError)
def _http_error(request: HttpRequest, exc: HttpError) -> HttpResponse:
    code = {400: "bad_request", 404: "not_found", 405: "method_not_allowed"}.get(
        exc.status_code, "error"
    )
    return _error(request, exc.status_code, code, str(exc))  # type: ignore[no-any-return]


@api.exception_handler(Http404)
def _not_found(request: HttpRequest, exc: Http404) -> HttpResponse:
    return _error(request, 404, "not_found", str(exc) or "not found")  # type: ignore[no-any-return]


MAX_OFFSET = 2**31 - 1  # past any table here; larger numbers overflow the stores' integers


class Page(LimitOffsetPagination):
    """``?limit=`` (at most 500, default 100) and ``?offset=``; answers ``items`` and ``count``."""

    class Input(Schema):
        limit: int = Field(100, ge=1, le=MAX_PAGE)
        offset: int = Field(0, ge=0, le=MAX_OFFSET)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(max_limit=MAX_PAGE, **kwargs)


class Strict(Schema):
    """Inputs refuse fields they do not know, so a typo is an error, not a silent no-op, and
    text with NUL characters (which PostgreSQL cannot store, and no name needs)."""

    model_config = ConfigDict(extra="forbid")

    @field_validator("*", mode="after")
    @classmethod
    def _no_nul(cls, value: Any) -> Any:
        if _has_nul(value):
            raise ValueError("must not contain NUL characters")
        return value


def _has_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, list):
        return any(_has_nul(v) for v in value)
    if isinstance(value, dict):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    return False


class Changed(Schema):
    changed: bool


# --------------------------------------------------------------------------- the catalog

catalog_router = Router(tags=["catalog"])


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


def _profile_out(profile: Profile) -> dict[str, Any]:
    return {"name": profile.name, **catalog._values(profile, catalog._columns(Profile))}


def _import_one(section: str, entry: dict[str, Any]) -> None:
    """Create or update one catalog entry through the catalog import (the function
    ``manage.py import_catalog`` uses): the same checks, the same rows."""
    try:
        catalog.import_data({section: [entry]})
    except catalog.CatalogError as exc:
        field = exc.field.removeprefix(f"{section}[0]").lstrip(".")
        raise ApiError(422, "invalid", str(exc), field) from None


def _model(name: str) -> ServedModel:
    model = ServedModel.objects.filter(name=name).first()
    if model is None:
        raise ApiError(404, "not_found", f"no model {name!r}", "name")
    return model


@catalog_router.get("/profiles", response=list[ProfileOut])
@paginate(Page)
def list_profiles(request: HttpRequest) -> Any:
    return [_profile_out(p) for p in Profile.objects.order_by("name")]


@catalog_router.get("/profiles/{name}", response=ProfileOut)
def get_profile(request: HttpRequest, name: str) -> Any:
    return _profile_out(get_object_or_404(Profile, name=name))


@catalog_router.post("/profiles", response={201: ProfileOut})
def create_profile(request: HttpRequest, payload: ProfileIn) -> Any:
    if Profile.objects.filter(name=payload.name).exists():
        raise ApiError(409, "exists", f"profile {payload.name!r} exists", "name")
    _import_one("profiles", payload.dict(exclude_unset=True))
    return Status(201, _profile_out(Profile.objects.get(name=payload.name)))


@catalog_router.patch("/profiles/{name}", response=ProfileOut)
def update_profile(request: HttpRequest, name: str, payload: ProfilePatch) -> Any:
    get_object_or_404(Profile, name=name)
    _import_one("profiles", {"name": name, **payload.dict(exclude_unset=True)})
    return _profile_out(Profile.objects.get(name=name))


@catalog_router.delete("/profiles/{name}", response={204: None})
def delete_profile(request: HttpRequest, name: str) -> Any:
    profile = get_object_or_404(Profile, name=name)
    try:
        operations.delete_profile(profile.pk, actor=caller(request).actor)
    except operations.InUse as exc:
        raise ApiError(409, "in_use", exc.message, exc.field) from None
    return Status(204, None)


@catalog_router.get("/models", response=list[ModelOut])
@paginate(Page)
def list_models(request: HttpRequest) -> Any:
    return [_model_out(m) for m in _models()]


@catalog_router.get("/models/{name}", response=ModelOut)
def get_model(request: HttpRequest, name: str) -> Any:
    return _model_out(get_object_or_404(_models(), name=name))


@catalog_router.post("/models", response={201: ModelOut})
def create_model(request: HttpRequest, payload: ModelIn) -> Any:
    if ServedModel.objects.filter(name=payload.name).exists():
        raise ApiError(409, "exists", f"model {payload.name!r} exists", "name")
    _import_one("models", payload.dict(exclude_unset=True))
    return Status(201, _model_out(_models().get(name=payload.name)))


@catalog_router.patch("/models/{name}", response=ModelOut)
def update_model(request: HttpRequest, name: str, payload: ModelPatch) -> Any:
    """Change a model's entry. Its replica counts and its pin are operator changes of their
    own, recorded with who made them: they go through the functions of ``…/scale`` and
    ``…/pin`` (and the admin's, and ``manage.py scale_model``/``pin_model``). All or nothing."""
    model = _model(name)
    changes = payload.dict(exclude_unset=True)
    minimum, maximum = changes.pop("min_replicas", None), changes.pop("max_replicas", None)
    pinned = changes.pop("pinned", None)
    actor = caller(request).actor
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
                raise ApiError(422, "invalid", exc.message, exc.field) from None
        if pinned is not None:
            operations.pin_model(model.pk, pinned=pinned, actor=actor)
    return _model_out(_models().get(name=name))


@catalog_router.delete("/models/{name}", response={204: None})
def delete_model(request: HttpRequest, name: str) -> Any:
    operations.delete_model(_model(name).pk, actor=caller(request).actor)
    return Status(204, None)


@catalog_router.post("/models/{name}/scale", response=ModelOut)
def scale_model(request: HttpRequest, name: str, payload: ScaleIn) -> Any:
    try:
        operations.scale_model(
            _model(name).pk,
            min_replicas=payload.min_replicas,
            max_replicas=payload.max_replicas,
            actor=caller(request).actor,
        )
    except operations.Invalid as exc:
        raise ApiError(422, "invalid", exc.message, exc.field) from None
    return _model_out(_models().get(name=name))


@catalog_router.post("/models/{name}/pin", response=ModelOut)
def pin_model(request: HttpRequest, name: str, payload: PinIn) -> Any:
    operations.pin_model(_model(name).pk, pinned=payload.pinned, actor=caller(request).actor)
    return _model_out(_models().get(name=name))


class CatalogResult(Schema):
    dry_run: bool
    created: list[str]
    updated: list[str]
    unchanged: list[str]
    changes: dict[str, dict[str, dict[str, Any]]]


@catalog_router.get("/catalog", response=dict[str, Any])
def get_catalog(request: HttpRequest) -> Any:
    """The whole catalog, as ``manage.py export_catalog`` writes it (JSON)."""
    return catalog.export()


@catalog_router.put(
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
        raise ApiError(400, "bad_document", f"not a JSON or YAML document: {exc}") from None
    try:
        result = catalog.import_data(document, dry_run=dry_run)
    except catalog.CatalogError as exc:
        raise ApiError(422, "invalid", str(exc), exc.field) from None
    return {"dry_run": dry_run, **result.as_dict()}


# --------------------------------------------------------------------------- nodes

fleet_router = Router(tags=["fleet"])


class GpuOut(Schema):
    index: int
    uuid: str
    model: str
    memory_total_mib: int
    memory_used_mib: int


class NodeOut(Schema):
    name: str
    state: str
    schedule: str
    health: str
    addresses: list[str]
    labels: dict[str, str]
    last_heartbeat_at: datetime | None
    agent_version: str
    token_prefix: str
    token_issued_at: datetime | None
    cert_serial: str = Field(description="The node's one valid certificate; empty: none.")
    cert_issued_at: datetime | None
    gpus: list[GpuOut]


class NodeChange(Schema):
    changed: bool
    node: NodeOut


class TokenOut(Schema):
    node: str
    token: str = Field(description="Shown this once; only its hash is kept.")
    prefix: str


class CertOut(Schema):
    node: str
    serial: str
    certificate: str = Field(description="PEM; the agent's --tls-cert.")
    key: str = Field(description="PEM; the agent's --tls-key. Shown this once; not kept.")
    ca_certificate: str = Field(description="PEM; the agent's --tls-ca.")


def _nodes() -> QuerySet[Node]:
    return Node.objects.prefetch_related("gpus").order_by("name")


def _node(name: str) -> Node:
    node = _nodes().filter(name=name).first()
    if node is None:
        raise ApiError(404, "not_found", f"no node {name!r}", "name")
    return node


@fleet_router.get("/nodes", response=list[NodeOut])
@paginate(Page)
def list_nodes(
    request: HttpRequest,
    schedule: Literal["active", "cordoned", "draining"] | None = None,
    health: Literal["new", "ready", "unreachable", "lost"] | None = None,
) -> Any:
    nodes = _nodes()
    if schedule:
        nodes = nodes.filter(schedule=schedule)
    if health:
        nodes = nodes.filter(health=health)
    return nodes


@fleet_router.get("/nodes/{name}", response=NodeOut)
def get_node(request: HttpRequest, name: str) -> Any:
    return _node(name)


def _schedule(request: HttpRequest, name: str, change: Any) -> dict[str, Any]:
    node = _node(name)
    changed = change(node.pk, actor=caller(request).actor)
    return {"changed": changed, "node": _node(name)}


@fleet_router.post("/nodes/{name}/cordon", response=NodeChange)
def cordon_node(request: HttpRequest, name: str) -> Any:
    """No new placements on the node; what runs there keeps running."""
    return _schedule(request, name, operations.cordon_node)


@fleet_router.post("/nodes/{name}/drain", response=NodeChange)
def drain_node(request: HttpRequest, name: str) -> Any:
    """Move every replica off the node: placed elsewhere, then stopped here once idle."""
    return _schedule(request, name, operations.drain_node)


@fleet_router.post("/nodes/{name}/undrain", response=NodeChange)
def undrain_node(request: HttpRequest, name: str) -> Any:
    """Schedulable again."""
    return _schedule(request, name, operations.undrain_node)


@fleet_router.post("/nodes/{name}/token", response={201: TokenOut})
def issue_node_token(request: HttpRequest, name: str) -> Any:
    """A new token for the node (registered if new); the previous one stops working."""
    _valid_node_name(name)
    token = node_tokens.issue_node_token(name)
    return Status(
        201, {"node": name, "token": token, "prefix": token[: node_tokens.TOKEN_VISIBLE_CHARS]}
    )


@fleet_router.delete("/nodes/{name}/token", response=Changed)
def revoke_node_token(request: HttpRequest, name: str) -> Any:
    _node(name)
    return {"changed": node_tokens.revoke_node_token(name)}


def _valid_node_name(name: str) -> None:
    try:
        Node._meta.get_field("name").clean(name, None)
    except DjangoValidationError as exc:
        raise ApiError(422, "invalid", "; ".join(exc.messages), "name") from None


@fleet_router.post("/nodes/{name}/certificate", response={201: CertOut})
def issue_node_cert(request: HttpRequest, name: str) -> Any:
    """A new client certificate and key for the node's agent, from the cluster CA (the node is
    registered if new); its previous certificate stops working and its streams close. The key
    is in this answer only: store it on the node's host, mode 0600."""
    _valid_node_name(name)
    try:
        minted = node_certs.mint_node_cert(name, Path(settings.LLMGW_CA_DIR))
    except node_certs.CaError as exc:
        raise ApiError(409, "no_ca", str(exc)) from None
    return Status(
        201,
        {
            "node": name,
            "serial": minted.serial,
            "certificate": minted.cert_pem.decode(),
            "key": minted.key_pem.decode(),
            "ca_certificate": minted.ca_pem.decode(),
        },
    )


@fleet_router.delete("/nodes/{name}/certificate", response=Changed)
def revoke_node_cert(request: HttpRequest, name: str) -> Any:
    """The node's certificate opens no stream any more; its open streams are closed."""
    _node(name)
    return {"changed": node_certs.revoke_node_cert(name)}


class ShardOut(Schema):
    node: str = Field(alias="node.name")
    rank: int
    gpu_indices: list[int]
    port: int
    observed: str
    exit_code: int | None
    failure_class: str
    message: str


class ReplicaOut(Schema):
    id: int
    model: str = Field(alias="model.name")
    profile: str = Field(alias="profile.name")
    desired: str
    observed: str
    failures: int
    failure_class: str
    generation: int
    ready_at: datetime | None
    shards: list[ShardOut]

    @staticmethod
    def resolve_shards(obj: Replica) -> list[Any]:
        return list(obj.shards.all())


class ReplicaChange(Schema):
    changed: bool
    replica: ReplicaOut


def _replicas() -> QuerySet[Replica]:
    return (
        Replica.objects.select_related("model", "profile")
        .prefetch_related("shards__node")
        .order_by("model__name", "id")
    )


@fleet_router.get("/replicas", response=list[ReplicaOut])
@paginate(Page)
def list_replicas(
    request: HttpRequest,
    model: str | None = None,
    node: str | None = None,
    desired: Literal["running", "draining", "stopped"] | None = None,
) -> Any:
    replicas = _replicas()
    if model:
        replicas = replicas.filter(model__name=model)
    if node:
        replicas = replicas.filter(shards__node__name=node).distinct()
    if desired:
        replicas = replicas.filter(desired=desired)
    return replicas


@fleet_router.get("/replicas/{replica_id}", response=ReplicaOut)
def get_replica(request: HttpRequest, replica_id: int) -> Any:
    return get_object_or_404(_replicas(), pk=replica_id)


@fleet_router.post("/replicas/{replica_id}/restart", response=ReplicaChange)
def restart_replica(request: HttpRequest, replica_id: int) -> Any:
    """Start the replica's shards afresh (a new generation). ``changed`` is false for a
    replica not wanted running."""
    try:
        changed = operations.restart_replica(replica_id, actor=caller(request).actor)
    except operations.NotFound as exc:
        raise ApiError(404, "not_found", str(exc), "replica_id") from None
    return {"changed": changed, "replica": _replicas().get(pk=replica_id)}


class LeaseOut(Schema):
    name: str
    owner: str
    epoch: int
    expires_in: float
    held: bool


@fleet_router.get("/lease", response=LeaseOut)
def get_lease(request: HttpRequest) -> Any:
    """Who leads the control plane now, on the database's clock."""
    view = leases.read()
    if view is None:
        return {
            "name": leases.RECONCILER,
            "owner": "",
            "epoch": 0,
            "expires_in": 0.0,
            "held": False,
        }
    return {
        "name": view.name,
        "owner": view.owner,
        "epoch": view.epoch,
        "expires_in": view.expires_in,
        "held": view.held,
    }


class EventOut(Schema):
    id: int
    created_at: datetime
    kind: str
    subject: str
    message: str
    epoch: int
    data: dict[str, Any]


@fleet_router.get("/events", response=list[EventOut])
@paginate(Page)
def list_events(
    request: HttpRequest,
    kind: str | None = None,
    subject: str | None = None,
    since: datetime | None = None,
) -> Any:
    """Newest first. ``subject`` is exact (``node/gpu-7``) or a prefix ending in ``/``
    (``model/``)."""
    events = Event.objects.order_by("-created_at", "-id")
    if kind:
        events = events.filter(kind=kind)
    if subject:
        events = (
            events.filter(subject__startswith=subject)
            if subject.endswith("/")
            else events.filter(subject=subject)
        )
    if since:
        events = events.filter(created_at__gte=since)
    return events


# --------------------------------------------------------------------------- people and keys

people_router = Router(tags=["people"])


class UserOut(Schema):
    username: str
    email: str
    is_active: bool
    is_staff: bool
    is_superuser: bool
    date_joined: datetime
    last_login: datetime | None
    teams: list[str]

    @staticmethod
    def resolve_teams(obj: User) -> list[str]:
        return sorted(g.name for g in obj.groups.all())


class UserPatch(Strict):
    email: str | None = Field(None, max_length=254)
    is_active: bool | None = None
    is_staff: bool | None = None
    teams: list[str] | None = None


class UserIn(UserPatch):
    username: str = Field(min_length=1, max_length=150, pattern=r"^[\w.@+-]+$")


class TeamOut(Schema):
    name: str
    members: list[str]

    @staticmethod
    def resolve_members(obj: Group) -> list[str]:
        return sorted(u.username for u in obj.user_set.all())


class TeamIn(Strict):
    name: str = Field(min_length=1, max_length=150)
    members: list[str] = []


class MembersIn(Strict):
    members: list[str]


PeopleError = gateway_people.Conflict | gateway_people.Missing | gateway_people.PersonInvalid


def _people_error(exc: PeopleError) -> ApiError:
    if isinstance(exc, gateway_people.Conflict):
        return ApiError(409, "exists", str(exc), exc.field)
    if isinstance(exc, gateway_people.PersonInvalid):
        return ApiError(422, "invalid", str(exc), exc.field)
    return ApiError(
        404 if exc.field in {"username", "name"} else 422, "not_found", str(exc), exc.field
    )


@people_router.get("/users", response=list[UserOut])
@paginate(Page)
def list_users(request: HttpRequest, team: str | None = None, staff: bool | None = None) -> Any:
    users = User.objects.prefetch_related("groups").order_by("username")
    if team:
        users = users.filter(groups__name=team)
    if staff is not None:
        users = users.filter(is_staff=staff)
    return users


@people_router.get("/users/{username}", response=UserOut)
def get_user(request: HttpRequest, username: str) -> Any:
    return get_object_or_404(User.objects.prefetch_related("groups"), username=username)


@people_router.post("/users", response={201: UserOut})
def create_user(request: HttpRequest, payload: UserIn) -> Any:
    try:
        user = gateway_people.create_user(
            payload.username,
            actor=caller(request).actor,
            email=payload.email or "",
            is_staff=bool(payload.is_staff),
            is_active=payload.is_active is not False,
            teams=payload.teams or [],
        )
    except (gateway_people.Conflict, gateway_people.Missing, gateway_people.PersonInvalid) as exc:
        raise _people_error(exc) from None
    return Status(201, user)


@people_router.patch("/users/{username}", response=UserOut)
def update_user(request: HttpRequest, username: str, payload: UserPatch) -> Any:
    # null keeps a field, as if it were not sent.
    changes = {k: v for k, v in payload.dict(exclude_unset=True).items() if v is not None}
    try:
        return gateway_people.update_user(username, actor=caller(request).actor, **changes)
    except (gateway_people.Conflict, gateway_people.Missing, gateway_people.PersonInvalid) as exc:
        raise _people_error(exc) from None


@people_router.get("/teams", response=list[TeamOut])
@paginate(Page)
def list_teams(request: HttpRequest) -> Any:
    return Group.objects.prefetch_related("user_set").order_by("name")


@people_router.get("/teams/{name}", response=TeamOut)
def get_team(request: HttpRequest, name: str) -> Any:
    return get_object_or_404(Group.objects.prefetch_related("user_set"), name=name)


@people_router.post("/teams", response={201: TeamOut})
def create_team(request: HttpRequest, payload: TeamIn) -> Any:
    try:
        return Status(
            201,
            gateway_people.create_team(
                payload.name, actor=caller(request).actor, members=payload.members
            ),
        )
    except (gateway_people.Conflict, gateway_people.Missing, gateway_people.PersonInvalid) as exc:
        raise _people_error(exc) from None


@people_router.put("/teams/{name}/members", response=TeamOut)
def set_team_members(request: HttpRequest, name: str, payload: MembersIn) -> Any:
    try:
        return gateway_people.set_team_members(name, payload.members, actor=caller(request).actor)
    except (gateway_people.Conflict, gateway_people.Missing, gateway_people.PersonInvalid) as exc:
        raise _people_error(exc) from None


@people_router.delete("/teams/{name}", response={204: None})
def delete_team(request: HttpRequest, name: str) -> Any:
    if not gateway_people.delete_team(name, actor=caller(request).actor):
        raise ApiError(404, "not_found", f"no team {name!r}", "name")
    return Status(204, None)


class LimitsOut(Schema):
    """A user's or team's own limits (none set: every field empty), with the budget's spend in
    the current period. A key's effective limits are the narrowest of its own, its owner's and
    its owner's teams'."""

    allowed_models: list[str] = Field(description="Empty: every model.")
    rpm_limit: int | None
    tpm_limit: int | None
    token_budget: int | None
    budget_period: Literal["day", "week", "month"]
    spent: int = Field(description="Tokens used in the current budget period.")
    period_start: datetime


class UserLimitsOut(LimitsOut):
    self_service: bool = Field(description="May make their own keys at /account/.")


class LimitsPatch(Strict):
    """The limits to change; those left out keep their value, ``null`` means no limit."""

    allowed_models: list[str] | None = Field(None, description="Empty: every model.")
    rpm_limit: int | None = Field(None, ge=0, le=2**31 - 1)
    tpm_limit: int | None = Field(None, ge=0, le=2**31 - 1)
    token_budget: int | None = Field(None, ge=0, le=2**63 - 1)
    budget_period: Literal["day", "week", "month"] | None = None

    @field_validator("allowed_models", mode="after")
    @classmethod
    def _names(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and not all(name.strip() for name in value):
            raise ValueError("model names must not be empty")
        return value


class UserLimitsPatch(LimitsPatch):
    self_service: bool | None = None


def _limits_changes(payload: LimitsPatch) -> dict[str, Any]:
    changes = payload.dict(exclude_unset=True)
    for name in ("allowed_models", "budget_period", "self_service"):
        if name in changes and changes[name] is None:  # these have no "no limit"
            raise ApiError(422, "invalid", f"{name} cannot be null", name)
    return changes


def _limits_out(
    row: UserLimits | TeamLimits | None, spent_by: Callable[[Any], int]
) -> dict[str, Any]:
    period = row.budget_period if row is not None else ApiKey.BudgetPeriod.MONTH
    return {
        "allowed_models": list(row.allowed_models or []) if row is not None else [],
        "rpm_limit": row.rpm_limit if row is not None else None,
        "tpm_limit": row.tpm_limit if row is not None else None,
        "token_budget": row.token_budget if row is not None else None,
        "budget_period": period,
        "spent": spent_by(row) if row is not None else 0,
        "period_start": allowances.period_start(period),
        "self_service": row.self_service if isinstance(row, UserLimits) else True,
    }


def _user_pk(username: str) -> int:
    pk = User.objects.filter(username=username).values_list("pk", flat=True).first()
    if pk is None:
        raise ApiError(404, "not_found", f"no user {username!r}", "username")
    return int(pk)


def _team_pk(name: str) -> int:
    pk = Group.objects.filter(name=name).values_list("pk", flat=True).first()
    if pk is None:
        raise ApiError(404, "not_found", f"no team {name!r}", "name")
    return int(pk)


def _set_limits(
    request: HttpRequest, change: Callable[..., Any], holder: int, changes: dict[str, Any]
) -> Any:
    try:
        return change(holder, actor=caller(request).actor, **changes)
    except gateway_people.LimitsInvalid as exc:
        raise ApiError(422, "invalid", str(exc), exc.field) from None


@people_router.get("/users/{username}/limits", response=UserLimitsOut)
def get_user_limits(request: HttpRequest, username: str) -> Any:
    """The user's own limits over all their keys, and whether they may make keys."""
    row = UserLimits.objects.filter(user_id=_user_pk(username)).first()
    return _limits_out(row, allowances.user_spend)


@people_router.patch("/users/{username}/limits", response=UserLimitsOut)
def update_user_limits(request: HttpRequest, username: str, payload: UserLimitsPatch) -> Any:
    """Change the given limits; keys take the change up within the key cache's TTL."""
    changes = _limits_changes(payload)
    row = _set_limits(request, gateway_people.set_user_limits, _user_pk(username), changes)
    return _limits_out(row, allowances.user_spend)


@people_router.delete("/users/{username}/limits", response=Changed)
def clear_user_limits(request: HttpRequest, username: str) -> Any:
    """No limits of the user's own (their keys' and teams' still apply); self-service on."""
    return {
        "changed": gateway_people.clear_user_limits(_user_pk(username), actor=caller(request).actor)
    }


@people_router.get("/teams/{name}/limits", response=LimitsOut)
def get_team_limits(request: HttpRequest, name: str) -> Any:
    """The team's limits over all its members' keys."""
    row = TeamLimits.objects.filter(team_id=_team_pk(name)).first()
    return _limits_out(row, allowances.team_spend)


@people_router.patch("/teams/{name}/limits", response=LimitsOut)
def update_team_limits(request: HttpRequest, name: str, payload: LimitsPatch) -> Any:
    """Change the given limits; keys take the change up within the key cache's TTL."""
    row = _set_limits(
        request, gateway_people.set_team_limits, _team_pk(name), _limits_changes(payload)
    )
    return _limits_out(row, allowances.team_spend)


@people_router.delete("/teams/{name}/limits", response=Changed)
def clear_team_limits(request: HttpRequest, name: str) -> Any:
    return {
        "changed": gateway_people.clear_team_limits(_team_pk(name), actor=caller(request).actor)
    }


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


@people_router.get("/keys", response=list[KeyOut])
@paginate(Page)
def list_keys(request: HttpRequest, user: str | None = None, revoked: bool | None = None) -> Any:
    rows = ApiKey.objects.select_related("user").order_by("-created_at", "-id")
    if user:
        rows = rows.filter(user__username=user)
    if revoked is not None:
        rows = rows.filter(revoked_at__isnull=not revoked)
    return rows


@people_router.get("/keys/{key_id}", response=KeyOut)
def get_key(request: HttpRequest, key_id: int) -> Any:
    return get_object_or_404(ApiKey.objects.select_related("user"), pk=key_id)


@people_router.post("/keys", response={201: IssuedKeyOut})
def issue_key(request: HttpRequest, payload: KeyIn) -> Any:
    if not User.objects.filter(username=payload.user).exists():
        raise ApiError(422, "not_found", f"no user {payload.user!r}", "user")
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


@people_router.post("/keys/{key_id}/revoke", response=Changed)
def revoke_key(request: HttpRequest, key_id: int) -> Any:
    """The key stops working within the gateway's key cache time (seconds)."""
    get_object_or_404(ApiKey, pk=key_id)
    return {"changed": keys.revoke(key_id)}


# --------------------------------------------------------------------------- usage

usage_router = Router(tags=["usage"])


class UsageQuery(Schema):
    by: Literal["model", "user", "team", "key", "day"] = "model"
    model: str | None = None
    user: str | None = None
    team: str | None = None
    key: str | None = Field(None, description="A key's prefix, as lists show it.")
    since: datetime | None = None
    until: datetime | None = None


class UsageRow(Schema):
    group: str
    requests: int
    errors: int
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


@usage_router.get("/usage", response=list[UsageRow])
@paginate(Page)
def usage(request: HttpRequest, query: Query[UsageQuery]) -> Any:
    """Requests, errors and tokens per group over the period, largest token use first (days:
    oldest first). By team, a user in two teams counts in both."""
    rows = reports.usage(
        reports.UsageFilter(
            since=query.since,
            until=query.until,
            username=query.user,
            key_prefix=query.key,
            model=query.model,
        )
    )
    if query.team:
        rows = rows.filter(user__groups__name=query.team)
    if query.by == "team":
        return _by_team(rows)
    return [r.as_dict() for r in reports.summarize(rows, query.by)]


def _by_team(rows: QuerySet[UsageRecord]) -> list[dict[str, Any]]:
    grouped = (
        rows.annotate(group=F("user__groups__name"))
        .values("group")
        .annotate(
            requests=Count("id"),
            errors=Count("id", filter=Q(status__gte=400)),
            prompt=Coalesce(Sum("prompt_tokens"), 0),
            completion=Coalesce(Sum("completion_tokens"), 0),
        )
        .order_by()
    )
    out = [
        {
            "group": row["group"] or "(no team)",
            "requests": row["requests"],
            "errors": row["errors"],
            "prompt_tokens": row["prompt"],
            "completion_tokens": row["completion"],
            "total_tokens": row["prompt"] + row["completion"],
        }
        for row in grouped
    ]
    return sorted(out, key=lambda r: (-r["total_tokens"], -r["requests"], r["group"]))


api.add_router("/", catalog_router)
api.add_router("/", fleet_router)
api.add_router("/", people_router)
api.add_router("/", usage_router)
