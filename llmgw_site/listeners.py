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

The role of a request is the role of the local port it arrived on (``scope["server"]``): the
web process publishes its listeners' ports in ``LLMGW_LISTENER_PORTS`` (``ports_value``) before
the application loads (``parse_ports``). Everything here is pure.
"""

from __future__ import annotations

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


def ports_value(ports: Mapping[str, int]) -> str:
    """``LLMGW_LISTENER_PORTS`` for {role: local port}: ``client=8000,admin=8001``."""
    return ",".join(f"{role}={port}" for role, port in ports.items())


def parse_ports(raw: str) -> dict[int, str]:
    """``client=8000,admin=8001`` as {8000: "client", 8001: "admin"}; malformed parts ignored
    (the value is written by the web process itself, not by a person)."""
    out: dict[int, str] = {}
    for part in raw.split(","):
        role, _, port = part.strip().partition("=")
        if role in _BY_NAME and port.isdigit():
            out[int(port)] = role
    return out


def role_of(ports: Mapping[int, str], server: tuple[str, int] | list[object] | None) -> str:
    """The role of the listener a request came in on; ``client`` when it cannot be told (one
    listener, another server, a test calling the application directly)."""
    if not ports or not server or len(server) < 2:
        return CLIENT
    port = server[1]
    return ports.get(port, CLIENT) if isinstance(port, int) else CLIENT
