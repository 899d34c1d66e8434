"""One-time sign-in links: a way in for a person whose password sign-in is locked or paced,
that no attacker can trip.

``manage.py signin_link USERNAME`` prints one (:func:`issue`): a 256-bit token in a URL
(``/account/link/<token>/``), bound to that user, good once, for 15 minutes unless told
otherwise. Only the token's SHA-256 is stored, and printing a new link for someone ends their
earlier unused ones. Opening the link shows one button; signing in takes that POST (with its
CSRF token), so a mail scanner or a chat preview that fetches the link does not use it up. The
printing and the use are both Events.

A link does not go through django-axes: its lockouts and the account's pace are there to bound
guessing, and a link is not guessed. Whoever can run ``manage.py`` holds the store already.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.contrib.auth.backends import ModelBackend
from django.contrib.auth.models import User
from django.db import transaction
from django.http import HttpRequest
from django.utils import timezone

from control import serving
from gateway.identity.people import Missing, PersonInvalid
from gateway.models import SignInLink

DEFAULT_LIFETIME = timedelta(minutes=15)
MAX_LIFETIME = timedelta(hours=24)
PATH = "/account/link/{token}/"
_TOKEN_RE = re.compile(r"[A-Za-z0-9_-]{43}")  # secrets.token_urlsafe(32)


@dataclass(frozen=True)
class IssuedLink:
    token: str  # in the printed link only, never stored
    row: SignInLink

    @property
    def path(self) -> str:
        return PATH.format(token=self.token)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def issue(
    username: str,
    *,
    actor: str,
    lifetime: timedelta = DEFAULT_LIFETIME,
    now: datetime | None = None,
) -> IssuedLink:
    """A new link for ``username``, good once within ``lifetime``; their earlier unused links
    stop working. Missing: no such user; PersonInvalid: deactivated, or a lifetime out of
    bounds."""
    if not timedelta(0) < lifetime <= MAX_LIFETIME:
        raise PersonInvalid("lifetime", "more than zero and at most 24 hours")
    now = now or timezone.now()
    token = secrets.token_urlsafe(32)
    with transaction.atomic():
        user = User.objects.filter(username=username).first()
        if user is None:
            raise Missing("username", f"no user {username!r}")
        if not user.is_active:
            raise PersonInvalid("username", f"{username!r} is deactivated")
        ended = SignInLink.objects.filter(
            user=user, used_at__isnull=True, expires_at__gt=now
        ).update(expires_at=now)
        row = SignInLink.objects.create(
            user=user,
            token_hash=hash_token(token),
            created_by=actor[:200],
            created_at=now,
            expires_at=now + lifetime,
        )
        serving.record_operator_event(
            f"user/{username}",
            f"one-time sign-in link printed by {actor}, good until "
            f"{row.expires_at:%Y-%m-%d %H:%M:%S} UTC"
            + (f" (ends {ended} earlier one{'s' if ended > 1 else ''})" if ended else ""),
            {"actor": actor, "link": row.pk, "expires_at": row.expires_at.isoformat()},
        )
    return IssuedLink(token, row)


def _live(token: str, now: datetime) -> dict[str, object] | None:
    """The filter that finds ``token``'s link while it may still be used, or None for a
    token no link can have."""
    if _TOKEN_RE.fullmatch(token) is None:
        return None
    return {
        "token_hash": hash_token(token),
        "used_at__isnull": True,
        "expires_at__gt": now,
        "user__is_active": True,
    }


def peek(token: str, *, now: datetime | None = None) -> User | None:
    """Whom the link would sign in, without using it up; None: unknown, used or expired."""
    live = _live(token, now or timezone.now())
    if live is None:
        return None
    row = SignInLink.objects.select_related("user").filter(**live).first()
    return None if row is None else row.user


def redeem(token: str, *, address: str, now: datetime | None = None) -> User | None:
    """Use the link up: the user it signs in, or None if it is unknown, used, expired or its
    user deactivated. Of two uses at once, one wins (a conditional update)."""
    now = now or timezone.now()
    live = _live(token, now)
    if live is None:
        return None
    with transaction.atomic():
        if SignInLink.objects.filter(**live).update(used_at=now) != 1:
            return None
        row = SignInLink.objects.select_related("user").get(token_hash=live["token_hash"])
        serving.record_operator_event(
            f"user/{row.user.username}",
            f"signed in with a one-time sign-in link from {address or 'an unknown address'}",
            {"link": row.pk, "address": address},
        )
    return row.user


class LinkBackend(ModelBackend):
    """What a session opened by a link names as its backend, so that it stays signed in
    whether or not passwords are on. It authenticates nothing itself: links are used by their
    view, outside ``authenticate()`` and so outside django-axes."""

    def authenticate(
        self,
        request: HttpRequest | None,
        username: str | None = None,
        password: str | None = None,
        **kwargs: Any,
    ) -> User | None:
        return None
