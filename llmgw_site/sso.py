"""Single sign-on with any OpenID Connect provider (mozilla-django-oidc), off unless configured.

``LLMGW_OIDC_ISSUER`` turns it on: the provider's endpoints come from its discovery document
(``<issuer>/.well-known/openid-configuration``), fetched on first use and kept for an hour, so
a provider that is down at start-up does not stop llmgw from starting. The code flow runs with
PKCE and a nonce; the ID token's signature (the provider's JWKS), expiry, issuer and audience
are checked.

Each account is bound to the provider's issuer and subject (``sub``) at its first sign-in, and
sign-ins are matched on that alone afterwards (``gateway.identity.sso_accounts``): never on a
name or an email, which some providers let anybody choose. A first sign-in links a provisioned
account (made without a password by the admin API or ``manage.py create_user``) only through
the provider name an operator gave it or an email the provider says it verified; otherwise it
gets a new account named after its ``preferred_username`` (else its email, else its subject),
or, if another account has that name, a refusal. A local account with a usable password is
never signed in by a sign-in that claims its name. On every sign-in the
provider's group claim decides staff and superuser (``LLMGW_OIDC_STAFF_GROUPS``,
``LLMGW_OIDC_SUPERUSER_GROUPS``) and the user's teams: the claim's groups that are teams
(created when ``LLMGW_OIDC_CREATE_TEAMS``). The provider is the source of truth for people
who sign in through it.

``LLMGW_PASSWORD_LOGIN=false`` turns local passwords off: only single sign-on remains.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import jwt
import requests
from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser, Group, User
from django.core.exceptions import SuspiciousOperation
from django.db import transaction
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from mozilla_django_oidc.auth import OIDCAuthenticationBackend
from mozilla_django_oidc.views import (
    OIDCAuthenticationCallbackView,
    OIDCAuthenticationRequestView,
)

from gateway.identity import sso_accounts

logger = logging.getLogger(__name__)

DISCOVERY_TTL = 3600.0
_USERNAME = re.compile(r"[\w.@+-]{1,150}")
_ENDPOINTS = {
    "OIDC_OP_AUTHORIZATION_ENDPOINT": "authorization_endpoint",
    "OIDC_OP_TOKEN_ENDPOINT": "token_endpoint",
    "OIDC_OP_USER_ENDPOINT": "userinfo_endpoint",
    "OIDC_OP_JWKS_ENDPOINT": "jwks_uri",
}


def enabled() -> bool:
    return bool(getattr(settings, "LLMGW_OIDC_ISSUER", ""))


# --------------------------------------------------------------------------- discovery

_lock = threading.Lock()
_discovered: dict[str, tuple[float, dict[str, Any]]] = {}


class DiscoveryError(Exception):
    """The provider's discovery document could not be had or is not usable."""


def discovery(issuer: str) -> dict[str, Any]:
    """The provider's discovery document, fetched at most once an hour per process."""
    with _lock:
        cached = _discovered.get(issuer)
        if cached is not None and time.monotonic() - cached[0] < DISCOVERY_TTL:
            return cached[1]
    url = issuer.rstrip("/") + "/.well-known/openid-configuration"
    try:
        response = requests.get(url, timeout=settings.OIDC_TIMEOUT)
        response.raise_for_status()
        document = response.json()
    except (requests.RequestException, ValueError) as exc:
        raise DiscoveryError(f"{url}: {exc}") from None
    if not isinstance(document, dict) or document.get("issuer") != issuer:
        # OpenID Connect Discovery 1.0, section 4.3: the issuer must be exactly the one asked.
        raise DiscoveryError(f"{url} names issuer {document.get('issuer')!r}, not {issuer!r}")
    missing = [key for key in _ENDPOINTS.values() if not document.get(key)]
    if missing:
        raise DiscoveryError(f"{url} lacks {', '.join(missing)}")
    with _lock:
        _discovered[issuer] = (time.monotonic(), document)
    return document


def forget_discovery() -> None:
    with _lock:
        _discovered.clear()


def _setting(attr: str, *default: Any) -> Any:
    """mozilla-django-oidc's settings, the endpoints from discovery."""
    if attr in _ENDPOINTS:
        # Off, the views still get built before they answer 404: no endpoint, no request.
        return discovery(settings.LLMGW_OIDC_ISSUER)[_ENDPOINTS[attr]] if enabled() else ""
    return getattr(settings, attr, *default) if default else getattr(settings, attr)


