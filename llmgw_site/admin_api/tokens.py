"""Issuing, revoking and checking admin tokens: the only place they are minted.

The admin's add form, ``manage.py create_admin_token`` and the API all call :func:`issue`, so
the three give the same row; the token itself exists only in the value returned.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from llmgw_site.admin_api.models import AdminToken

TOKEN_PREFIX = "llmgw-admin-"  # noqa: S105 - a public marker, not a secret
VISIBLE_CHARS = len(TOKEN_PREFIX) + 8
_TOKEN_RE = re.compile(re.escape(TOKEN_PREFIX) + r"[A-Za-z0-9_-]{43}")
# last_used_at is a hint for operators ("is this token still in use?"), not an audit trail:
# written at most this often, so a busy script does not turn every read into a write.
LAST_USED_RESOLUTION = timedelta(minutes=1)


@dataclass(frozen=True)
class IssuedToken:
    token: str  # shown once, never stored
    row: AdminToken


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def well_formed(token: str) -> bool:
    return _TOKEN_RE.fullmatch(token) is not None


def issue(
    name: str,
    *,
    scope: str = AdminToken.Scope.READ,
    created_by: AbstractBaseUser | None = None,
    expires_at: datetime | None = None,
) -> IssuedToken:
    """A new token. The returned ``token`` is the only copy there is."""
    if scope not in AdminToken.Scope.values:
        raise ValueError(f"scope {scope!r} is not one of {', '.join(AdminToken.Scope.values)}")
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    with transaction.atomic():
        row = AdminToken.objects.create(
            name=name,
            scope=scope,
            prefix=token[:VISIBLE_CHARS],
            token_hash=hash_token(token),
            created_by=created_by,  # type: ignore[misc]
            expires_at=expires_at,
        )
    return IssuedToken(token, row)


def revoke(token_id: int) -> bool:
    """True if this call revoked it; a second call changes nothing."""
    return (
        AdminToken.objects.filter(pk=token_id, revoked_at__isnull=True).update(
            revoked_at=timezone.now()
        )
        == 1
    )


def check(token: str) -> AdminToken | None:
    """The live (not revoked, not expired) token row for ``token``, else None."""
    if not well_formed(token):
        return None
    now = timezone.now()
    row = (
        AdminToken.objects.filter(token_hash=hash_token(token), revoked_at__isnull=True)
        .filter(Q(expires_at__isnull=True) | Q(expires_at__gt=now))
        .first()
    )
    # The lookup is by hash, an exact match on a unique index; the comparison below only
    # guards against a hash column that was edited by hand.
    if row is None or not hmac.compare_digest(row.token_hash, hash_token(token)):
        return None
    if row.last_used_at is None or now - row.last_used_at > LAST_USED_RESOLUTION:
        AdminToken.objects.filter(pk=row.pk).update(last_used_at=now)
    return row
