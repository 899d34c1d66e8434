"""Sign-in protection (django-axes) fitted to llmgw: what failures are counted by, the pace of an
account tried from many addresses, the client's address behind a proxy, and the answer to a
refused sign-in (a page for people, JSON for the admin API).

Wrong passwords lock the pair (account, address) and the address, each after
``LLMGW_LOGIN_FAILURE_LIMIT`` failures, for ``LLMGW_LOGIN_LOCKOUT_MINUTES``: never the account
for every address, which would let anybody lock its owner out. An account tried from many
addresses is paced instead (``gateway.identity.pacing``): twice the failure limit at once (so
one locked address never slows its owner elsewhere), then one attempt every
``LLMGW_LOGIN_PACE_SECONDS`` from all addresses together; an address the account has signed in
from before is not paced. A refused attempt is not counted, so it neither extends a lockout nor
pushes an account's next turn away. Single sign-on, admin tokens and one-time sign-in links
(``manage.py signin_link``) do not go through the pace.

Without ``LLMGW_CLIENT_IP_HEADER`` the address is the connection's (``REMOTE_ADDR``). Behind a
reverse proxy every request comes from the proxy, so one attacker would lock everybody out:
name the header the proxy sets (``X-Forwarded-For``) and the rightmost entry is used, the one
the proxy itself appended; entries to its left come from the client and may be forged.
"""

from __future__ import annotations

import math
from typing import Any

from axes.handlers.database import AxesDatabaseHandler
from axes.helpers import get_client_username
from axes.models import AccessLog
from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render

from gateway.identity import pacing


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
) -> list[str | list[str]]:
    """What failures are counted by (axes' AXES_LOCKOUT_PARAMETERS). Passwords: per account
    and address together and, separately, per address; never per account alone, which would
    lock its owner out wherever they are. Admin tokens: per address only. A token's secret part
    is beyond guessing, and its visible prefix is no secret (the admin lists it): counted per
    prefix, wrong tokens sent from many addresses would lock the real token out everywhere."""
    username = (credentials or {}).get("username") or getattr(request_or_attempt, "username", "")
    if _is_token(username):
        return ["ip_address"]
    return [["username", "ip_address"], "ip_address"]


def _is_token(username: object) -> bool:
    return str(username or "").startswith(LEDGER_NAME_OF_TOKENS)


# Longer names are no account's (Django's usernames stop at 150 characters): nothing to pace.
_LONGEST_USERNAME = 150


def pace() -> pacing.Pace:
    """The pace of an account's password attempts, from the settings."""
    return pacing.Pace(
        interval=settings.LLMGW_LOGIN_PACE, burst=2 * int(settings.AXES_FAILURE_LIMIT)
    )


def account_wait(request: HttpRequest, credentials: dict[str, Any] | None) -> float:
    """Seconds until this password attempt's account takes another (0: this one goes ahead and
    is counted). Not paced: admin tokens, sign-ins without a username (single sign-on), and an
    address the account has signed in from before (its pair and address locks still apply)."""
    username = get_client_username(request, credentials)
    if not isinstance(username, str) or not username or _is_token(username):
        return 0.0
    if len(username) > _LONGEST_USERNAME or "\x00" in username:
        return 0.0
    address = request.axes_ip_address  # type: ignore[attr-defined]
    if AccessLog.objects.filter(username=username, ip_address=address).exists():
        return 0.0
    now = request.axes_attempt_time  # type: ignore[attr-defined]
    return pacing.claim(username, now, pace()).total_seconds()


class SignInHandler(AxesDatabaseHandler):  # type: ignore[misc]
    """axes' database handler (AXES_HANDLER), with the account's pace after its locks."""

    def is_allowed(self, request: HttpRequest, credentials: dict[str, Any] | None = None) -> bool:
        if not super().is_allowed(request, credentials):
            return False
        wait = account_wait(request, credentials)
        if wait > 0:
            # For the answer (lockout_response): when to come back.
            request.llmgw_retry_after = max(1, math.ceil(wait))  # type: ignore[attr-defined]
            return False
        return True


def lockout_response(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
    """429 for a refused sign-in, locked or paced: the admin API's JSON error, else a page that
    says what happened and how it ends. (axes passes the original response and the
    credentials, in an order that differs between its sync and async paths; neither is needed
    here.)"""
    cool_off = settings.AXES_COOLOFF_TIME
    paced = getattr(request, "llmgw_retry_after", None)
    retry_after = paced if paced is not None else int(cool_off.total_seconds())
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
        context = {"cooloff_timedelta": cool_off, "paced_seconds": paced}
        response = render(request, "registration/locked_out.html", context, status=429)
    response["Retry-After"] = str(retry_after)
    return response