# --------------------------------------------------------------------------- claims to roles


@dataclass(frozen=True)
class Roles:
    is_staff: bool
    is_superuser: bool
    teams: frozenset[str]


def roles_from_groups(
    groups: Iterable[str],
    *,
    staff_groups: Iterable[str],
    superuser_groups: Iterable[str],
    teams: Iterable[str],
) -> Roles:
    """What the provider's groups make of a user (pure): staff if in a staff group (or a
    superuser group), superuser if in a superuser group, and a member of each group that is a
    team (``teams``: the team names that exist or may be created)."""
    mine = set(groups)
    superuser = bool(mine & set(superuser_groups))
    return Roles(
        is_staff=superuser or bool(mine & set(staff_groups)),
        is_superuser=superuser,
        teams=frozenset(mine & set(teams)),
    )


def groups_of(claims: dict[str, Any]) -> list[str]:
    """The group claim as a list of names; anything else in it is ignored."""
    value = claims.get(settings.LLMGW_OIDC_GROUPS_CLAIM, [])
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        return []
    return [g for g in value if isinstance(g, str) and 0 < len(g) <= 150]


def username_for(claims: dict[str, Any]) -> str:
    for key in ("preferred_username", "email"):
        value = claims.get(key)
        if isinstance(value, str) and _USERNAME.fullmatch(value):
            return value
    subject = str(claims.get("sub", ""))
    return "oidc-" + hashlib.sha256(subject.encode()).hexdigest()[:16]


def claimed(claims: dict[str, Any]) -> sso_accounts.Claimed:
    """What the verified claims say about who signed in, as the account matching reads it."""
    preferred = claims.get("preferred_username")
    email = claims.get("email")
    verified = claims.get("email_verified")
    return sso_accounts.Claimed(
        issuer=settings.LLMGW_OIDC_ISSUER,
        subject=str(claims.get("sub", "")),
        username=username_for(claims),
        provider_username=preferred if isinstance(preferred, str) else "",
        email=email if isinstance(email, str) and len(email) <= 254 else "",
        # A boolean by the standard; some providers send the string.
        email_verified=verified is True or str(verified).lower() == "true",
    )


def apply_roles(user: User, claims: dict[str, Any]) -> User:
    """Staff, superuser and teams from the claims, in one transaction."""
    groups = groups_of(claims)
    with transaction.atomic():
        existing = set(Group.objects.filter(name__in=groups).values_list("name", flat=True))
        creatable = set(groups) if settings.LLMGW_OIDC_CREATE_TEAMS else set()
        staff_groups = set(settings.LLMGW_OIDC_STAFF_GROUPS)
        superuser_groups = set(settings.LLMGW_OIDC_SUPERUSER_GROUPS)
        roles = roles_from_groups(
            groups,
            staff_groups=staff_groups,
            superuser_groups=superuser_groups,
            # Groups that only grant staff or superuser are roles, not teams.
            teams=(existing | creatable) - ((staff_groups | superuser_groups) - existing),
        )
        for name in sorted(roles.teams - existing):
            Group.objects.get_or_create(name=name)
        user.is_staff = roles.is_staff
        user.is_superuser = roles.is_superuser
        email = claims.get("email")
        if isinstance(email, str) and len(email) <= 254:
            user.email = email
        user.save(update_fields=["is_staff", "is_superuser", "email"])
        user.groups.set(Group.objects.filter(name__in=roles.teams))
    logger.info(
        "sso: %s signed in (staff=%s, superuser=%s, teams=%s)",
        user.username,
        roles.is_staff,
        roles.is_superuser,
        ",".join(sorted(roles.teams)) or "-",
    )
    return user


# --------------------------------------------------------------------------- the backend


