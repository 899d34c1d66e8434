"""Where an agent's stream comes from, and what that lets its node advertise.

A node's hello names the addresses the gateway dials its engines at. A loopback address is the
gateway host's own: right for the agent on that host (the one ``make run`` starts dials the
control plane at 127.0.0.1), and from any other node a way to point gateway traffic at the
services of the gateway's host. So a node may advertise loopback only while its stream itself
comes over loopback; whether it did is recorded on the node at hello
(``Node.connected_over_loopback``), and routing checks it again (``control.serving``), as the
gateway's client does for the address each connection reaches (``gateway.addresses``).

Behind a reverse proxy every stream comes from the proxy. With ``LLMGW_CLIENT_IP_HEADER`` set,
a stream's address is the rightmost entry of that header (the one the proxy appended; the
entries to its left come from the client), as for sign-ins (``llmgw_site.signin``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import unquote

from django.conf import settings

from agents.protocol.names import is_loopback


def websocket_peer(scope: Mapping[str, Any]) -> str:
    """The address a WebSocket stream comes from ("" where the server does not say)."""
    header = str(settings.LLMGW_CLIENT_IP_HEADER or "").lower().encode("latin-1")
    if header:
        for name, value in scope.get("headers") or ():
            if name.lower() == header:
                text = bytes(value).decode("latin-1")
                entries = [e.strip() for e in text.split(",") if e.strip()]
                if entries:
                    return entries[-1]
    client = scope.get("client")
    return str(client[0]) if client else ""


def grpc_peer(peer: str | None) -> str:
    """The address in a gRPC context's ``peer()`` (``ipv4:127.0.0.1:5000``,
    ``ipv6:[::1]:5000``, either URI-escaped); "" for any other kind (a Unix socket)."""
    kind, _, rest = unquote(peer or "").partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0]
    if kind == "ipv6":
        return rest.rpartition(":")[0].strip("[]")
    return ""


def over_loopback(peer: str) -> bool:
    """Whether a stream from ``peer`` came over loopback (an unknown peer did not)."""
    return bool(peer) and is_loopback(peer)


def loopback_refusal(addresses: Iterable[str], peer: str) -> str | None:
    """Why a node whose stream comes from ``peer`` may not advertise ``addresses``, or None."""
    if over_loopback(peer):
        return None
    for i, address in enumerate(addresses):
        if is_loopback(address):
            return (
                f"addresses[{i}] {address} is loopback, but this stream comes from "
                f"{peer or 'an unknown address'}: only an agent connected over loopback may "
                "advertise one (give --advertise-address this node's own address)"
            )
    return None
