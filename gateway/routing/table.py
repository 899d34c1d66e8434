"""Routing decisions, as pure functions over plain data (no database, no clock of their own).

The routing table is built from rows the caller loaded (catalog models, ready replicas, static
endpoints); ``choose`` picks an upstream by least outstanding requests per unit of weight,
skipping upstreams ejected for a cool-down. ``gateway.routing.upstreams`` does the I/O around these.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Upstream:
    """One place a request can go: a ready replica's head shard or a static endpoint."""

    id: str  # "replica:12", "endpoint:slug" or "static:id"; recorded in usage rows
    base_url: str  # scheme://host:port, without a trailing "/v1"
    weight: int = 1
    # The engine's API key (replicas only): sent as the bearer on every request upstream.
    key: str = field(default="", repr=False)
    # Which addresses a connection may end at (upstream_client.AddressPolicy's values):
    # "node" for replicas on the node whose agent connected over loopback, "remote_node" for
    # the others, "public" for Endpoint rows, "any" where an operator allowed it.
    addresses: str = "any"
    # A replica's restart count: what routing learned of its cache holds for one generation.
    generation: int = 0
    # A replica's KV cache capacity in tokens, as its engine reports it (None: not known, and
    # always for endpoints): what routing remembers of that cache is bounded by it.
    cache_tokens: int | None = None

    @property
    def authorization(self) -> bytes:
        """The header line that carries the engine's key (none for endpoints): everything the
        gateway sends this upstream, relayed or its own (token counting), sends it."""
        return b"Authorization: Bearer " + self.key.encode() + b"\r\n" if self.key else b""


@dataclass(frozen=True)
class CatalogRow:
    id: int
    name: str
    aliases: tuple[str, ...] = ()
    enabled: bool = True
    activation_timeout_s: float = 600.0
    max_waiting: int = 100
    connect_timeout_s: float | None = None
    first_byte_timeout_s: float | None = None
    stream_idle_timeout_s: float | None = None
    default_profile: str = ""
    # Tokens the model takes, prompt and output together: the output reserved for a request
    # that sets no max-token field. None where not known.
    context_length: int | None = None


@dataclass(frozen=True)
class ReplicaRow:
    """A replica that may take traffic, with the address of its rank-0 shard."""

    id: int
    model_id: int
    profile: str
    host: str
    port: int
    key: str = field(default="", repr=False)
    generation: int = 1
    cache_tokens: int | None = None  # see Upstream
    # Its node's agent stream came over loopback: its engines may listen on this machine's.
    local_node: bool = False


@dataclass(frozen=True)
class EndpointRow:
    id: str  # "endpoint:slug" or "static:id"
    url: str
    models: tuple[str, ...]
    weight: int = 1
    addresses: str = "any"


@dataclass(frozen=True)
class Route:
    """Everything the request path needs about one model, resolved from the name a client sent."""

    name: str  # the canonical model name
    catalog_id: int | None  # None: served only by static endpoints (no activation)
    upstreams: tuple[Upstream, ...]
    # The profile asked for with ``name@profile``: only its replicas serve. None: the plain
    # name (the default profile's replicas first, the others while it has none).
    profile: str | None = None
    # Demand for this route starts a replica under the model's default profile (the plain
    # name, or ``name@default``); otherwise under ``profile``.
    default_profile: bool = True
    activation_timeout_s: float = 600.0
    max_waiting: int = 100
    connect_timeout_s: float | None = None
    first_byte_timeout_s: float | None = None
    stream_idle_timeout_s: float | None = None
    context_length: int | None = None  # see CatalogRow


@dataclass(frozen=True)
class _ModelEntry:
    catalog: CatalogRow | None
    by_profile: Mapping[str, tuple[Upstream, ...]]
    endpoints: tuple[Upstream, ...]


