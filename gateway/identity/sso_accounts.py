"""Which account a single sign-on signs in: the one bound to the provider's issuer and subject
(``sub``), matched on that alone once bound.

A subject signing in for the first time is bound to:

1. the provisioned account an operator gave this provider name (``preferred_username``) for
   the purpose (``create_user --sso-username``, ``set_user --sso-username``); else
2. the provisioned account with the sign-in's email, if the provider says it verified that
   email (``email_verified`` true) and exactly one account has it; else
3. a new account, named as the claims say, if that name is free; else
4. nothing: :class:`Refused`, because the name belongs to another account, and a name the
   person may have chosen at the provider never gets them somebody else's account.

A provisioned account is one without a usable password that no subject of this provider is
bound to yet (made by the admin API or ``manage.py create_user``, or by single sign-on before
accounts were bound): each is linked once. An account with a password is never linked. A
binding and a new account are Events; later sign-ins are not (the provider's word, not a
change).
"""

from __future__ import annotations

from dataclasses import dataclass

from django.contrib.auth.hashers import UNUSABLE_PASSWORD_PREFIX
from django.contrib.auth.models import User
from django.db import IntegrityError, transaction
from django.db.models import QuerySet

from control import serving
from gateway.models import SsoIdentity, SsoLinkName


@dataclass(frozen=True)
class Claimed:
    """What a verified sign-in says, as plain data."""

    issuer: str
    subject: str
    username: str  # what a new account would be named
    provider_username: str  # preferred_username; "" if none
    email: str  # "" if none
    email_verified: bool


class Refused(Exception):
    """This sign-in gets no account; the message says why, for the log."""


def account_for(claimed: Claimed) -> User:
    """The account ``claimed`` signs in, bound to its subject from now on (see the module)."""
    if not claimed.subject or len(claimed.subject) > 255 or len(claimed.issuer) > 255:
        raise Refused("no usable subject (sub) in the sign-in")
    try:
        with transaction.atomic():
            return _account_for(claimed)
    except IntegrityError:
        # Another sign-in of this subject, or for this account, bound it in between: once
        # bound, the binding decides.
        with transaction.atomic():
            return _account_for(claimed)


def _account_for(claimed: Claimed) -> User:
    bound = (
        SsoIdentity.objects.select_related("user")
        .filter(issuer=claimed.issuer, subject=claimed.subject)
        .first()
    )
    if bound is not None:
        if not bound.user.is_active:
            raise Refused(f"{bound.user.username!r} is deactivated")
        return bound.user
    user, how = _provisioned(claimed)
    if user is None:
        user, how = _new_account(claimed), "made by single sign-on"
    SsoIdentity.objects.create(user=user, issuer=claimed.issuer, subject=claimed.subject)
    serving.record_operator_event(
        f"user/{user.username}",
        f"{how}: bound to subject {claimed.subject} at {claimed.issuer}",
        {"actor": "sso", "issuer": claimed.issuer, "subject": claimed.subject, "how": how},
    )
    return user


def _unlinked(issuer: str) -> QuerySet[User]:
    """Provisioned accounts: active, without a usable password, bound to no subject of this
    provider."""
    return User.objects.filter(
        password__startswith=UNUSABLE_PASSWORD_PREFIX, is_active=True
    ).exclude(sso_identities__issuer=issuer)


def _provisioned(claimed: Claimed) -> tuple[User | None, str]:
    candidates = _unlinked(claimed.issuer)
    if claimed.provider_username:
        named = (
            SsoLinkName.objects.select_for_update()
            .filter(provider_username=claimed.provider_username, user__in=candidates)
            .select_related("user")
            .first()
        )
        if named is not None:
            named.delete()  # used up: from now on the binding decides
            return named.user, f"linked by the provider name {claimed.provider_username!r}"
    if claimed.email and claimed.email_verified:
        by_email = list(candidates.filter(email__iexact=claimed.email)[:2])
        if len(by_email) == 2:
            raise Refused(
                f"two provisioned accounts have the email {claimed.email!r}: set which "
                "(set_user NAME --sso-username)"
            )
        if by_email:
            return by_email[0], "linked by its verified email"
    return None, ""


def _new_account(claimed: Claimed) -> User:
    if User.objects.filter(username=claimed.username).exists():
        raise Refused(
            f"the name {claimed.username!r} belongs to another account; an operator links it "
            "(set_user NAME --sso-username) or the provider vouches for its email"
        )
    user = User(username=claimed.username)
    user.set_unusable_password()
    user.save()
    return user
