"""The gateway in the Django admin: API keys, users and teams with their limits, static
endpoints, usage.

Users and teams are Django's users and groups on Django's own pages, but every save and delete there
goes through ``gateway.identity.people`` (the function the admin API and the ``manage.py`` commands
call too), so each change is one transaction with an operator Event naming who did it.

A key is made by ``gateway.identity.keys.issue`` (the only place keys are minted) and shown once, on
the page that answers the form: it is never put in a message, the session or a cookie, so
the only copy outside the owner's hands is its SHA-256. Afterwards the admin shows its prefix.
"""

from __future__ import annotations

from datetime import UTC, date, datetime, time, timedelta
from typing import Any
from weakref import WeakKeyDictionary

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.widgets import FilteredSelectMultiple
from django.contrib.auth.admin import GroupAdmin, UserAdmin
from django.contrib.auth.models import Group, User
from django.core.exceptions import PermissionDenied
from django.db import models
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from django.template.response import TemplateResponse
from django.urls import URLPattern, path
from django.utils import timezone

from control import serving
from gateway.identity import allowances, keys, people
from gateway.ledger import reports
from gateway.models import ApiKey, Endpoint, TeamLimits, UsageRecord, UserLimits

# The full key between save_model (which mints it) and response_add (which shows it), held
# for the one request only.
_issued: WeakKeyDictionary[HttpRequest, str] = WeakKeyDictionary()


class ApiKeyForm(forms.ModelForm[ApiKey]):
    class Meta:
        model = ApiKey
        fields = [
            "user",
            "name",
            "allowed_models",
            "rpm_limit",
            "tpm_limit",
            "token_budget",
            "budget_period",
            "expires_at",
        ]

    def clean_allowed_models(self) -> list[str]:
        names = self.cleaned_data.get("allowed_models") or []
        if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
            raise forms.ValidationError('A list of model names, e.g. ["llama3"]; empty: all.')
        return sorted(set(names))


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin[ApiKey]):
    form = ApiKeyForm
    list_display = [
        "prefix",
        "name",
        "user",
        "allowed",
        "spend",
        "created_at",
        "last_used_at",
        "expires_at",
        "revoked_at",
    ]
    list_filter = ["revoked_at", "created_at"]
    list_select_related = ["user"]
    search_fields = ["prefix", "name", "user__username"]
    autocomplete_fields = ["user"]
    actions = ["revoke"]
    fields = [
        "user",
        "name",
        "prefix",
        "allowed_models",
        "rpm_limit",
        "tpm_limit",
        "token_budget",
        "budget_period",
        "expires_at",
        "created_at",
        "last_used_at",
        "revoked_at",
    ]

    def get_readonly_fields(self, request: HttpRequest, obj: ApiKey | None = None) -> list[str]:
        observed = ["prefix", "created_at", "last_used_at", "revoked_at"]
        # A key belongs to one user for life: moving it would hand its usage to someone else.
        return [*observed, "user"] if obj is not None else observed

    @admin.display(description="models")
    def allowed(self, obj: ApiKey) -> str:
        return ", ".join(obj.allowed_models) or "all"

    @admin.display(description="spent in period")
    def spend(self, obj: ApiKey) -> str:
        view = allowances.key_view(obj)
        return _spend(view.spent, obj.token_budget, obj.budget_period)

    def save_model(self, request: HttpRequest, obj: ApiKey, form: Any, change: bool) -> None:
        if change:
            super().save_model(request, obj, form, change)
            return
        issued = keys.issue(
            obj.user.get_username(),
            name=obj.name,
            models=list(obj.allowed_models),
            expires_at=obj.expires_at,
            rpm=obj.rpm_limit,
            tpm=obj.tpm_limit,
            budget=obj.token_budget,
            budget_period=obj.budget_period,
        )
        # The admin goes on with `obj` (history entry, redirect), so it becomes the stored row.
        obj.pk = issued.api_key.pk
        obj.prefix = issued.api_key.prefix
        obj.key_hash = issued.api_key.key_hash
        obj.created_at = issued.api_key.created_at
        obj._state.adding = False
        obj._state.db = issued.api_key._state.db
        _issued[request] = issued.key

    def response_add(
        self, request: HttpRequest, obj: ApiKey, post_url_continue: str | None = None
    ) -> HttpResponse:
        key = _issued.pop(request, None)
        if key is None:  # not minted here (cannot happen through the add form)
            return super().response_add(request, obj, post_url_continue)
        response = TemplateResponse(
            request,
            "admin/gateway/apikey/created.html",
            {
                **self.admin_site.each_context(request),
                "title": "API key created",
                "api_key": obj,
                "key": key,
                "opts": self.opts,
            },
        )
        # Nothing between here and the browser may keep the page.
        response["Cache-Control"] = "no-store"
        return response

    @admin.action(description="Revoke the selected keys", permissions=["change"])
    def revoke(self, request: HttpRequest, queryset: QuerySet[ApiKey]) -> None:
        done = [key.prefix for key in queryset if keys.revoke(key.pk)]
        if done:
            self.message_user(request, f"Revoked: {', '.join(done)}.", messages.SUCCESS)
        else:
            self.message_user(request, "Those keys were revoked already.", messages.INFO)


