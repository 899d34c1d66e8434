"""``/account/``: self-service for the people who hold keys (staff or not).

Each view reads and changes only the signed-in user's own rows: every query is filtered by
``user=request.user`` and a key id that is not theirs is answered 404, the same as one that
does not exist, so ids of other people's keys cannot even be probed. A new key is shown once,
in the response to the form that made it, and stored nowhere but as a hash.

``/account/link/<token>/`` is where a one-time sign-in link leads
(``gateway.identity.signin_links``).
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

from axes.helpers import get_client_ip_address
from django import forms
from django.conf import settings
from django.contrib import messages
from django.contrib.auth import login
from django.contrib.auth import views as auth_views
from django.contrib.auth.decorators import login_required
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect, StreamingHttpResponse
from django.shortcuts import get_object_or_404, render
from django.urls import path, reverse
from django.utils import timezone
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from gateway.identity import allowances, keys, signin_links
from gateway.ledger import reports, rollups
from gateway.models import ApiKey, UsageRecord

LOGIN_URL = "/account/login/"
# A person needs a handful of keys (laptop, CI, a service); a cap keeps a script from minting
# thousands. Revoked keys do not count.
MAX_ACTIVE_KEYS = 20
CHART_DAYS = 30
RECENT_ROWS = 25


class NewKeyForm(forms.Form):
    name = forms.CharField(max_length=100, required=False, help_text="What it is for.")
    expires_in_days = forms.IntegerField(
        min_value=1, max_value=3650, required=False, help_text="Empty: never."
    )
    # A key's own limits can only narrow its owner's (which it inherits in any case).
    models = forms.CharField(
        max_length=2000, required=False, help_text="Comma-separated; empty: all you may use."
    )
    rpm_limit = forms.IntegerField(min_value=1, required=False)
    tpm_limit = forms.IntegerField(min_value=1, required=False)
    token_budget = forms.IntegerField(min_value=1, required=False)
    budget_period = forms.ChoiceField(
        choices=ApiKey.BudgetPeriod.choices, required=False, initial=ApiKey.BudgetPeriod.MONTH
    )

    def clean_models(self) -> list[str]:
        raw = self.cleaned_data.get("models") or ""
        return sorted({name.strip() for name in raw.split(",") if name.strip()})


def _user_id(request: HttpRequest) -> int:
    user_id = request.user.pk
    assert isinstance(user_id, int), "login_required lets only signed-in users through"
    return user_id


def _own_keys(request: HttpRequest) -> QuerySet[ApiKey]:
    return ApiKey.objects.filter(user_id=_user_id(request))


@require_GET
@login_required(login_url=LOGIN_URL)
def overview(request: HttpRequest) -> HttpResponse:
    """Keys, and usage as a chart (per day) and a table (latest requests)."""
    own = reports.UsageFilter(user_id=_user_id(request))
    own_usage = reports.usage(own)
    days = reports.daily_rows(own, CHART_DAYS)
    chart = {
        "labels": [d.group[5:] for d in days],  # MM-DD
        "tokens": [d.total_tokens for d in days],
        "requests": [d.requests for d in days],
    }
    context = {
        "limits": allowances.views_for_user(request.user),  # type: ignore[arg-type]
        "self_service": allowances.self_service_allowed(_user_id(request)),
        "keys": _own_keys(request).order_by("revoked_at", "-created_at"),
        "form": NewKeyForm(),
        "recent": own_usage.select_related("api_key").order_by("-started_at")[:RECENT_ROWS],
        "by_model": reports.summary_rows(
            replace(own, since=rollups.hour_of(timezone.now() - timedelta(days=CHART_DAYS))),
            "model",
        ),
        "chart": chart,
        "chart_days": CHART_DAYS,
        "max_keys": MAX_ACTIVE_KEYS,
        "periods": ApiKey.BudgetPeriod.choices,
    }
    return render(request, "account/overview.html", context)


@require_POST
@login_required(login_url=LOGIN_URL)
def create_key(request: HttpRequest) -> HttpResponse:
    form = NewKeyForm(request.POST)
    if not form.is_valid():
        messages.error(request, "The key was not created: " + form.errors.as_text())
        return HttpResponseRedirect(reverse("account"))
    if not allowances.self_service_allowed(_user_id(request)):
        messages.error(request, "An administrator has turned off making keys for your account.")
        return HttpResponseRedirect(reverse("account"))
    if _own_keys(request).filter(revoked_at__isnull=True).count() >= MAX_ACTIVE_KEYS:
        messages.error(request, f"You have {MAX_ACTIVE_KEYS} active keys; revoke one first.")
        return HttpResponseRedirect(reverse("account"))
    data = form.cleaned_data
    problems = allowances.narrowing_problems(
        allowances.views_for_user(request.user),  # type: ignore[arg-type]
        models=data["models"],
        rpm=data.get("rpm_limit"),
        tpm=data.get("tpm_limit"),
        budget=data.get("token_budget"),
    )
    if problems:
        messages.error(request, "The key was not created: " + "; ".join(problems) + ".")
        return HttpResponseRedirect(reverse("account"))
    days = data.get("expires_in_days")
    issued = keys.issue(
        request.user.get_username(),
        name=data.get("name") or "",
        models=data["models"],
        rpm=data.get("rpm_limit"),
        tpm=data.get("tpm_limit"),
        budget=data.get("token_budget"),
        budget_period=data.get("budget_period") or ApiKey.BudgetPeriod.MONTH,
        expires_at=timezone.now() + timedelta(days=days) if days else None,
    )
    response = render(
        request, "account/key_created.html", {"api_key": issued.api_key, "key": issued.key}
    )
    # The page carries the only copy of the key: no cache may keep it.
    response["Cache-Control"] = "no-store"
    return response


@require_POST
@login_required(login_url=LOGIN_URL)
def revoke_key(request: HttpRequest, key_id: int) -> HttpResponse:
    api_key = get_object_or_404(_own_keys(request), pk=key_id)
    if keys.revoke(api_key.pk):
        messages.success(request, f"Key {api_key.prefix}… revoked.")
    return HttpResponseRedirect(reverse("account"))


@require_GET
@login_required(login_url=LOGIN_URL)
def usage_csv(request: HttpRequest) -> StreamingHttpResponse:
    rows = UsageRecord.objects.filter(user_id=_user_id(request))
    response = StreamingHttpResponse(reports.csv_lines(rows), content_type="text/csv")
    response["Content-Disposition"] = 'attachment; filename="my-llmgw-usage.csv"'
    return response


class LoginView(auth_views.LoginView):
    template_name = "account/login.html"
    redirect_authenticated_user = True

    def get_default_redirect_url(self) -> str:
        return reverse("account")


@require_http_methods(["GET", "POST"])
def signin_link(request: HttpRequest, token: str) -> HttpResponse:
    """A one-time sign-in link: GET shows whom it signs in and a button, the button's POST
    uses it up and signs in. A used, expired or unknown link answers 410, all alike."""
    if request.method == "POST":
        user = signin_links.redeem(token, address=get_client_ip_address(request) or "")
        if user is not None:
            login(request, user, backend="gateway.identity.signin_links.LinkBackend")
            return HttpResponseRedirect(settings.LOGIN_REDIRECT_URL)
    else:
        user = signin_links.peek(token)
    context = {"who": user.get_username() if user is not None else None}
    response = render(request, "account/signin_link.html", context, status=200 if user else 410)
    # The token is in the address: no cache keeps the page, no other site learns it.
    response["Cache-Control"] = "no-store"
    response["Referrer-Policy"] = "no-referrer"
    return response


urlpatterns = [
    path("", overview, name="account"),
    path("keys/", create_key, name="account-create-key"),
    path("keys/<int:key_id>/revoke/", revoke_key, name="account-revoke-key"),
    path("usage.csv", usage_csv, name="account-usage-csv"),
    path("login/", LoginView.as_view(), name="account-login"),
    path("link/<str:token>/", signin_link, name="account-signin-link"),
    path("logout/", auth_views.LogoutView.as_view(next_page=LOGIN_URL), name="account-logout"),
]
