"""``manage.py set_limits (--user NAME | --team NAME) [--models a,b] [--rpm N|none] ...``

Sets a user's or a team's limits over all their keys, through the same function the admin's
limits pages and the admin API use. Options not given keep their value; ``none`` lifts a
limit; ``--models ""`` allows every model; ``--clear`` removes the holder's limits altogether.
Prints the limits as they now stand.
"""

from __future__ import annotations

import getpass
from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.core.management.base import BaseCommand, CommandError, CommandParser

from gateway.identity import people
from gateway.models import ApiKey, TeamLimits, UserLimits


def cli_actor() -> str:
    """Who did it, for the audit trail: the operating-system user running the command (as the
    fleet's commands say it)."""
    try:
        return f"cli:{getpass.getuser()}"
    except (KeyError, OSError):  # no passwd entry (some containers)
        return "cli"


def limit(text: str) -> int | None:
    """A whole number of zero or more, or ``none`` for no limit (argparse type)."""
    if text.strip().lower() == "none":
        return None
    value = int(text)  # a ValueError is argparse's "invalid limit value"
    if value < 0:
        raise ValueError(text)
    return value


def on_off(text: str) -> bool:
    choices = {"on": True, "off": False}
    if text not in choices:
        raise ValueError(text)
    return choices[text]


class Command(BaseCommand):
    help = "Set a user's or a team's limits over all their keys (options not given are kept)."

    def add_arguments(self, parser: CommandParser) -> None:
        holder = parser.add_mutually_exclusive_group(required=True)
        holder.add_argument("--user", help="The user's username.")
        holder.add_argument("--team", help="The team's (group's) name.")
        parser.add_argument("--models", help='Comma-separated models; "" allows every model.')
        parser.add_argument("--rpm", type=limit, default=..., help="Requests per minute, or none.")
        parser.add_argument("--tpm", type=limit, default=..., help="Tokens per minute, or none.")
        parser.add_argument(
            "--budget", type=limit, default=..., help="Tokens per budget period, or none."
        )
        parser.add_argument("--budget-period", choices=[c.value for c in ApiKey.BudgetPeriod])
        parser.add_argument(
            "--self-service",
            type=on_off,
            help="on/off: whether the user may make their own keys at /account/ (users only).",
        )
        parser.add_argument(
            "--clear", action="store_true", help="Remove the holder's limits altogether."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        changes: dict[str, object] = {}
        if options["models"] is not None:
            changes["allowed_models"] = [
                m.strip() for m in options["models"].split(",") if m.strip()
            ]
        for option, field in (
            ("rpm", "rpm_limit"),
            ("tpm", "tpm_limit"),
            ("budget", "token_budget"),
        ):
            if options[option] is not ...:
                changes[field] = options[option]
        if options["budget_period"] is not None:
            changes["budget_period"] = options["budget_period"]
        if options["self_service"] is not None:
            if options["team"] is not None:
                raise CommandError("--self-service is a user's, not a team's")
            changes["self_service"] = options["self_service"]
        if options["clear"] and changes:
            raise CommandError("--clear takes no other limits")
        if not options["clear"] and not changes:
            raise CommandError("give a limit to set (--models, --rpm, ...) or --clear")
        if options["user"] is not None:
            self._user(options["user"], changes, clear=options["clear"])
        else:
            self._team(options["team"], changes, clear=options["clear"])

    def _user(self, username: str, changes: dict[str, object], *, clear: bool) -> None:
        user_id = (
            get_user_model().objects.filter(username=username).values_list("pk", flat=True).first()
        )
        if user_id is None:
            raise CommandError(f"no user {username!r}")
        if clear:
            done = people.clear_user_limits(user_id, actor=cli_actor())
            self.stdout.write(f"user {username}: " + ("limits removed" if done else "no limits"))
            return
        row = self._set(people.set_user_limits, user_id, changes)
        assert isinstance(row, UserLimits)
        self.stdout.write(
            f"user {username}: {describe(row)}, self-service {'on' if row.self_service else 'off'}"
        )

    def _team(self, name: str, changes: dict[str, object], *, clear: bool) -> None:
        team_id = Group.objects.filter(name=name).values_list("pk", flat=True).first()
        if team_id is None:
            raise CommandError(f"no team {name!r}")
        if clear:
            done = people.clear_team_limits(team_id, actor=cli_actor())
            self.stdout.write(f"team {name}: " + ("limits removed" if done else "no limits"))
            return
        row = self._set(people.set_team_limits, team_id, changes)
        self.stdout.write(f"team {name}: {describe(row)}")

    @staticmethod
    def _set(change: Any, holder: int, changes: dict[str, object]) -> UserLimits | TeamLimits:
        try:
            row: UserLimits | TeamLimits = change(holder, actor=cli_actor(), **changes)
        except people.LimitsInvalid as exc:
            raise CommandError(f"{exc.field}: {exc}") from None
        return row


def describe(row: UserLimits | TeamLimits) -> str:
    def shown(value: int | None) -> str:
        return "none" if value is None else str(value)

    return (
        f"models {', '.join(row.allowed_models) or 'all'}; rpm {shown(row.rpm_limit)}, "
        f"tpm {shown(row.tpm_limit)}, budget {shown(row.token_budget)} per {row.budget_period}"
    )
