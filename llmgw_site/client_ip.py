"""The client's address for sign-in protection (django-axes), behind a proxy or not.

Without ``LLMGW_CLIENT_IP_HEADER`` the address is the connection's (``REMOTE_ADDR``). Behind a
reverse proxy every request comes from the proxy, so one attacker would lock everybody out:
name the header the proxy sets (``X-Forwarded-For``) and the rightmost entry is used, the one
the proxy itself appended; entries to its left come from the client and may be forged.
"""

from __future__ import annotations

from django.conf import settings
from django.http import HttpRequest


def client_ip(request: HttpRequest) -> str:
    header = getattr(settings, "LLMGW_CLIENT_IP_HEADER", "")
    if header:
        value = request.META.get("HTTP_" + header.upper().replace("-", "_"), "")
        entries = [e.strip() for e in str(value).split(",") if e.strip()]
        if entries:
            return entries[-1]
    return str(request.META.get("REMOTE_ADDR", ""))
