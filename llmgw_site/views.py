"""The two pages that show both halves of llmgw at once: the admin dashboard's data and
``/metrics``. Each app computes its own half; these views only put the halves together, so
neither app has to import the other.

``/metrics`` is not public: it answers only a request carrying ``Authorization: Bearer
$LLMGW_METRICS_TOKEN``, and is off (404) while that variable is unset.
"""

from __future__ import annotations

import hmac
from datetime import datetime
from typing import Any

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils import timezone

from control import dashboard
from control.gauges import FleetCollector
from gateway.ledger import traffic
from telemetry import metrics

# --------------------------------------------------------------------------- the dashboard


def dashboard_snapshot(now: datetime | None = None) -> dict[str, Any]:
    """Everything the dashboard shows, at one moment: the fleet and the traffic."""
    now = now or timezone.now()
    return {**dashboard.snapshot(now), "traffic": traffic.traffic(now)}


def dashboard_data(request: HttpRequest) -> JsonResponse:
    """The dashboard's JSON. Staff only: 401 without a session, 403 for non-staff users.

    Answers with a status (not a redirect to the login page) because a script reads it: the
    page shows "signed out" instead of trying to parse a login form.
    """
    user = request.user
    if not user.is_authenticated:
        return JsonResponse({"error": "not signed in"}, status=401)
    if not (user.is_active and user.is_staff):
        return JsonResponse({"error": "staff only"}, status=403)
    response = JsonResponse(dashboard_snapshot())
    response["Cache-Control"] = "no-store"
    return response


# --------------------------------------------------------------------------- /metrics


def scrape(accept: str = "") -> tuple[bytes, str]:
    """The exposition: every web process's counters summed, plus the fleet from the store."""
    return metrics.exposition(accept, [FleetCollector()])


def _authorized(request: HttpRequest, token: str) -> bool:
    header = request.headers.get("Authorization", "")
    scheme, _, presented = header.partition(" ")
    if scheme.lower() != "bearer" or not presented:
        return False
    # Constant time, so the response time says nothing about how much of a guess was right.
    return hmac.compare_digest(presented.strip().encode(), token.encode())


def metrics_view(request: HttpRequest) -> HttpResponse:
    """``GET /metrics`` for Prometheus, with ``Authorization: Bearer $LLMGW_METRICS_TOKEN``."""
    token = str(settings.LLMGW_METRICS_TOKEN)
    if not token:
        return JsonResponse(
            {"error": "metrics are off; set LLMGW_METRICS_TOKEN to turn them on"}, status=404
        )
    if not _authorized(request, token):
        response = JsonResponse({"error": "a valid bearer token is required"}, status=401)
        response["WWW-Authenticate"] = 'Bearer realm="llmgw metrics"'
        return response
    body, content_type = scrape(request.headers.get("Accept", ""))
    return HttpResponse(body, content_type=content_type)
