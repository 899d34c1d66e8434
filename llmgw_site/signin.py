"""Sign-in protection (django-axes) fitted to llmgw: the client's address behind a proxy, and
the answer to a locked-out sign-in (a page for people, JSON for the admin API).

Without ``LLMGW_CLIENT_IP_HEADER`` the address is the connection's (``REMOTE_ADDR``). Behind a
reverse proxy every request comes from the proxy, so one attacker would lock everybody out:
name the header the proxy sets (``X-Forwarded-For``) and the rightmost entry is used, the one
the proxy itself appended; entries to its left come from the client and may be forged.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render


def client_ip(request: HttpRequest) -> str:
    header = getattr(settings, "LLMGW_CLIENT_IP_HEADER", "")
    if header:
        value = request.META.get("HTTP_" + header.upper().replace("-", "_"), "")
        entries = [e.strip() for e in str(value).split(",") if e.strip()]
        if entries:
            return entries[-1]
    return str(request.META.get("REMOTE_ADDR", ""))


# How the admin API names a token in the ledger: this prefix and the token's visible part.
LEDGER_NAME_OF_TOKENS = "admin-token:"


def lockout_parameters(
    request_or_attempt: Any, credentials: dict[str, Any] | None = None
) -> list[str]:
    """What failures are counted by (axes' AXES_LOCKOUT_PARAMETERS). Passwords: per account
    and, separately, per address. Admin tokens: per address only. A token's secret part is
    beyond guessing, and its visible prefix is no secret (the admin lists it): counted per
    prefix, wrong tokens sent from many addresses would lock the real token out everywhere."""
    username = (credentials or {}).get("username") or getattr(request_or_attempt, "username", "")
    if str(username or "").startswith(LEDGER_NAME_OF_TOKENS):
        return ["ip_address"]
    return ["username", "ip_address"]


def lockout_response(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
    """429 for a locked-out sign-in: the admin API's JSON error, else a page that says what
    happened and how it ends. (axes passes the original response and the credentials, in an
    order that differs between its sync and async paths; neither is needed here.)"""
    cool_off = settings.AXES_COOLOFF_TIME
    retry_after = str(int(cool_off.total_seconds())) if cool_off else ""
    if request.path.startswith("/api/"):
        response: HttpResponse = JsonResponse(
            {
                "error": {
                    "code": "locked_out",
                    "message": "too many failed sign-ins from here or for this account; "
                    "try again later",
                    "field": None,
                }
            },
            status=429,
        )
    else:
        response = render(
            request, "registration/locked_out.html", {"cooloff_timedelta": cool_off}, status=429
        )
    if retry_after:
        response["Retry-After"] = retry_after
    return response
