"""People: users and teams (Django users and groups) and their limits, each change one function.

Every change to a user, a team or their limits is one function here, one transaction, with an
operator Event naming who did it (``actor``): the admin's user, group and limits pages, the
``manage.py`` commands (``create_user``, ``set_user``, ``create_team``, ``set_team_members``,
``delete_team``, ``set_limits``) and the admin API call these and nothing else. Single sign-on
keeps a user's staff flag and teams in step with the provider at each sign-in
(``llmgw_site.sso``); that is the provider's word, not an operator's change. What the pages
show of a holder's limits and spend is ``gateway.identity.allowances``'s.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group, Permission, User
from django.contrib.auth.validators import UnicodeUsernameValidator
from django.core.exceptions import ValidationError
from django.core.validators import validate_email
from django.db import transaction
from django.db.models import Q

from control import serving
from gateway.models import ApiKey, SsoLinkName, TeamLimits, UserLimits

# --------------------------------------------------------------------------- limits

# What a user's or team's limits row holds (a user's also ``self_service``).
LIMIT_FIELDS = ("allowed_models", "rpm_limit", "tpm_limit", "token_budget", "budget_period")
_PERIODS = frozenset(ApiKey.BudgetPeriod.values)


class LimitsInvalid(ValueError):
    """A limit value no holder can have; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _checked(changes: dict[str, object], allowed: frozenset[str]) -> dict[str, object]:
    """The changes, normalised (a model list sorted and without repeats), or LimitsInvalid.
    Every edge (the admin's form, the admin API) has already checked its own input; this is the
    last word, so a shell or a future edge cannot store a limit the request path misreads."""
    out: dict[str, object] = {}
    for name, given in changes.items():
        value = given
        if name not in allowed:
            raise LimitsInvalid(name, f"{name} is not a limit")
        if name == "allowed_models":
            if not isinstance(value, list) or not all(isinstance(m, str) and m for m in value):
                raise LimitsInvalid(name, "a list of model names; empty: every model")
            value = sorted(set(value))
        elif name == "budget_period":
            if value not in _PERIODS:
                raise LimitsInvalid(name, f"one of {', '.join(sorted(_PERIODS))}")
        elif name == "self_service":
            if not isinstance(value, bool):
                raise LimitsInvalid(name, "true or false")
        elif value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise LimitsInvalid(name, "a whole number, or null for no limit")
        elif value is not None and value < 0:
            raise LimitsInvalid(name, "zero or more, or null for no limit")
        out[name] = value
    return out


def _describe(changes: dict[str, dict[str, object]], *, empty_list: str = "all") -> str:
    def shown(value: object) -> str:
        if isinstance(value, list):
            return ",".join(value) or empty_list
        if value == "":
            return '""'
        return "none" if value is None else str(value)

    return ", ".join(
        f"{name} {shown(change['from'])} → {shown(change['to'])}"
        for name, change in changes.items()
    )


def _set(
    row_model: type[UserLimits] | type[TeamLimits],
    holder: dict[str, Any],
    subject: str,
    actor: str,
    values: dict[str, object],
) -> UserLimits | TeamLimits:
    """Make or change one holder's limits row, and say so in the audit trail (who, and each
    field's old and new value) when anything changed."""
    with transaction.atomic():
        row, created = row_model.objects.select_for_update().get_or_create(**holder)
        diff = {
            name: {"from": getattr(row, name), "to": value}
            for name, value in values.items()
            if getattr(row, name) != value
        }
        for name, change in diff.items():
            setattr(row, name, change["to"])
        if diff:
            row.save()
        if diff or created:
            verb = "set" if created else "changed"
            serving.record_operator_event(
                subject,
                f"limits {verb} by {actor}" + (f": {_describe(diff)}" if diff else ""),
                {"actor": actor, "changes": diff},
            )
    return row


def set_user_limits(user_id: int, *, actor: str, **changes: object) -> UserLimits:
    """Set the given limits (and ``self_service``) of one user, making their limits row if
    they have none; fields not given keep their value. Keys take the change up within the
    key cache's TTL. The one function the admin's user limits pages, ``manage.py set_limits``
    and the admin API call; ``actor`` says who, for the audit trail."""
    values = _checked(changes, frozenset({*LIMIT_FIELDS, "self_service"}))
    row = _set(UserLimits, {"user_id": user_id}, f"user/{_username(user_id)}", actor, values)
    assert isinstance(row, UserLimits)
    return row


def set_team_limits(team_id: int, *, actor: str, **changes: object) -> TeamLimits:
    """Set the given limits of one team (a Django group), making its limits row if it has
    none; fields not given keep their value. See :func:`set_user_limits`."""
    values = _checked(changes, frozenset(LIMIT_FIELDS))
    row = _set(TeamLimits, {"team_id": team_id}, f"team/{_team_name(team_id)}", actor, values)
    assert isinstance(row, TeamLimits)
    return row


