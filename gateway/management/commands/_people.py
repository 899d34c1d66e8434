"""What the user and team commands share: parsing a list of names, saying what a user or a
team now is, and the errors that are the operator's. (The leading underscore keeps Django from
listing this module as a command.)"""

from __future__ import annotations

from django.contrib.auth.models import User

from gateway.identity import people

PEOPLE_ERRORS = (people.Conflict, people.Missing, people.PersonInvalid)


def names(text: str) -> list[str]:
    """A comma-separated list; "" is the empty list."""
    return [n.strip() for n in text.split(",") if n.strip()]


def describe_user(user: User) -> str:
    teams = sorted(user.groups.values_list("name", flat=True))
    flags = [
        word
        for word, on in (
            ("active", user.is_active),
            ("inactive", not user.is_active),
            ("staff", user.is_staff),
            ("superuser", user.is_superuser),
        )
        if on
    ]
    return (
        f"user {user.username}: {', '.join(flags)}; email {user.email or '-'}; "
        f"teams {', '.join(teams) or '-'}"
    )


def describe_team(name: str, members: list[str]) -> str:
    return f"team {name}: members {', '.join(members) or '-'}"