class Backend(OIDCAuthenticationBackend):  # type: ignore[misc]
    """mozilla-django-oidc's code flow, with discovery, issuer and audience checks, names
    from ``preferred_username`` and roles from the group claim."""

    @staticmethod
    def get_settings(attr: str, *args: Any) -> Any:
        return _setting(attr, *args)

    def authenticate(self, request: HttpRequest | None, **kwargs: Any) -> AbstractBaseUser | None:
        if not enabled():
            return None
        return super().authenticate(request, **kwargs)  # type: ignore[no-any-return]

    def get_payload_data(self, token: bytes | str, key: Any) -> dict[str, Any]:
        algorithm = self.OIDC_RP_SIGN_ALGO
        if jwt.get_unverified_header(token).get("alg") != algorithm:
            raise SuspiciousOperation(f"the ID token is not signed with {algorithm}")
        try:
            return jwt.decode(
                token,
                key,
                algorithms=[algorithm],
                audience=self.OIDC_RP_CLIENT_ID,
                issuer=settings.LLMGW_OIDC_ISSUER,
                options={"require": ["exp", "iat", "iss", "aud", "sub"]},
                leeway=30,
            )
        except jwt.PyJWTError as exc:
            raise SuspiciousOperation(f"ID token refused: {exc}") from None

    def get_userinfo(
        self, access_token: str, id_token: str, payload: dict[str, Any]
    ) -> dict[str, Any]:
        # The verified ID token's claims, completed by the userinfo endpoint (where providers
        # often put groups); the subject must be the same in both (OIDC Core 5.3.2).
        info = super().get_userinfo(access_token, id_token, payload)
        if info.get("sub") != payload.get("sub"):
            raise SuspiciousOperation("userinfo is about another subject than the ID token")
        return {**payload, **info}

    def verify_claims(self, claims: dict[str, Any]) -> bool:
        return isinstance(claims.get("sub"), str) and bool(claims["sub"])

    def get_or_create_user(
        self, access_token: str, id_token: str, payload: dict[str, Any]
    ) -> User | None:
        """The account bound to the sign-in's subject (bound now if this is its first), with
        its roles from the claims. sso_accounts.Refused: no account for it."""
        claims = self.get_userinfo(access_token, id_token, payload)
        if not self.verify_claims(claims):
            raise SuspiciousOperation("the sign-in names no subject (sub)")
        with transaction.atomic():  # a first sign-in's binding and roles commit together
            user = sso_accounts.account_for(claimed(claims))
            return apply_roles(user, claims)


# --------------------------------------------------------------------------- the views


class Authenticate(OIDCAuthenticationRequestView):  # type: ignore[misc]
    """``/oidc/authenticate/``: off (404) unless configured."""

    @staticmethod
    def get_settings(attr: str, *args: Any) -> Any:
        return _setting(attr, *args)

    def dispatch(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if not enabled():
            raise Http404("single sign-on is not configured")
        try:
            return super().dispatch(request, *args, **kwargs)  # type: ignore[no-any-return]
        except DiscoveryError as exc:
            logger.warning("sso: the provider cannot be reached: %s", exc)
            return HttpResponseRedirect(settings.LOGIN_REDIRECT_URL_FAILURE)


class Callback(OIDCAuthenticationCallbackView):  # type: ignore[misc]
    """``/oidc/callback/``: where the provider sends the browser back."""

    @staticmethod
    def get_settings(attr: str, *args: Any) -> Any:
        return _setting(attr, *args)

    def dispatch(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if not enabled():
            raise Http404("single sign-on is not configured")
        try:
            return super().dispatch(request, *args, **kwargs)  # type: ignore[no-any-return]
        except (DiscoveryError, requests.RequestException) as exc:
            logger.warning("sso: the provider cannot be reached: %s", exc)
            return HttpResponseRedirect(settings.LOGIN_REDIRECT_URL_FAILURE)
        except (SuspiciousOperation, sso_accounts.Refused) as exc:
            # A token that fails its checks, a replayed state, a name that is another
            # account's: refused, and said in the log.
            logger.warning("sso: sign-in refused: %s", exc)
            return HttpResponseRedirect(settings.LOGIN_REDIRECT_URL_FAILURE)


def context(request: HttpRequest) -> dict[str, Any]:
    """For the sign-in pages: whether to offer single sign-on, and the password form."""
    return {"sso_enabled": enabled(), "password_login": settings.LLMGW_PASSWORD_LOGIN}


def signed_in(request: HttpRequest) -> HttpResponse:
    """Where a sign-in lands: the dashboard for staff, the account page for everybody else."""
    user = request.user
    if not user.is_authenticated:
        return HttpResponseRedirect("/account/login/")
    return HttpResponseRedirect("/admin/" if user.is_staff else "/account/")