def clear_user_limits(user_id: int, *, actor: str) -> bool:
    """No limits of the user's own any more (their keys' and teams' still apply), and
    self-service back on. True if there were any."""
    with transaction.atomic():
        deleted, _ = UserLimits.objects.filter(user_id=user_id).delete()
        if deleted:
            serving.record_operator_event(
                f"user/{_username(user_id)}", f"limits removed by {actor}", {"actor": actor}
            )
    return bool(deleted)


def clear_team_limits(team_id: int, *, actor: str) -> bool:
    """No limits of the team's any more. True if there were any."""
    with transaction.atomic():
        deleted, _ = TeamLimits.objects.filter(team_id=team_id).delete()
        if deleted:
            serving.record_operator_event(
                f"team/{_team_name(team_id)}", f"limits removed by {actor}", {"actor": actor}
            )
    return bool(deleted)


def _username(user_id: int) -> str:
    name = get_user_model().objects.filter(pk=user_id).values_list("username", flat=True).first()
    return str(name) if name is not None else f"#{user_id}"


def _team_name(team_id: int) -> str:
    name = Group.objects.filter(pk=team_id).values_list("name", flat=True).first()
    return str(name) if name is not None else f"#{team_id}"


# --------------------------------------------------------------------------- users and teams


class Conflict(Exception):
    """The name is taken; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class Missing(Exception):
    """A user, team or permission named does not exist; ``field`` names the reference."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class PersonInvalid(ValueError):
    """A value no user or team can have; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


# What describes a user, beside their teams and permissions: what ``update_user`` changes.
USER_FIELDS = ("email", "first_name", "last_name", "is_active", "is_staff", "is_superuser")
_NAME_MAX = 150  # auth.User.username, first_name, last_name and auth.Group.name


def _check_user_values(values: dict[str, object]) -> None:
    """The last word on a user's fields, as :func:`_checked` is on limits: every edge checks
    its own input first, this keeps a shell or a future edge from storing what the admin's
    forms would refuse."""
    for name, value in values.items():
        if name.startswith("is_"):
            if not isinstance(value, bool):
                raise PersonInvalid(name, "true or false")
        elif not isinstance(value, str):
            raise PersonInvalid(name, "a string")
        elif name == "email":
            if len(value) > 254:
                raise PersonInvalid(name, "at most 254 characters")
            if value:
                try:
                    validate_email(value)
                except ValidationError:
                    raise PersonInvalid(name, f"{value!r} is not an email address") from None
        elif len(value) > _NAME_MAX:
            raise PersonInvalid(name, f"at most {_NAME_MAX} characters")


def _check_username(username: str) -> None:
    if not username or len(username) > _NAME_MAX:
        raise PersonInvalid("username", f"1 to {_NAME_MAX} characters")
    try:
        UnicodeUsernameValidator()(username)
    except ValidationError:
        raise PersonInvalid("username", "letters, digits and @/./+/-/_ only") from None


def _check_team_name(name: str) -> None:
    if not name.strip() or len(name) > _NAME_MAX:
        raise PersonInvalid("name", f"1 to {_NAME_MAX} characters, not only spaces")


def _teams(names: Iterable[str], field: str = "teams") -> list[Group]:
    wanted = sorted(set(names))
    found = list(Group.objects.filter(name__in=wanted).order_by("name"))
    missing = sorted(set(wanted) - {g.name for g in found})
    if missing:
        raise Missing(field, f"no team named {', '.join(missing)}")
    return found


def _members(usernames: Iterable[str], field: str = "members") -> list[User]:
    wanted = sorted(set(usernames))
    found = list(User.objects.filter(username__in=wanted).order_by("username"))
    missing = sorted(set(wanted) - {u.username for u in found})
    if missing:
        raise Missing(field, f"no user named {', '.join(missing)}")
    return found


def _permission_name(permission: Permission) -> str:
    return f"{permission.content_type.app_label}.{permission.codename}"


def _permissions(names: Iterable[str], field: str = "permissions") -> list[Permission]:
    """``app_label.codename`` strings (``"gateway.view_apikey"``) → the permissions."""
    wanted = sorted(set(names))
    query = Q(pk__in=[])
    for name in wanted:
        app_label, _, codename = name.partition(".")
        query |= Q(content_type__app_label=app_label, codename=codename)
    found = list(Permission.objects.filter(query).select_related("content_type"))
    missing = sorted(set(wanted) - {_permission_name(p) for p in found})
    if missing:
        raise Missing(field, f"no permission {', '.join(missing)} (app_label.codename)")
    return found


def permission_names(rows: Iterable[Permission]) -> list[str]:
    return sorted(_permission_name(p) for p in rows)


def create_user(
    username: str,
    *,
    actor: str,
    email: str = "",
    first_name: str = "",
    last_name: str = "",
    is_staff: bool = False,
    is_active: bool = True,
    is_superuser: bool = False,
    teams: Iterable[str] = (),
    permissions: Iterable[str] = (),
    password: str | None = None,
    sso_username: str = "",
) -> User:
    """A new user in the given teams. ``password`` is one an administrator chose in the admin's
    add form; the admin API and ``manage.py create_user`` never set one: the user signs in by
    single sign-on, or with a password set later (``/account/``, the admin,
    ``manage.py changepassword``). Without one the user has an unusable password, and their
    first single sign-on links the account if the provider vouches for ``email`` or signs in
    the provider name ``sso_username`` (``gateway.identity.sso_accounts``).
    Conflict: the username (or the provider name) is taken; Missing: a team or permission
    named does not exist."""
    _check_username(username)
    values: dict[str, object] = {
        "email": email,
        "first_name": first_name,
        "last_name": last_name,
        "is_active": is_active,
        "is_staff": is_staff,
        "is_superuser": is_superuser,
    }
    _check_user_values(values)
    with transaction.atomic():
        if User.objects.filter(username=username).exists():
            raise Conflict("username", f"user {username!r} exists")
        groups = _teams(teams)
        perms = _permissions(permissions)
        user = User(username=username, **values)
        if password is None:
            user.set_unusable_password()
        else:
            user.set_password(password)
        user.save()
        user.groups.set(groups)
        user.user_permissions.set(perms)
        if sso_username:
            _link_name(user, sso_username)
        shown = {
            **values,
            "teams": [g.name for g in groups],
            "permissions": permission_names(perms),
            "password": password is not None,
            "sso_username": sso_username,
        }
        serving.record_operator_event(
            f"user/{username}",
            f"created by {actor}: {_describe_new(shown)}",
            {"actor": actor, "created": shown},
        )
    return user


def _link_name(user: User, sso_username: str) -> None:
    """Give the provisioned ``user`` the provider name whose first sign-in links them."""
    if len(sso_username) > 255 or not sso_username.strip():
        raise PersonInvalid("sso_username", "1 to 255 characters, not only spaces")
    if user.has_usable_password():
        raise PersonInvalid(
            "sso_username", f"{user.username!r} has a password; single sign-on never links it"
        )
    taken = SsoLinkName.objects.filter(provider_username=sso_username).exclude(user=user)
    if taken.exists():
        raise Conflict("sso_username", f"another account is linked by {sso_username!r}")
    SsoLinkName.objects.update_or_create(user=user, defaults={"provider_username": sso_username})


def set_sso_username(username: str, sso_username: str, *, actor: str) -> None:
    """The provider name whose first single sign-on links this provisioned account (``""``:
    none), for providers that vouch for no email; its binding decides from then on.
    Missing: no such user; Conflict: another account has that name; PersonInvalid: the
    account has a password."""
    with transaction.atomic():
        user = User.objects.select_for_update().filter(username=username).first()
        if user is None:
            raise Missing("username", f"no user {username!r}")
        before = SsoLinkName.objects.filter(user=user).values_list("provider_username", flat=True)
        old = before.first() or ""
        if old == sso_username:
            return
        if sso_username:
            _link_name(user, sso_username)
        else:
            SsoLinkName.objects.filter(user=user).delete()
        diff: dict[str, dict[str, object]] = {"sso_username": {"from": old, "to": sso_username}}
        serving.record_operator_event(
            f"user/{username}",
            f"changed by {actor}: {_describe(diff)}",
            {"actor": actor, "changes": diff},
        )


def _describe_new(values: Mapping[str, object]) -> str:
    """What a new user or team is, shortly: the flags that are on, the lists that are not
    empty (``staff, teams ml,research, password sign-in``)."""
    words = []
    for name, value in values.items():
        if name == "password":
            words.append("password sign-in" if value else "no password")
        elif isinstance(value, bool):
            # is_active is the usual case; say so only when it is not.
            if name == "is_active":
                if not value:
                    words.append("inactive")
            elif value:
                words.append(name.removeprefix("is_"))
        elif isinstance(value, list):
            if value:
                words.append(f"{name} {','.join(value)}")
        elif value:
            words.append(f"{name} {value}")
    return ", ".join(words) or "no details"


def update_user(
    username: str,
    *,
    actor: str,
    teams: Iterable[str] | None = None,
    permissions: Iterable[str] | None = None,
    **changes: object,
) -> User:
    """Change what is given of :data:`USER_FIELDS` (email, names, active, staff, superuser);
    ``teams`` replaces the user's teams and ``permissions`` (``app_label.codename``) their own
    permissions. One Event lists each changed field's old and new value; nothing changed, no
    Event. Deactivating a user stops their sign-ins; their API keys are revoked separately
    (``keys.revoke``). Missing: no such user, team or permission."""
    unknown = sorted(set(changes) - set(USER_FIELDS))
    if unknown:
        raise PersonInvalid(unknown[0], f"{unknown[0]} is not a field of a user")
    _check_user_values(changes)
    with transaction.atomic():
        # Locked: two operators changing one user at once each see the other's result.
        user = User.objects.select_for_update().filter(username=username).first()
        if user is None:
            raise Missing("username", f"no user {username!r}")
        # In USER_FIELDS' order, whatever the edge's: the Event reads the same from each.
        diff: dict[str, dict[str, object]] = {
            name: {"from": getattr(user, name), "to": changes[name]}
            for name in USER_FIELDS
            if name in changes and getattr(user, name) != changes[name]
        }
        for name, change in diff.items():
            setattr(user, name, change["to"])
        if diff:
            user.save(update_fields=list(diff))
        if teams is not None:
            groups = _teams(teams)
            before = sorted(user.groups.values_list("name", flat=True))
            after = [g.name for g in groups]
            if before != after:
                user.groups.set(groups)
                diff["teams"] = {"from": before, "to": after}
        if permissions is not None:
            perms = _permissions(permissions)
            before = permission_names(user.user_permissions.select_related("content_type"))
            after = permission_names(perms)
            if before != after:
                user.user_permissions.set(perms)
                diff["permissions"] = {"from": before, "to": after}
        if diff:
            serving.record_operator_event(
                f"user/{username}",
                f"changed by {actor}: {_describe(diff, empty_list='none')}",
                {"actor": actor, "changes": diff},
            )
    return user


def create_team(
    name: str, *, actor: str, members: Iterable[str] = (), permissions: Iterable[str] = ()
) -> Group:
    """A new team (a Django group) with these members (usernames) and, for the admin's staff,
    these permissions (``app_label.codename``). Conflict: the name is taken; Missing: a member
    or permission named does not exist."""
    _check_team_name(name)
    with transaction.atomic():
        if Group.objects.filter(name=name).exists():
            raise Conflict("name", f"team {name!r} exists")
        users = _members(members)
        perms = _permissions(permissions)
        team = Group.objects.create(name=name)
        team.user_set.set(users)
        team.permissions.set(perms)
        shown = {
            "members": [u.username for u in users],
            "permissions": permission_names(perms),
        }
        serving.record_operator_event(
            f"team/{name}",
            f"created by {actor}: {_describe_new(shown)}",
            {"actor": actor, "created": shown},
        )
    return team


def _locked_team(name: str) -> Group:
    team = Group.objects.select_for_update().filter(name=name).first()
    if team is None:
        raise Missing("name", f"no team {name!r}")
    return team


def set_team_members(name: str, members: Iterable[str], *, actor: str) -> Group:
    """The team's members are these users, and only these (their limits are shared from the
    next request on). An Event with who left and who joined; no change, no Event."""
    with transaction.atomic():
        team = _locked_team(name)
        users = _members(members)
        before = sorted(team.user_set.values_list("username", flat=True))
        after = [u.username for u in users]
        if before != after:
            team.user_set.set(users)
            diff: dict[str, dict[str, object]] = {"members": {"from": before, "to": after}}
            serving.record_operator_event(
                f"team/{name}",
                f"changed by {actor}: {_describe(diff, empty_list='none')}",
                {"actor": actor, "changes": diff},
            )
    return team


def set_team_permissions(name: str, permissions: Iterable[str], *, actor: str) -> Group:
    """The Django permissions the team's staff members have in the admin
    (``app_label.codename``), and only these. The admin's group page is the one edge."""
    with transaction.atomic():
        team = _locked_team(name)
        perms = _permissions(permissions)
        before = permission_names(team.permissions.select_related("content_type"))
        after = permission_names(perms)
        if before != after:
            team.permissions.set(perms)
            diff: dict[str, dict[str, object]] = {"permissions": {"from": before, "to": after}}
            serving.record_operator_event(
                f"team/{name}",
                f"changed by {actor}: {_describe(diff, empty_list='none')}",
                {"actor": actor, "changes": diff},
            )
    return team


def delete_team(name: str, *, actor: str) -> bool:
    """Remove a team, with its limits (its members keep their own). False: no such team."""
    with transaction.atomic():
        team = Group.objects.select_for_update().filter(name=name).first()
        if team is None:
            return False
        members = sorted(team.user_set.values_list("username", flat=True))
        had_limits = TeamLimits.objects.filter(team_id=team.pk).exists()
        team.delete()
        serving.record_operator_event(
            f"team/{name}",
            f"deleted by {actor}"
            + (f" (members {','.join(members)})" if members else "")
            + (", with its limits" if had_limits else ""),
            {"actor": actor, "deleted": {"members": members, "limits": had_limits}},
        )
    return True