def _spend(used: int, budget: int | None, period: str) -> str:
    if budget is None:
        return f"{used} (no budget)"
    return f"{used} of {budget} per {period} ({100 * used // max(1, budget)}%)"


class LimitsForm(forms.ModelForm[Any]):
    def clean_allowed_models(self) -> list[str]:
        names = self.cleaned_data.get("allowed_models") or []
        if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
            raise forms.ValidationError('A list of model names, e.g. ["llama3"]; empty: all.')
        return sorted(set(names))


def _actor(request: HttpRequest) -> str:
    """Who did it, for the audit trail (as the fleet's admin actions say it)."""
    return f"admin:{request.user.get_username()}"


_LIMIT_FIELDS = ["allowed_models", "rpm_limit", "tpm_limit", "token_budget", "budget_period"]


@admin.register(UserLimits)
class UserLimitsAdmin(admin.ModelAdmin[UserLimits]):
    """A person's limits over all their keys (the keys they make themselves included), and
    whether they may make keys at /account/. Keys pick a change up within the key cache's
    TTL."""

    form = LimitsForm
    list_display = ["user", "models", "rpm_limit", "tpm_limit", "spend", "self_service"]
    list_select_related = ["user"]
    search_fields = ["user__username"]
    autocomplete_fields = ["user"]
    fields = ["user", *_LIMIT_FIELDS, "self_service"]

    def get_readonly_fields(self, request: HttpRequest, obj: UserLimits | None = None) -> Any:
        # A row's holder is fixed: moving limits to someone else is a clear and a set.
        return ["user"] if obj is not None else []

    def save_model(self, request: HttpRequest, obj: UserLimits, form: Any, change: bool) -> None:
        # Through the one function for this change, which the admin API calls too.
        saved = people.set_user_limits(
            obj.user_id,
            actor=_actor(request),
            **{f: getattr(obj, f) for f in (*_LIMIT_FIELDS, "self_service")},
        )
        obj.pk = saved.pk

    def delete_model(self, request: HttpRequest, obj: UserLimits) -> None:
        people.clear_user_limits(obj.user_id, actor=_actor(request))

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[UserLimits]) -> None:
        for user_id in queryset.values_list("user_id", flat=True):
            people.clear_user_limits(user_id, actor=_actor(request))

    @admin.display(description="models")
    def models(self, obj: UserLimits) -> str:
        return ", ".join(obj.allowed_models) or "all"

    @admin.display(description="spent in period")
    def spend(self, obj: UserLimits) -> str:
        return _spend(allowances.user_spend(obj), obj.token_budget, obj.budget_period)


@admin.register(TeamLimits)
class TeamLimitsAdmin(admin.ModelAdmin[TeamLimits]):
    """A team's (a group's) limits over all its members' keys."""

    form = LimitsForm
    list_display = ["team", "models", "rpm_limit", "tpm_limit", "spend"]
    list_select_related = ["team"]
    search_fields = ["team__name"]
    autocomplete_fields = ["team"]
    fields = ["team", *_LIMIT_FIELDS]

    def get_readonly_fields(self, request: HttpRequest, obj: TeamLimits | None = None) -> Any:
        return ["team"] if obj is not None else []

    def save_model(self, request: HttpRequest, obj: TeamLimits, form: Any, change: bool) -> None:
        saved = people.set_team_limits(
            obj.team_id, actor=_actor(request), **{f: getattr(obj, f) for f in _LIMIT_FIELDS}
        )
        obj.pk = saved.pk

    def delete_model(self, request: HttpRequest, obj: TeamLimits) -> None:
        people.clear_team_limits(obj.team_id, actor=_actor(request))

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[TeamLimits]) -> None:
        for team_id in queryset.values_list("team_id", flat=True):
            people.clear_team_limits(team_id, actor=_actor(request))

    @admin.display(description="models")
    def models(self, obj: TeamLimits) -> str:
        return ", ".join(obj.allowed_models) or "all"

    @admin.display(description="spent in period")
    def spend(self, obj: TeamLimits) -> str:
        return _spend(allowances.team_spend(obj), obj.token_budget, obj.budget_period)


