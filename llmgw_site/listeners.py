"""Which listener serves what: the one table of roles and the paths each role serves.

A web process may accept on up to four listening sockets, each with a role: ``client`` (the
OpenAI-compatible ``/v1`` and ``/healthz``), ``admin`` (the admin, its dashboard, ``/account/``,
the admin API and sign-in; meant for loopback or a private network), ``metrics`` (only
``/metrics``, and without a token: safe to expose to a scraper, as it carries counters and
nothing else) and ``agent`` (the agents' WebSocket streams). A role that has no listener of
its own is served where it always was, on the client listener, so with no split at all one
port serves everything.

``ROLES`` is the table, written once: what a listener of each role serves, and what the client
listener serves for a role while it has no listener of its own. ``routers`` reads it into one
``Router`` per listener; ``llmgw_site.asgi`` asks the router of the listener a request came in
on who answers it, and ``manage.py run`` asks ``listener_of`` where to point the local agent and
which address to print for each part.

The role of a request is the role of the listening socket it arrived on, told by the local
address and port of its connection (``scope["server"]``: the server reads it from the accepted
socket itself, so no header a client sends can change it); a listener bound to every address
(``0.0.0.0``, ``::``) owns its port at every address. The web process publishes the address of
each of its listeners in ``LLMGW_LISTENERS`` (``listeners_value``) before the application loads
(``parse_listeners``). Roles are never told apart by the port alone: with the client listener
on a public address and the admin's on loopback at the same port, the port would hand the
public address the admin. ``manage.py run`` gives each listener a port of its own
(``sharing_a_port``) all the same, as a firewall or a balancer tells them apart by port.
Everything here is pure.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from enum import Enum


class Answer(Enum):
    """Who answers a request; ``llmgw_site.asgi`` holds the application behind each name."""

    V1 = "v1"  # gateway.edge.asgi.V1App: the relay routes and the rest of /v1
    HEALTH = "health"  # /healthz: the store's answer, or 503 draining once the stop began
    SITE = "site"  # Django: admin, dashboard, account, admin API, sign-in, static, /metrics (token)
    OPEN_METRICS = "open_metrics"  # /metrics without a token (the metrics listener)
    AGENTS = "agents"  # the agents' WebSocket streams
    NOT_FOUND = "not_found"


# A route's path: exact, or ending in "*" for every path that starts with what comes before it
# ("/v1/*"); "*" alone is a catch-all.
ANY = "*"


@dataclass(frozen=True)
class Route:
    """Requests of one ASGI scope type (``http`` or ``websocket``) on ``path``, and who answers."""

    kind: str
    path: str
    answer: Answer

    @property
    def named(self) -> bool:
        """Names its paths (exactly or by prefix), as opposed to catching whatever is left."""
        return self.path != ANY


@dataclass(frozen=True)
class Role:
    """A listener's role: what a listener of its own serves (``serves``), and what the client
    listener serves for it while it has none (``without_listener``)."""

    name: str
    serves: tuple[Route, ...]
    without_listener: tuple[Route, ...] = ()


CLIENT = "client"
_HEALTHZ = Route("http", "/healthz", Answer.HEALTH)

ROLES: tuple[Role, ...] = (
    Role(
        CLIENT,
        # The paths under /v1 first: nearly every request is one of them.
        serves=(Route("http", "/v1/*", Answer.V1), Route("http", "/v1", Answer.V1), _HEALTHZ),
    ),
    Role(
        "admin",
        # Everything Django serves (the admin, its dashboard, /account/, the admin API, sign-in,
        # its static files), and Django's own 404 for what it does not know. The processes'
        # live diagnostics are named, so that no other listener ever serves them (their stacks,
        # profiles and heap are for operators only: llmgw_site.diagnostics).
        serves=(
            _HEALTHZ,
            Route("http", "/admin/diagnostics*", Answer.SITE),
            Route("http", ANY, Answer.SITE),
        ),
        without_listener=(Route("http", ANY, Answer.SITE),),
    ),
    Role(
        "metrics",
        serves=(Route("http", "/metrics", Answer.OPEN_METRICS),),
        # Without a listener of its own, /metrics is the site's page that asks for a token.
        without_listener=(Route("http", "/metrics", Answer.SITE),),
    ),
    Role(
        "agent",
        serves=(_HEALTHZ, Route("websocket", ANY, Answer.AGENTS)),
        without_listener=(Route("websocket", ANY, Answer.AGENTS),),
    ),
)
ROLE_NAMES: tuple[str, ...] = tuple(role.name for role in ROLES)
_BY_NAME: dict[str, Role] = {role.name: role for role in ROLES}


def listener_of(role: str, split: Collection[str]) -> str:
    """The role of the listener that serves ``role``'s part: its own, given a listener of its
    own (``split`` names the roles that have one), else the client's."""
    return role if role in split else CLIENT


