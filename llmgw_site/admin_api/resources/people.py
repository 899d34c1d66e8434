"""People's routes: users, teams and their members, and a user's or team's own limits (with
the budget's spend). Changes go through ``gateway.identity.people``, as the admin's pages and
``manage.py``'s commands do.
"""

# No `from __future__ import annotations`: ninja reads the route signatures at import time.

from collections.abc import Callable
from datetime import datetime
from typing import Any, Literal

from django.contrib.auth.models import Group, User
from django.http import HttpRequest
from django.shortcuts import get_object_or_404
from ninja import Field, Router, Schema, Status
from ninja.pagination import paginate
from pydantic import field_validator

from gateway.identity import allowances
from gateway.identity import people as gateway_people
from gateway.models import ApiKey, TeamLimits, UserLimits
from llmgw_site.admin_api.auth import actor_of, reads
from llmgw_site.admin_api.errors import AdminApiError
from llmgw_site.admin_api.pagination import Page
from llmgw_site.admin_api.schemas import Changed, Strict

router = Router(tags=["people"])


class UserOut(Schema):
    username: str
    email: str
    is_active: bool
    is_staff: bool
    is_superuser: bool
    date_joined: datetime
    last_login: datetime | None
    teams: list[str]

    @staticmethod
    def resolve_teams(obj: User) -> list[str]:
        return sorted(g.name for g in obj.groups.all())


class UserPatch(Strict):
    email: str | None = Field(None, max_length=254)
    is_active: bool | None = None
    is_staff: bool | None = None
    teams: list[str] | None = None


class UserIn(UserPatch):
    username: str = Field(min_length=1, max_length=150, pattern=r"^[\w.@+-]+$")
    sso_username: str = Field(
        "",
        max_length=255,
        description="Their name at the single sign-on provider, whose first sign-in links "
        "this account (else a verified email does).",
    )


class TeamOut(Schema):
    name: str
    members: list[str]

    @staticmethod
    def resolve_members(obj: Group) -> list[str]:
        return sorted(u.username for u in obj.user_set.all())


class TeamIn(Strict):
    name: str = Field(min_length=1, max_length=150)
    members: list[str] = []


class MembersIn(Strict):
    members: list[str]


PeopleError = gateway_people.Conflict | gateway_people.Missing | gateway_people.PersonInvalid


def _people_error(exc: PeopleError) -> AdminApiError:
    if isinstance(exc, gateway_people.Conflict):
        return AdminApiError(409, code="exists", message=str(exc), field=exc.field)
    if isinstance(exc, gateway_people.PersonInvalid):
        return AdminApiError(422, code="invalid", message=str(exc), field=exc.field)
    return AdminApiError(
        404 if exc.field in {"username", "name"} else 422,
        code="not_found",
        message=str(exc),
        field=exc.field,
    )


@router.get("/users", response=list[UserOut], auth=reads("auth.view_user"))
@paginate(Page)
def list_users(request: HttpRequest, team: str | None = None, staff: bool | None = None) -> Any:
    users = User.objects.prefetch_related("groups").order_by("username")
    if team:
        users = users.filter(groups__name=team)
    if staff is not None:
        users = users.filter(is_staff=staff)
    return users


@router.get("/users/{username}", response=UserOut, auth=reads("auth.view_user"))
def get_user(request: HttpRequest, username: str) -> Any:
    return get_object_or_404(User.objects.prefetch_related("groups"), username=username)


@router.post("/users", response={201: UserOut})
def create_user(request: HttpRequest, payload: UserIn) -> Any:
    try:
        user = gateway_people.create_user(
            payload.username,
            actor=actor_of(request),
            email=payload.email or "",
            is_staff=bool(payload.is_staff),
            is_active=payload.is_active is not False,
            teams=payload.teams or [],
            sso_username=payload.sso_username,
        )
    except (gateway_people.Conflict, gateway_people.Missing, gateway_people.PersonInvalid) as exc:
        raise _people_error(exc) from None
    return Status(201, user)


@router.patch("/users/{username}", response=UserOut)
def update_user(request: HttpRequest, username: str, payload: UserPatch) -> Any:
    # null keeps a field, as if it were not sent.
    changes = {k: v for k, v in payload.dict(exclude_unset=True).items() if v is not None}
    try:
        return gateway_people.update_user(username, actor=actor_of(request), **changes)
    except (gateway_people.Conflict, gateway_people.Missing, gateway_people.PersonInvalid) as exc:
        raise _people_error(exc) from None


@router.get("/teams", response=list[TeamOut], auth=reads("auth.view_group"))
@paginate(Page)
def list_teams(request: HttpRequest) -> Any:
    return Group.objects.prefetch_related("user_set").order_by("name")


@router.get("/teams/{name}", response=TeamOut, auth=reads("auth.view_group"))
def get_team(request: HttpRequest, name: str) -> Any:
    return get_object_or_404(Group.objects.prefetch_related("user_set"), name=name)


@router.post("/teams", response={201: TeamOut})
def create_team(request: HttpRequest, payload: TeamIn) -> Any:
    try:
        return Status(
            201,
            gateway_people.create_team(
                payload.name, actor=actor_of(request), members=payload.members
            ),
        )
    except (gateway_people.Conflict, gateway_people.Missing, gateway_people.PersonInvalid) as exc:
        raise _people_error(exc) from None


@router.put("/teams/{name}/members", response=TeamOut)
def set_team_members(request: HttpRequest, name: str, payload: MembersIn) -> Any:
    try:
        return gateway_people.set_team_members(name, payload.members, actor=actor_of(request))
    except (gateway_people.Conflict, gateway_people.Missing, gateway_people.PersonInvalid) as exc:
        raise _people_error(exc) from None


