"""Who is calling the admin API, and what they may read, write and see.

Two ways in: ``Authorization: Bearer llmgw-admin-…`` (an admin token, for programs) or the
session of a staff user signed in to the admin (for the browser), whose unsafe requests must
carry the CSRF token like any form post.

Reads follow the admin's pages: each read route names the Django view permissions it needs
(``reads("control.view_profile")``), a staff session without them is answered 403, and a read
route that names none is for superusers and tokens only. Writes need a superuser's session or a
read-write token. A token stands for a superuser of its scope: a read-only token reads every
route, a read-write token does everything. Secrets in profile environments are shown to
superusers and read-write tokens only (``Caller.sees_secrets``), masked to everybody else.

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
from django.contrib.auth.models import AbstractBaseUser
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
    sees_secrets: bool
    user: AbstractBaseUser | None = None  # a staff session's user; None for a token

    def may_view(self, permissions: tuple[str, ...]) -> bool:
        """Whether the caller may read what needs these view permissions (none named: what a
        superuser may read)."""
        if self.user is None:
            return True  # a token reads every route, whatever its scope
        if not permissions:
            return bool(getattr(self.user, "is_superuser", False))
        return all(_may_view(self.user, p) for p in permissions)


def _may_view(user: AbstractBaseUser, permission: str) -> bool:
    """As the admin's pages decide (``ModelAdmin.has_view_permission``): the view permission,
    or the change permission, which implies it."""
    app_label, _, codename = permission.partition(".")
    change = f"{app_label}.change_{codename.removeprefix('view_')}"
    has_perm = user.has_perm  # type: ignore[attr-defined]
    return bool(has_perm(permission) or (codename.startswith("view_") and has_perm(change)))


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
    writes = row.scope == AdminToken.Scope.WRITE
    return Caller(actor=f"token:{row.name}", can_write=writes, sees_secrets=writes)


def _by_session(request: HttpRequest) -> Caller:
    user = request.user
    if not (user.is_authenticated and user.is_active and user.is_staff):
        raise Denied(401, "unauthorized", "send an admin token or sign in as staff")
    if request.method not in SAFE_METHODS and check_csrf(request) is not None:
        raise Denied(403, "csrf_failed", "a signed-in write needs the CSRF token (X-CSRFToken)")
    return Caller(
        actor=f"admin:{user.get_username()}",
        can_write=user.is_superuser,
        sees_secrets=user.is_superuser,
        user=user,
    )


def _who(request: HttpRequest) -> Caller:
    """Whoever sent ``request``: an admin token's holder, else a staff session's user."""
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if header:
        if scheme.lower() != "bearer" or not token.strip():
            raise Denied(401, "unauthorized", "Authorization must be 'Bearer <admin token>'")
        return _by_token(request, token.strip())
    return _by_session(request)


def caller(request: HttpRequest, view: tuple[str, ...] = ()) -> Caller:
    """The caller of ``request``, or :class:`Denied`. Reads need the view permissions ``view``
    (none: a superuser's or a token's); writes need write power."""
    who = _who(request)
    if request.method in SAFE_METHODS:
        if not who.may_view(view):
            needed = ", ".join(view) or "a superuser's"
            raise Denied(403, "forbidden", f"reading this needs the permission {needed}")
    elif not who.can_write:
        raise Denied(403, "read_only", "this token or account may only read")
    return who


def diagnostician(request: HttpRequest) -> Caller:
    """Who may look inside llmgw's processes (``llmgw_site.diagnostics``), or :class:`Denied`:
    any admin token, a read-only one too, and any staff session (its unsafe requests with the
    CSRF token). What they see is code and counts (stacks, profiles, allocation sites, objects
    by type), never a row, a key or a value; what they may switch (tracing allocations) changes
    what is measured, not what llmgw does."""
    return _who(request)


class AdminAuth:
    """The API's authentication callable (ninja calls it with the request): the default one,
    for writes and for reads that name no permission, or a read route's (:func:`reads`)."""

    def __init__(self, *view: str) -> None:
        self.view = view

    def __call__(self, request: HttpRequest) -> Caller:
        return caller(request, self.view)


def reads(*permissions: str) -> AdminAuth:
    """A read route's authentication: the caller needs these Django view permissions
    (``"control.view_profile"``), as the admin's pages of those models do."""
    return AdminAuth(*permissions)


def sees_secrets(request: HttpRequest) -> bool:
    """Whether the caller :class:`AdminAuth` let in may see secrets unmasked."""
    who = request.auth  # type: ignore[attr-defined]
    assert isinstance(who, Caller)
    return who.sees_secrets


def actor_of(request: HttpRequest) -> str:
    """Who made a change, for its Event: the caller :class:`AdminAuth` let in."""
    who = request.auth  # type: ignore[attr-defined]
    assert isinstance(who, Caller)
    return who.actor
