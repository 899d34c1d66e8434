"""The routing table as the store has it: the catalog and the ready replicas from the control
plane (``control.serving``), the static endpoints from the settings and the admin's endpoints
from here, built into a ``Table`` (``gateway.routing.table``). It runs in the background lane of
``gateway.dbthread``, never on a request's path; ``gateway.routing.upstreams`` swaps what it
returns in whole."""

from __future__ import annotations

import logging

from django.conf import settings

from control import serving
from gateway.addresses import AddressPolicy, upstream_url_problem
from gateway.models import Endpoint
from gateway.routing.table import CatalogRow, EndpointRow, ReplicaRow, Table, build_table

logger = logging.getLogger("gateway.routing.upstreams")  # where operators have always seen it


def load_table(version: int = 0) -> Table:
    """Read what routes traffic and build a table (runs in the background lane of
    gateway.dbthread): the catalog and the ready replicas from the control plane, the static
    endpoints from here."""
    snapshot = serving.routing_snapshot()
    catalog = [
        CatalogRow(
            id=entry.id,
            name=entry.name,
            aliases=entry.aliases,
            enabled=entry.enabled,
            activation_timeout_s=entry.activation_timeout_s,
            max_waiting=entry.max_waiting,
            connect_timeout_s=entry.connect_timeout_s,
            first_byte_timeout_s=entry.first_byte_timeout_s,
            stream_idle_timeout_s=entry.stream_idle_timeout_s,
            default_profile=entry.default_profile,
            context_length=entry.context_length,
        )
        for entry in snapshot.models
    ]
    profiles = {entry.id: set(entry.profiles) for entry in snapshot.models if entry.profiles}
    replicas = [
        ReplicaRow(
            r.id,
            r.model_id,
            r.profile,
            r.host,
            r.port,
            key=r.engine_key,
            generation=r.generation,
            cache_tokens=r.cache_tokens,
            local_node=r.local_node,
        )
        for r in snapshot.replicas
    ]

    # Static endpoints come from the operator's own configuration: any address they name.
    endpoints = [
        EndpointRow(f"static:{e.id}", e.url, e.models) for e in settings.LLMGW_STATIC_ENDPOINTS
    ]
    for slug, url, names, weight, allow_private in (
        Endpoint.objects.filter(enabled=True)
        .order_by()  # one table per statement (see control.serving.routing_snapshot)
        .values_list("slug", "url", "model_names", "weight", "allow_private_address")
    ):
        problem = upstream_url_problem(url)
        if problem and not allow_private:
            # Refused at save time too; this catches rows written around the model's checks.
            logger.warning("endpoint %s: URL %s; not routed", slug, problem)
            continue
        endpoints.append(
            EndpointRow(
                f"endpoint:{slug}",
                url,
                tuple(str(n) for n in names),
                weight,
                # Checked again against the address each connection actually reaches, so a
                # name that resolves to a metadata or loopback address is refused too.
                addresses=AddressPolicy.ANY if allow_private else AddressPolicy.PUBLIC,
            )
        )
    return build_table(catalog, replicas, endpoints, profiles=profiles, version=version)
