"""Issuing, revoking and checking admin tokens: the only place they are minted.

The admin's add form, ``manage.py create_admin_token`` and the API all call :func:`issue`, so
the three give the same row; the token itself exists only in the value returned.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Final

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from credentials.bearer import BearerSecret
from llmgw_site.admin_api.models import AdminToken

ADMIN_TOKEN: Final = BearerSecret("llmgw-admin-", shown=8)
TOKEN_PREFIX: Final = ADMIN_TOKEN.marker
VISIBLE_CHARS: Final = ADMIN_TOKEN.prefix_length
hash_token: Final = ADMIN_TOKEN.hash
well_formed: Final = ADMIN_TOKEN.well_formed
# last_used_at is a hint for operators ("is this token still in use?"), not an audit trail:
# written at most this often, so a busy script does not turn every read into a write.
LAST_USED_RESOLUTION = timedelta(minutes=1)


@dataclass(frozen=True)
class IssuedToken:
    token: str  # shown once, never stored
    row: AdminToken


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
    new = ADMIN_TOKEN.issue()
    with transaction.atomic():
        row = AdminToken.objects.create(
            name=name,
            scope=scope,
            prefix=new.prefix,
            token_hash=new.hash,
            created_by=created_by,  # type: ignore[misc]
            expires_at=expires_at,
        )
    return IssuedToken(new.secret, row)


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
    if row is None or not ADMIN_TOKEN.matches(token, row.token_hash):
        return None
    if row.last_used_at is None or now - row.last_used_at > LAST_USED_RESOLUTION:
        AdminToken.objects.filter(pk=row.pk).update(last_used_at=now)
    return row