# --------------------------------------------------------------------------- users and teams

admin.site.unregister(User)
admin.site.unregister(Group)


def _save_formsets(
    admin_: admin.ModelAdmin[Any], request: HttpRequest, form: Any, formsets: Any, change: bool
) -> None:
    # The m2m fields (teams, members, permissions) were set by the people function inside
    # save_model; form.save_m2m() would write them a second time, past the audit trail.
    for formset in formsets:
        admin_.save_formset(request, form, formset, change=change)


@admin.register(User)
class PersonAdmin(UserAdmin[User]):
    """Django's user pages; a save is ``people.create_user`` or ``people.update_user``.

    The add page also takes the email, staff flag and teams (one Event for the new user, not
    one per page). The username is fixed once made: it names the user in the audit trail, in
    single sign-on and in ``manage.py`` commands. Sign-in times are observed, so read-only.
    A password is set on its own page (Django's), as before."""

    add_fieldsets = (
        (
            None,
            {
                "classes": ("wide",),
                "fields": ("username", "usable_password", "password1", "password2"),
            },
        ),
        ("Details", {"fields": ("email", "is_staff", "groups")}),
    )

    def get_readonly_fields(self, request: HttpRequest, obj: User | None = None) -> Any:
        return ["username", "last_login", "date_joined"] if obj is not None else []

    def save_model(self, request: HttpRequest, obj: User, form: Any, change: bool) -> None:
        data = form.cleaned_data
        teams = [g.name for g in data["groups"]] if "groups" in data else None
        perms = (
            people.permission_names(data["user_permissions"])
            if "user_permissions" in data
            else None
        )
        if change:
            people.update_user(
                obj.username,
                actor=_actor(request),
                teams=teams,
                permissions=perms,
                **{f: getattr(obj, f) for f in people.USER_FIELDS if f in data},
            )
            return
        saved = people.create_user(
            obj.username,
            actor=_actor(request),
            **{f: getattr(obj, f) for f in people.USER_FIELDS if f in data},
            teams=teams or (),
            permissions=perms or (),
            password=data.get("password1") if data.get("set_usable_password") else None,
        )
        # The admin goes on with `obj` (history entry, redirect to the change page).
        obj.pk = saved.pk
        obj.password = saved.password
        obj._state.adding = False

    def save_related(self, request: HttpRequest, form: Any, formsets: Any, change: bool) -> None:
        _save_formsets(self, request, form, formsets, change)


class TeamForm(forms.ModelForm[Group]):
    """A group's page with its members, so a team is made and staffed on one page."""

    members = forms.ModelMultipleChoiceField(
        queryset=User.objects.order_by("username"),
        required=False,
        widget=FilteredSelectMultiple("members", is_stacked=False),
    )

    class Meta:
        model = Group
        fields = ["name", "members", "permissions"]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.instance.pk is not None:
            self.fields["members"].initial = self.instance.user_set.all()


@admin.register(Group)
class TeamAdmin(GroupAdmin):
    """Django's group pages (a group is a team: limits, usage, single sign-on's group claims),
    with members; a save or delete is the ``people`` function for it. The name is fixed once
    made: it names the team in the audit trail and in the provider's group claims."""

    form = TeamForm
    list_display = ["name", "member_count"]

    def get_readonly_fields(self, request: HttpRequest, obj: Group | None = None) -> Any:
        return ["name"] if obj is not None else []

    def get_queryset(self, request: HttpRequest) -> QuerySet[Group]:
        return super().get_queryset(request).annotate(members_n=models.Count("user"))

    @admin.display(description="members", ordering="members_n")
    def member_count(self, obj: Group) -> int:
        return int(getattr(obj, "members_n", 0))

    def save_model(self, request: HttpRequest, obj: Group, form: Any, change: bool) -> None:
        data = form.cleaned_data
        members = [u.username for u in data.get("members", [])]
        perms = people.permission_names(data["permissions"]) if "permissions" in data else None
        if change:
            people.set_team_members(obj.name, members, actor=_actor(request))
            if perms is not None:
                people.set_team_permissions(obj.name, perms, actor=_actor(request))
            return
        saved = people.create_team(
            obj.name, actor=_actor(request), members=members, permissions=perms or ()
        )
        obj.pk = saved.pk
        obj._state.adding = False

    def save_related(self, request: HttpRequest, form: Any, formsets: Any, change: bool) -> None:
        _save_formsets(self, request, form, formsets, change)

    def delete_model(self, request: HttpRequest, obj: Group) -> None:
        people.delete_team(obj.name, actor=_actor(request))

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Group]) -> None:
        for name in queryset.values_list("name", flat=True):
            people.delete_team(name, actor=_actor(request))