class Router:
    """What one listener answers: the first of its routes that matches, else 404."""

    def __init__(self, routes: Iterable[Route]) -> None:
        self.routes = tuple(routes)
        # (kind, text, by prefix, answer): a catch-all is the prefix "", which every path has.
        self._compiled = tuple(
            (r.kind, r.path.removesuffix(ANY), r.path.endswith(ANY), r.answer) for r in self.routes
        )

    def answer(self, kind: str, path: str) -> Answer:
        for route_kind, text, by_prefix, answer in self._compiled:
            if route_kind == kind and (path.startswith(text) if by_prefix else path == text):
                return answer
        return Answer.NOT_FOUND


def router(role: str, split: Collection[str]) -> Router:
    """The router of a listener of ``role``, given which roles have listeners of their own.

    Its own routes first (the client listener's then those of every role without a listener of
    its own); then a path that another listener serves by name is 404 here, where a catch-all
    would otherwise take it (only the metrics listener serves ``/metrics`` once it exists, only
    the client listener ``/v1``); then the catch-alls."""
    mine = list(_BY_NAME[role].serves)
    if role == CLIENT:
        mine += [
            route
            for each in ROLES
            if listener_of(each.name, split) == CLIENT and each.name != CLIENT
            for route in each.without_listener
        ]
    elsewhere = [
        Route(route.kind, route.path, Answer.NOT_FOUND)
        for each in ROLES
        if each.name != role and listener_of(each.name, split) == each.name
        for route in each.serves
        if route.named
    ]
    named = [route for route in mine if route.named]
    catch_alls = [route for route in mine if not route.named]
    return Router([*named, *elsewhere, *catch_alls])


def routers(split: Collection[str]) -> dict[str, Router]:
    """One router for each listener a process has: the client's, and each role's in ``split``."""
    return {name: router(name, split) for name in ROLE_NAMES if name == CLIENT or name in split}


def decide(role: str, split: Collection[str], kind: str, path: str) -> Answer:
    """Who answers ``path`` (an ``http`` or ``websocket`` scope) on a listener of ``role``."""
    return router(role, split).answer(kind, path)


# A listener's local address and port, as its socket's getsockname() gives them.
Address = tuple[str, int]
# Bound to every address: such a listener owns its port at any local address (IPv6's, on a
# dual-stack socket, every IPv4 one too).
EVERY_V4 = "0.0.0.0"  # noqa: S104 - a name for the wildcard, not a bind
EVERY_V6 = "::"


def canonical(address: str) -> str:
    """``address`` as a socket names it, an IPv4 address mapped into IPv6 (an IPv4 client of a
    dual-stack socket) as the IPv4 one; a name that is no address, unchanged."""
    if ":" not in address:
        return address  # IPv4 as a socket writes it already; no parsing on a request's path
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(parsed, ipaddress.IPv6Address) and parsed.ipv4_mapped is not None:
        return str(parsed.ipv4_mapped)
    return str(parsed)


def listeners_value(table: Mapping[Address, str]) -> str:
    """``LLMGW_LISTENERS`` for {(local address, port): role}:
    ``client=10.0.0.5:8000,admin=127.0.0.1:8001,agent=[::]:8003``."""
    return ",".join(
        f"{role}=[{address}]:{port}" if ":" in address else f"{role}={address}:{port}"
        for (address, port), role in table.items()
    )


def parse_listeners(raw: str) -> dict[Address, str]:
    """``client=10.0.0.5:8000,admin=[::1]:8001`` as {("10.0.0.5", 8000): "client", ("::1",
    8001): "admin"}; malformed parts ignored (the value is written by the web process itself,
    not by a person)."""
    out: dict[Address, str] = {}
    for part in raw.split(","):
        role, _, where = part.strip().partition("=")
        address, _, port = where.rpartition(":")
        address = address.removeprefix("[").removesuffix("]")
        if role in _BY_NAME and address and port.isdigit():
            out[(canonical(address), int(port))] = role
    return out


def role_of(table: Mapping[Address, str], server: tuple[str, int] | list[object] | None) -> str:
    """The role of the listener a connection came in on, from its local (address, port): the
    listener bound to that very address, else the one bound to every address of that port;
    ``client`` when it cannot be told (one listener, another server, a test calling the
    application directly)."""
    if not table or not server or len(server) < 2:
        return CLIENT
    address, port = server[0], server[1]
    if not isinstance(address, str) or not isinstance(port, int):
        return CLIENT
    # Every request asks: the exact address first, as the socket wrote it (a listener bound to
    # one address is found here), and only then what a wildcard-bound one would be keyed by.
    found = table.get((address, port))
    if found is None:
        address = canonical(address)
        every = EVERY_V4 if "." in address else EVERY_V6
        found = (
            table.get((address, port)) or table.get((every, port)) or table.get((EVERY_V6, port))
        )
    return found or CLIENT


def sharing_a_port(places: Mapping[str, Address]) -> tuple[int, list[str]] | None:
    """The first port that two or more of ``places`` (each listener's name and where it binds)
    share, whatever their addresses, and the names sharing it; None when each has its own."""
    by_port: dict[int, list[str]] = {}
    for name, (_, port) in places.items():
        if port:  # 0: a port the kernel picks, one of its own
            by_port.setdefault(port, []).append(name)
    return next(((port, names) for port, names in by_port.items() if len(names) > 1), None)
