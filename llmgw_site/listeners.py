"""Which listener serves what, when ``manage.py run`` splits them.

A web process may accept on up to four listening sockets, each with a role: ``client`` (the
OpenAI-compatible ``/v1`` and ``/healthz``), ``admin`` (the admin, its dashboard and
``/account/``; meant for loopback or a private network), ``metrics`` (only ``/metrics``, and
without a token: safe to expose to a scraper, as it carries counters and nothing else) and
``agent`` (the agents' WebSocket streams). A role that has no listener of its own is served
where it always was, on the client port, so with no split at all one port serves everything.

The role of a request is the role of the local port it arrived on (``scope["server"]``): the
web process publishes its listeners' ports in ``LLMGW_LISTENER_PORTS`` before the application
loads. Decisions here are pure; ``llmgw_site.asgi`` acts on them.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum

ROLES = ("client", "admin", "metrics", "agent")


class Answer(Enum):
    V1 = "v1"  # the relay and the rest of /v1
    SITE = "site"  # Django: admin, dashboard, account, /healthz, /metrics with its token
    OPEN_METRICS = "open_metrics"  # /metrics without a token (the metrics listener)
    AGENTS = "agents"  # the agents' WebSocket streams
    NOT_FOUND = "not_found"


# What stays on the client port when the admin has a listener of its own.
CLIENT_SITE_PATHS = ("/healthz",)


def parse_ports(raw: str) -> dict[int, str]:
    """``client=8000,admin=8001`` as {8000: "client", 8001: "admin"}; malformed parts ignored
    (the value is written by the web process itself, not by a person)."""
    out: dict[int, str] = {}
    for part in raw.split(","):
        role, _, port = part.strip().partition("=")
        if role in ROLES and port.isdigit():
            out[int(port)] = role
    return out


def role_of(ports: Mapping[int, str], server: tuple[str, int] | list[object] | None) -> str:
    """The role of the listener a request came in on; ``client`` when it cannot be told (one
    listener, another server, a test calling the application directly)."""
    if not ports or not server or len(server) < 2:
        return "client"
    port = server[1]
    return ports.get(port, "client") if isinstance(port, int) else "client"


def decide(role: str, split: frozenset[str], kind: str, path: str) -> Answer:
    """Who answers ``path`` (an ``http`` or ``websocket`` scope) on a listener of ``role``,
    given which roles have listeners of their own (``split``)."""
    if kind == "websocket":
        if role == "agent" or (role == "client" and "agent" not in split):
            return Answer.AGENTS
        return Answer.NOT_FOUND
    v1 = path == "/v1" or path.startswith("/v1/")
    if role == "metrics":
        return Answer.OPEN_METRICS if path == "/metrics" else Answer.NOT_FOUND
    if role == "agent":
        return Answer.SITE if path == "/healthz" else Answer.NOT_FOUND
    if path == "/metrics" and "metrics" in split:
        return Answer.NOT_FOUND  # only the metrics listener serves it then
    if role == "admin":
        return Answer.NOT_FOUND if v1 else Answer.SITE
    if v1:
        return Answer.V1
    if "admin" in split and path not in CLIENT_SITE_PATHS and path != "/metrics":
        return Answer.NOT_FOUND
    return Answer.SITE