@router.delete("/teams/{name}", response={204: None})
def delete_team(request: HttpRequest, name: str) -> Any:
    if not gateway_people.delete_team(name, actor=actor_of(request)):
        raise AdminApiError(404, code="not_found", message=f"no team {name!r}", field="name")
    return Status(204, None)


class LimitsOut(Schema):
    """A user's or team's own limits (none set: every field empty), with the budget's spend in
    the current period. A key's effective limits are the narrowest of its own, its owner's and
    its owner's teams'."""

    allowed_models: list[str] = Field(description="Empty: every model.")
    rpm_limit: int | None
    tpm_limit: int | None
    token_budget: int | None
    budget_period: Literal["day", "week", "month"]
    spent: int = Field(description="Tokens used in the current budget period.")
    period_start: datetime


class UserLimitsOut(LimitsOut):
    self_service: bool = Field(description="May make their own keys at /account/.")


class LimitsPatch(Strict):
    """The limits to change; those left out keep their value, ``null`` means no limit."""

    allowed_models: list[str] | None = Field(None, description="Empty: every model.")
    rpm_limit: int | None = Field(None, ge=0, le=2**31 - 1)
    tpm_limit: int | None = Field(None, ge=0, le=2**31 - 1)
    token_budget: int | None = Field(None, ge=0, le=2**63 - 1)
    budget_period: Literal["day", "week", "month"] | None = None

    @field_validator("allowed_models", mode="after")
    @classmethod
    def _names(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and not all(name.strip() for name in value):
            raise ValueError("model names must not be empty")
        return value


class UserLimitsPatch(LimitsPatch):
    self_service: bool | None = None


def _limits_changes(payload: LimitsPatch) -> dict[str, Any]:
    changes = payload.dict(exclude_unset=True)
    for name in ("allowed_models", "budget_period", "self_service"):
        if name in changes and changes[name] is None:  # these have no "no limit"
            raise AdminApiError(422, code="invalid", message=f"{name} cannot be null", field=name)
    return changes


def _limits_out(
    row: UserLimits | TeamLimits | None, spent_by: Callable[[Any], int]
) -> dict[str, Any]:
    period = row.budget_period if row is not None else ApiKey.BudgetPeriod.MONTH
    return {
        "allowed_models": list(row.allowed_models or []) if row is not None else [],
        "rpm_limit": row.rpm_limit if row is not None else None,
        "tpm_limit": row.tpm_limit if row is not None else None,
        "token_budget": row.token_budget if row is not None else None,
        "budget_period": period,
        "spent": spent_by(row) if row is not None else 0,
        "period_start": allowances.period_start(period),
        "self_service": row.self_service if isinstance(row, UserLimits) else True,
    }


def _user_pk(username: str) -> int:
    pk = User.objects.filter(username=username).values_list("pk", flat=True).first()
    if pk is None:
        raise AdminApiError(
            404, code="not_found", message=f"no user {username!r}", field="username"
        )
    return int(pk)


def _team_pk(name: str) -> int:
    pk = Group.objects.filter(name=name).values_list("pk", flat=True).first()
    if pk is None:
        raise AdminApiError(404, code="not_found", message=f"no team {name!r}", field="name")
    return int(pk)


def _set_limits(
    request: HttpRequest, change: Callable[..., Any], holder: int, changes: dict[str, Any]
) -> Any:
    try:
        return change(holder, actor=actor_of(request), **changes)
    except gateway_people.LimitsInvalid as exc:
        raise AdminApiError(422, code="invalid", message=str(exc), field=exc.field) from None


@router.get(
    "/users/{username}/limits", response=UserLimitsOut, auth=reads("gateway.view_userlimits")
)
def get_user_limits(request: HttpRequest, username: str) -> Any:
    """The user's own limits over all their keys, and whether they may make keys."""
    row = UserLimits.objects.filter(user_id=_user_pk(username)).first()
    return _limits_out(row, allowances.user_spend)


@router.patch("/users/{username}/limits", response=UserLimitsOut)
def update_user_limits(request: HttpRequest, username: str, payload: UserLimitsPatch) -> Any:
    """Change the given limits; keys take the change up within the key cache's TTL."""
    changes = _limits_changes(payload)
    row = _set_limits(request, gateway_people.set_user_limits, _user_pk(username), changes)
    return _limits_out(row, allowances.user_spend)


@router.delete("/users/{username}/limits", response=Changed)
def clear_user_limits(request: HttpRequest, username: str) -> Any:
    """No limits of the user's own (their keys' and teams' still apply); self-service on."""
    return {
        "changed": gateway_people.clear_user_limits(_user_pk(username), actor=actor_of(request))
    }


@router.get("/teams/{name}/limits", response=LimitsOut, auth=reads("gateway.view_teamlimits"))
def get_team_limits(request: HttpRequest, name: str) -> Any:
    """The team's limits over all its members' keys."""
    row = TeamLimits.objects.filter(team_id=_team_pk(name)).first()
    return _limits_out(row, allowances.team_spend)


@router.patch("/teams/{name}/limits", response=LimitsOut)
def update_team_limits(request: HttpRequest, name: str, payload: LimitsPatch) -> Any:
    """Change the given limits; keys take the change up within the key cache's TTL."""
    row = _set_limits(
        request, gateway_people.set_team_limits, _team_pk(name), _limits_changes(payload)
    )
    return _limits_out(row, allowances.team_spend)


@router.delete("/teams/{name}/limits", response=Changed)
def clear_team_limits(request: HttpRequest, name: str) -> Any:
    return {"changed": gateway_people.clear_team_limits(_team_pk(name), actor=actor_of(request))}
