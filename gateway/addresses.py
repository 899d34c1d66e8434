"""Which addresses an upstream may have: checked when a URL is saved, and again against the
address each connection actually reaches.

Pure functions and one enum: the model's validation (``gateway.models``), the routing table and
the upstream client all decide with the same rules.
"""

from __future__ import annotations

import ipaddress
import socket
from enum import StrEnum
from typing import Final
from urllib.parse import urlsplit


class AddressPolicy(StrEnum):
    """Which addresses a connection may end at, checked against the address actually
    connected to (after resolution), so neither a DNS name nor a numeric trick reaches what
    a URL's text seemed to avoid."""

    ANY = "any"  # the operator named it in their own configuration, or allowed it on purpose
    # An engine on the node whose agent's stream came over loopback (the local agent): private
    # and loopback are normal; metadata is not.
    NODE = "node"
    # An engine on any other node: private is normal; this machine (loopback) is not, whatever
    # the node's address resolves to, and neither is metadata.
    REMOTE_NODE = "remote_node"
    PUBLIC = "public"  # an Endpoint row: not this machine, and not the metadata service either


# Cloud metadata services outside the link-local range (which holds 169.254.169.254).
_METADATA_ADDRESSES: Final = frozenset(
    {ipaddress.ip_address("fd00:ec2::254"), ipaddress.ip_address("100.100.100.200")}
)


def address_problem(address: str, policy: AddressPolicy | str) -> str | None:
    """Why a connection must not be made to ``address`` under ``policy``, or None."""
    if policy == AddressPolicy.ANY:
        return None
    try:
        ip = ipaddress.ip_address(address.partition("%")[0])
    except ValueError:
        return f"{address!r} is not an IP address"
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_link_local or ip in _METADATA_ADDRESSES:
        return f"{ip} is link-local or a cloud metadata address"
    if ip.is_multicast or ip.is_unspecified or ip.is_reserved:
        return f"{ip} is no address an upstream can have"
    if policy in (AddressPolicy.PUBLIC, AddressPolicy.REMOTE_NODE) and ip.is_loopback:
        return f"{ip} is this machine (loopback)"
    return None


_METADATA_HOSTS = frozenset(
    {"metadata", "metadata.google.internal", "metadata.azure.com", "instance-data"}
)


def upstream_url_problem(url: str) -> str | None:
    """Why a URL must not be an upstream (G5), or None if it may be.

    Loopback (this machine's own services), link-local (which includes the cloud metadata
    address 169.254.169.254), multicast and unspecified addresses, metadata host names and any
    scheme but http(s) are refused unless an operator allows them. IPv4 is read the way a
    resolver reads it, so ``2852039166`` and ``0xa9fea9fe`` are 169.254.169.254 here too. A
    host name is checked again where it counts, against the address actually connected to
    (``gateway.relay.upstream_client``).
    """
    try:
        parts = urlsplit(url)
    except ValueError:
        return "is not a valid URL"
    if parts.scheme not in ("http", "https"):
        return "must use http:// or https://"
    host = (parts.hostname or "").lower().rstrip(".")
    if not host:
        return "has no host"
    if host in _METADATA_HOSTS:
        return "points at a cloud metadata service"
    if host == "localhost" or host.endswith(".localhost"):
        return "points at this machine (loopback)"
    try:
        address: ipaddress.IPv4Address | ipaddress.IPv6Address = ipaddress.ip_address(host)
    except ValueError:
        try:
            address = ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            return None  # a host name: checked at connect time
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if address.is_loopback:
        return "points at this machine (loopback)"
    if address.is_link_local:
        return "points at a link-local address (cloud metadata lives there)"
    if address.is_multicast or address.is_unspecified or address.is_reserved:
        return "points at an address no engine can have"
    if str(address) == "fd00:ec2::254":
        return "points at a cloud metadata service"
    return None
