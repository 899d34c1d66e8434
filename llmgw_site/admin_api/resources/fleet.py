"""The fleet's routes: nodes (cordon, drain, their tokens and certificates), replicas (restart),
who holds the lease, and the control plane's events. Changes go through ``control.operations``,
``control.node_tokens`` and ``control.node_certs``, as the admin's actions and ``manage.py``'s
commands do.
"""

# No `from __future__ import annotations`: ninja reads the route signatures at import time.

from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from django.conf import settings
from django.core.exceptions import ValidationError as DjangoValidationError
from django.db.models import QuerySet
from django.http import HttpRequest
from django.shortcuts import get_object_or_404
from ninja import Field, Router, Schema, Status
from ninja.pagination import paginate

from control import leases, node_certs, node_tokens, operations
from control.models import Event, Node, Replica
from llmgw_site.admin_api.auth import actor_of, reads
from llmgw_site.admin_api.errors import AdminApiError
from llmgw_site.admin_api.pagination import Page
from llmgw_site.admin_api.schemas import Changed

router = Router(tags=["fleet"])


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
        raise AdminApiError(404, code="not_found", message=f"no node {name!r}", field="name")
    return node


@router.get("/nodes", response=list[NodeOut], auth=reads("control.view_node"))
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


@router.get("/nodes/{name}", response=NodeOut, auth=reads("control.view_node"))
def get_node(request: HttpRequest, name: str) -> Any:
    return _node(name)


def _schedule(request: HttpRequest, name: str, change: Any) -> dict[str, Any]:
    node = _node(name)
    changed = change(node.pk, actor=actor_of(request))
    return {"changed": changed, "node": _node(name)}


@router.post("/nodes/{name}/cordon", response=NodeChange)
def cordon_node(request: HttpRequest, name: str) -> Any:
    """No new placements on the node; what runs there keeps running."""
    return _schedule(request, name, operations.cordon_node)


@router.post("/nodes/{name}/drain", response=NodeChange)
def drain_node(request: HttpRequest, name: str) -> Any:
    """Move every replica off the node: placed elsewhere, then stopped here once idle."""
    return _schedule(request, name, operations.drain_node)


@router.post("/nodes/{name}/undrain", response=NodeChange)
def undrain_node(request: HttpRequest, name: str) -> Any:
    """Schedulable again."""
    return _schedule(request, name, operations.undrain_node)


@router.post("/nodes/{name}/token", response={201: TokenOut})
def issue_node_token(request: HttpRequest, name: str) -> Any:
    """A new token for the node (registered if new); the previous one stops working."""
    _valid_node_name(name)
    token = node_tokens.issue_node_token(name)
    return Status(
        201, {"node": name, "token": token, "prefix": token[: node_tokens.TOKEN_VISIBLE_CHARS]}
    )


@router.delete("/nodes/{name}/token", response=Changed)
def revoke_node_token(request: HttpRequest, name: str) -> Any:
    _node(name)
    return {"changed": node_tokens.revoke_node_token(name)}


def _valid_node_name(name: str) -> None:
    try:
        Node._meta.get_field("name").clean(name, None)
    except DjangoValidationError as exc:
        raise AdminApiError(
            422, code="invalid", message="; ".join(exc.messages), field="name"
        ) from None


@router.post("/nodes/{name}/certificate", response={201: CertOut})
def issue_node_cert(request: HttpRequest, name: str) -> Any:
    """A new client certificate and key for the node's agent, from the cluster CA (the node is
    registered if new); its previous certificate stops working and its streams close. The key
    is in this answer only: store it on the node's host, mode 0600."""
    _valid_node_name(name)
    try:
        minted = node_certs.mint_node_cert(name, Path(settings.LLMGW_CA_DIR))
    except node_certs.CaError as exc:
        raise AdminApiError(409, code="no_ca", message=str(exc)) from None
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


@router.delete("/nodes/{name}/certificate", response=Changed)
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


@router.get("/replicas", response=list[ReplicaOut], auth=reads("control.view_replica"))
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


@router.get("/replicas/{replica_id}", response=ReplicaOut, auth=reads("control.view_replica"))
def get_replica(request: HttpRequest, replica_id: int) -> Any:
    return get_object_or_404(_replicas(), pk=replica_id)


@router.post("/replicas/{replica_id}/restart", response=ReplicaChange)
def restart_replica(request: HttpRequest, replica_id: int) -> Any:
    """Start the replica's shards afresh (a new generation). ``changed`` is false for a
    replica not wanted running."""
    try:
        changed = operations.restart_replica(replica_id, actor=actor_of(request))
    except operations.NotFound as exc:
        raise AdminApiError(404, code="not_found", message=str(exc), field="replica_id") from None
    return {"changed": changed, "replica": _replicas().get(pk=replica_id)}


class LeaseOut(Schema):
    name: str
    owner: str
    epoch: int
    expires_in: float
    held: bool


@router.get("/lease", response=LeaseOut, auth=reads("control.view_lease"))
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


@router.get("/events", response=list[EventOut], auth=reads("control.view_event"))
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