@admin.register(Endpoint)
class EndpointAdmin(admin.ModelAdmin[Endpoint]):
    """Static upstreams. ``Endpoint.clean`` refuses link-local, metadata and non-http(s) URLs
    unless ``allow_private_address`` is ticked, here and everywhere else a row is saved."""

    list_display = ["slug", "url", "model_names", "weight", "enabled", "allow_private_address"]
    list_filter = ["enabled"]
    # Engines on private networks mostly speak plain http; say so rather than guess.
    formfield_overrides = {models.URLField: {"assume_scheme": "http"}}
    search_fields = ["slug", "url"]


# Usage filters offer their choices without scanning the usage table (which grows by a row per
# request): keys, catalog models and recent days come from small tables or the calendar.


class KeyFilter(admin.SimpleListFilter):
    title = "API key"
    parameter_name = "api_key__id__exact"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        rows = ApiKey.objects.order_by("user__username", "prefix").values_list(
            "pk", "prefix", "user__username"
        )
        return [(str(pk), f"{prefix}… ({username})") for pk, prefix, username in rows]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        return queryset.filter(api_key_id=value) if value and value.isdigit() else queryset


class ModelFilter(admin.SimpleListFilter):
    title = "model"
    parameter_name = "model"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        names = serving.catalog_names()
        # A model no longer in the catalog still filters when named in the URL.
        chosen = self.value()
        if chosen and chosen not in names:
            names.append(chosen)
        return [(name, name) for name in names]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        return queryset.filter(model=value) if value else queryset


class StatusFilter(admin.SimpleListFilter):
    title = "status"
    parameter_name = "status_class"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("2", "2xx"), ("4", "4xx"), ("5", "5xx")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if value not in ("2", "4", "5"):
            return queryset
        low = int(value) * 100
        return queryset.filter(status__gte=low, status__lt=low + 100)


class DayFilter(admin.SimpleListFilter):
    """A day (UTC) of the last two weeks; older days through the CSV export or the report."""

    title = "day"
    parameter_name = "day"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        today = timezone.now().date()
        days = [today - timedelta(days=n) for n in range(14)]
        return [(d.isoformat(), "today" if d == today else d.isoformat()) for d in days]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        try:
            day = date.fromisoformat(self.value() or "")
        except ValueError:
            return queryset
        start = datetime.combine(day, time.min, tzinfo=UTC)
        return queryset.filter(started_at__gte=start, started_at__lt=start + timedelta(days=1))


@admin.register(UsageRecord)
class UsageRecordAdmin(admin.ModelAdmin[UsageRecord]):
    """One row per request, read-only. The changelist's filters also filter the CSV export."""

    list_display = [
        "started_at",
        "model",
        "user",
        "key",
        "status",
        "stream",
        "prompt_tokens",
        "completion_tokens",
        "ttft_ms",
        "duration_ms",
        "finish_reason",
    ]
    list_filter = [
        DayFilter,
        ModelFilter,
        KeyFilter,
        "user",
        StatusFilter,
        "finish_reason",
        "stream",
    ]
    list_select_related = ["api_key", "user"]
    search_fields = ["request_id", "model", "api_key__prefix"]
    # Counting every row on each page view is the slowest query on a large table.
    show_full_result_count = False

    @admin.display(description="key", ordering="api_key__prefix")
    def key(self, obj: UsageRecord) -> str:
        return f"{obj.api_key.prefix}…" if obj.api_key else "—"

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: UsageRecord | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: UsageRecord | None = None) -> bool:
        return False

    def get_urls(self) -> list[URLPattern]:
        export = path(
            "export.csv",
            self.admin_site.admin_view(self.export_csv),
            name="gateway_usagerecord_export",
        )
        return [export, *super().get_urls()]

    def export_csv(self, request: HttpRequest) -> StreamingHttpResponse:
        """The rows the changelist shows for the same query string, as CSV, streamed."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        rows = self.get_changelist_instance(request).get_queryset(request)
        response = StreamingHttpResponse(reports.csv_lines(rows), content_type="text/csv")
        response["Content-Disposition"] = 'attachment; filename="llmgw-usage.csv"'
        return response
