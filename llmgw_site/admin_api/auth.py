"""Who is calling the admin API, and whether they may write.

Two ways in: ``Authorization: Bearer llmgw-admin-…`` (an admin token, for programs) or the
session of a staff user signed in to the admin (for the browser), whose unsafe requests must
carry the CSRF token like any form post. A read-only token, or a staff user who is not a
superuser, may only read.

Wrong tokens count as failed sign-ins in the same ledger as passwords (django-axes), per
address (``llmgw_site.signin.lockout_parameters`` says why not per prefix), so a program
guessing tokens is locked out like a person guessing passwords, and an administrator lifts it
in the same place (the admin's "Access
attempts", or ``manage.py axes_reset_ip``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from axes.handlers.proxy import AxesProxyHandler
from django.contrib.auth.signals import user_login_failed
from django.http import HttpRequest
from ninja.utils import check_csrf

from llmgw_site.admin_api import tokens
from llmgw_site.admin_api.models import AdminToken
from llmgw_site.signin import LEDGER_NAME_OF_TOKENS

logger = logging.getLogger(__name__)

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


class Denied(Exception):
    """The caller may not do this; ``status`` and ``code`` say why (401/403/429)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Caller:
    """What the API knows of whoever called: a name for the audit trail, and their power."""

    actor: str
    can_write: bool


def _credentials(token: str) -> dict[str, str]:
    # The ledger's "username" for a token: its visible prefix, never the secret part.
    return {"username": f"{LEDGER_NAME_OF_TOKENS}{token[: tokens.VISIBLE_CHARS]}"}


def _by_token(request: HttpRequest, token: str) -> Caller:
    credentials = _credentials(token)
    if not AxesProxyHandler.is_allowed(request, credentials):
        raise Denied(429, "locked_out", "too many failed sign-ins from here; try again later")
    row = tokens.check(token)
    if row is None:
        # Recorded by axes' receiver of this signal, as a wrong password would be.
        user_login_failed.send(sender=__name__, credentials=credentials, request=request)
        logger.warning("admin API: a wrong admin token (%s…)", credentials["username"])
        raise Denied(401, "unauthorized", "unknown, revoked or expired admin token")
    return Caller(actor=f"token:{row.name}", can_write=row.scope == AdminToken.Scope.WRITE)


def _by_session(request: HttpRequest) -> Caller:
    user = request.user
    if not (user.is_authenticated and user.is_active and user.is_staff):
        raise Denied(401, "unauthorized", "send an admin token or sign in as staff")
    if request.method not in SAFE_METHODS and check_csrf(request) is not None:
        raise Denied(403, "csrf_failed", "a signed-in write needs the CSRF token (X-CSRFToken)")
    return Caller(actor=f"admin:{user.get_username()}", can_write=user.is_superuser)


def caller(request: HttpRequest) -> Caller:
    """The caller of ``request``, or :class:`Denied`. Writes need write power."""
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if header:
        if scheme.lower() != "bearer" or not token.strip():
            raise Denied(401, "unauthorized", "Authorization must be 'Bearer <admin token>'")
        who = _by_token(request, token.strip())
    else:
        who = _by_session(request)
    if request.method not in SAFE_METHODS and not who.can_write:
        raise Denied(403, "read_only", "this token or account may only read")
    return who


class AdminAuth:
    """The API's one authentication callable (ninja calls it with the request)."""

    def __call__(self, request: HttpRequest) -> Caller:
        return caller(request)


def actor_of(request: HttpRequest) -> str:
    """Who made a change, for its Event: the caller :class:`AdminAuth` let in."""
    who = request.auth  # type: ignore[attr-defined]
    assert isinstance(who, Caller)
    return who.actor
