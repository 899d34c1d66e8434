"""The names and addresses a node may use: its own name, the addresses its engines are reached
at, and the weights paths it may be asked to remove. The protocol's decoder refuses anything
else, and the control plane checks what operators type with the same rules. A loopback address
(:func:`is_loopback`) is well formed, but the control plane takes it only from the agent whose
own stream comes over loopback: from any other node it would point the gateway at its own
host's services."""

from __future__ import annotations

import ipaddress
import re

# A weights name is a relative path under the agent's weights directory; nothing that could
# climb out of it (``..``, absolute paths, backslashes, NUL) is ever accepted.
_WEIGHTS_NAME = re.compile(r"^(?!/)(?!.*(?:^|/)\.\.?(?:/|$))[A-Za-z0-9._\-/]{1,300}$")
_NODE_NAME = re.compile(r"^[A-Za-z0-9_-]{1,100}$")


def valid_weights_name(name: str) -> bool:
    return bool(_WEIGHTS_NAME.match(name)) and "//" not in name


_HOST_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


def address_problem(address: str) -> str | None:
    """Why a node address cannot be used to reach its engines, or None: it must be a bare IP
    address or host name. Nothing with a scheme, port, path, user or query (the gateway builds
    engine URLs from it), and no numeric form but the canonical one (``2852039166`` and
    ``0xa9fea9fe`` are 169.254.169.254 to a resolver)."""
    if not address or len(address) > 253:
        return "must be 1-253 characters"
    try:
        ipaddress.ip_address(address)
    except ValueError:
        pass
    else:
        return None
    labels = address.rstrip(".").split(".")
    if not all(_HOST_LABEL.match(label) for label in labels):
        return "must be a bare IP address or host name (no scheme, port or path)"
    if labels[-1].isdigit() or labels[-1].lower().startswith("0x"):
        return "must be a canonical IP address (dotted decimal) or a host name"
    return None


def is_loopback(address: str) -> bool:
    """Whether ``address`` is this machine's loopback: 127.0.0.0/8 or ::1 (an IPv4-mapped one
    too), or the ``localhost`` names (which resolve there by RFC 6761)."""
    try:
        ip = ipaddress.ip_address(address.partition("%")[0])
    except ValueError:
        name = address.lower().rstrip(".")
        return name == "localhost" or name.endswith(".localhost")
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped.is_loopback
    return ip.is_loopback


def valid_node_name(name: str) -> bool:
    """The node names Django's ``SlugField`` (``Node.name``) accepts."""
    return bool(_NODE_NAME.match(name))