@dataclass(frozen=True)
class Table:
    """Model names (and aliases) → what serves them. Immutable: a refresh swaps the whole table."""

    entries: Mapping[str, _ModelEntry] = field(default_factory=dict)
    names: Mapping[str, str] = field(default_factory=dict)  # name or alias → canonical name
    version: int = 0
    # Routes already resolved from this table. The table never changes, so neither do they;
    # only names that resolve are kept, so clients cannot grow it.
    _resolved: dict[str, Route] = field(default_factory=dict, compare=False, repr=False)

    def model_names(self) -> list[str]:
        return sorted(self.entries)

    def upstreams(self) -> dict[str, Upstream]:
        """Every upstream the table routes to, by id."""
        found: dict[str, Upstream] = {}
        for entry in self.entries.values():
            for upstream in (
                *entry.endpoints,
                *(u for ups in entry.by_profile.values() for u in ups),
            ):
                found[upstream.id] = upstream
        return found

    def resolve(self, requested: str) -> Route | None:
        """``name``, an alias, or ``name@profile``. None if nothing by that name is served."""
        route = self._resolved.get(requested)
        if route is None:
            route = self._resolve(requested)
            if route is not None:
                self._resolved[requested] = route
        return route

    def _resolve(self, requested: str) -> Route | None:
        canonical = self.names.get(requested)
        profile: str | None = None
        if canonical is None and "@" in requested:
            base, _, profile = requested.rpartition("@")
            canonical = self.names.get(base)
        if canonical is None:
            return None
        entry = self.entries[canonical]
        catalog = entry.catalog
        default = catalog.default_profile if catalog is not None else ""
        if profile is not None:
            if profile not in entry.by_profile:
                return None
            upstreams = entry.by_profile.get(profile, ())
        else:
            # The default profile's replicas first; the others only while it has none.
            upstreams = entry.by_profile.get(default, ()) if default else ()
            if not upstreams:
                upstreams = tuple(u for ups in entry.by_profile.values() for u in ups)
            upstreams += entry.endpoints
        if catalog is None:
            return Route(canonical, None, upstreams)
        return Route(
            canonical,
            catalog.id,
            upstreams,
            profile=profile,
            default_profile=profile is None or profile == default,
            activation_timeout_s=catalog.activation_timeout_s,
            max_waiting=catalog.max_waiting,
            connect_timeout_s=catalog.connect_timeout_s,
            first_byte_timeout_s=catalog.first_byte_timeout_s,
            stream_idle_timeout_s=catalog.stream_idle_timeout_s,
            context_length=catalog.context_length,
        )


def build_table(
    catalog: Iterable[CatalogRow],
    replicas: Iterable[ReplicaRow],
    endpoints: Iterable[EndpointRow],
    *,
    profiles: Mapping[int, Iterable[str]] | None = None,
    version: int = 0,
) -> Table:
    """Join the rows into a table. ``profiles`` maps a catalog id to its profile names, so that
    ``name@profile`` resolves (and activates) before any replica of that profile is ready."""
    models = {row.id: row for row in catalog if row.enabled}
    by_model: dict[int, dict[str, list[Upstream]]] = {}
    for replica in sorted(replicas, key=lambda r: r.id):
        if replica.model_id not in models:
            continue
        upstream = Upstream(
            f"replica:{replica.id}",
            base_url(replica.host, replica.port),
            key=replica.key,
            addresses="node" if replica.local_node else "remote_node",
            generation=replica.generation,
            cache_tokens=replica.cache_tokens,
        )
        by_model.setdefault(replica.model_id, {}).setdefault(replica.profile, []).append(upstream)
    static: dict[str, list[Upstream]] = {}
    for endpoint in endpoints:
        upstream = Upstream(
            endpoint.id,
            normalize_base(endpoint.url),
            max(1, endpoint.weight),
            addresses=endpoint.addresses,
        )
        for name in endpoint.models:
            static.setdefault(name, []).append(upstream)

    entries: dict[str, _ModelEntry] = {}
    names: dict[str, str] = {}
    for row in models.values():
        by_profile = {p: tuple(ups) for p, ups in by_model.get(row.id, {}).items()}
        for name in (profiles or {}).get(row.id, ()):
            by_profile.setdefault(name, ())
        entries[row.name] = _ModelEntry(row, by_profile, tuple(static.pop(row.name, ())))
        names[row.name] = row.name
    for name, ups in static.items():
        entries[name] = _ModelEntry(None, {}, tuple(ups))
        names.setdefault(name, name)
    # Aliases last: a real name always wins over somebody's alias.
    for row in models.values():
        for alias in row.aliases:
            names.setdefault(alias, row.name)
    return Table(entries, names, version)


def choose(
    upstreams: Sequence[Upstream],
    outstanding: Mapping[str, int],
    ejected_until: Mapping[str, float],
    now: float,
    *,
    exclude: Iterable[str] = (),
    offset: int = 0,
) -> Upstream | None:
    """Least outstanding requests per unit of weight among upstreams not ejected.

    If every candidate is ejected, pick among them anyway: an upstream that may have recovered
    beats a certain error. ``offset`` rotates where ties are broken, so equal upstreams share
    load even at one request at a time.
    """
    skip = set(exclude)
    candidates = [u for u in upstreams if u.id not in skip]
    if not candidates:
        return None
    healthy = [u for u in candidates if ejected_until.get(u.id, 0.0) <= now]
    pool = healthy or candidates
    best: Upstream | None = None
    best_score = 0.0
    count = len(pool)
    for i in range(count):
        upstream = pool[(offset + i) % count]
        score = (outstanding.get(upstream.id, 0) + 1) / upstream.weight
        if best is None or score < best_score:
            best, best_score = upstream, score
    return best


def base_url(host: str, port: int) -> str:
    if "://" in host:
        return f"{host.rstrip('/')}:{port}"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 literal
    return f"http://{host}:{port}"


def normalize_base(url: str) -> str:
    """Endpoints may be given with or without ``/v1``; the relay appends the API path."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url
