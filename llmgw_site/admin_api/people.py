"""Users and teams (Django users and groups), changed by the admin API.

One function per change, each one transaction. A user's password is never set here: people
sign in with the password they set themselves (``/account/``), a password an administrator
sets in the admin, or single sign-on; a user made by the API without a password cannot sign in
with one (an unusable password) until one of those gives them one.
"""

from __future__ import annotations

from collections.abc import Iterable

from django.contrib.auth.models import Group, User
from django.db import transaction


class Conflict(Exception):
    """The name is taken; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class Missing(Exception):
    """A user or team named does not exist; ``field`` names the reference."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _teams(names: Iterable[str], field: str) -> list[Group]:
    names = sorted(set(names))
    found = list(Group.objects.filter(name__in=names))
    missing = sorted(set(names) - {g.name for g in found})
    if missing:
        raise Missing(field, f"no team named {', '.join(missing)}")
    return found


def create_user(
    username: str,
    *,
    email: str = "",
    is_staff: bool = False,
    is_active: bool = True,
    teams: Iterable[str] = (),
) -> User:
    with transaction.atomic():
        if User.objects.filter(username=username).exists():
            raise Conflict("username", f"user {username!r} exists")
        groups = _teams(teams, "teams")
        user = User(username=username, email=email, is_staff=is_staff, is_active=is_active)
        user.set_unusable_password()
        user.save()
        user.groups.set(groups)
    return user


def update_user(
    username: str,
    *,
    email: str | None = None,
    is_staff: bool | None = None,
    is_active: bool | None = None,
    teams: Iterable[str] | None = None,
) -> User:
    """Change what is given; ``teams`` replaces the user's teams. Deactivating a user stops
    their sign-ins; their API keys are revoked separately (``keys.revoke``)."""
    with transaction.atomic():
        user = User.objects.select_for_update().filter(username=username).first()
        if user is None:
            raise Missing("username", f"no user {username!r}")
        fields = {"email": email, "is_staff": is_staff, "is_active": is_active}
        changed = [name for name, value in fields.items() if value is not None]
        for name in changed:
            setattr(user, name, fields[name])
        if changed:
            user.save(update_fields=changed)
        if teams is not None:
            user.groups.set(_teams(teams, "teams"))
    return user


def create_team(name: str, *, members: Iterable[str] = ()) -> Group:
    with transaction.atomic():
        if Group.objects.filter(name=name).exists():
            raise Conflict("name", f"team {name!r} exists")
        team = Group.objects.create(name=name)
        team.user_set.set(_members(members))
    return team


def _members(usernames: Iterable[str]) -> list[User]:
    names = sorted(set(usernames))
    found = list(User.objects.filter(username__in=names))
    missing = sorted(set(names) - {u.username for u in found})
    if missing:
        raise Missing("members", f"no user named {', '.join(missing)}")
    return found


def set_team_members(name: str, members: Iterable[str]) -> Group:
    with transaction.atomic():
        team = Group.objects.filter(name=name).first()
        if team is None:
            raise Missing("name", f"no team {name!r}")
        team.user_set.set(_members(members))
    return team


def delete_team(name: str) -> bool:
    deleted, _ = Group.objects.filter(name=name).delete()
    return bool(deleted)
