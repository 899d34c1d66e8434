"""Usage's route: requests, errors and tokens summed per model, user, team, key or day, by the
gateway's reports (``gateway.ledger.reports``)."""

# No `from __future__ import annotations`: ninja reads the route signatures at import time.

from datetime import datetime
from typing import Any

from django.http import HttpRequest
from ninja import Field, Query, Router, Schema
from ninja.pagination import paginate

from gateway.ledger import reports
from llmgw_site.admin_api.auth import reads
from llmgw_site.admin_api.pagination import Page

router = Router(tags=["usage"])


class UsageQuery(Schema):
    by: reports.RawGroupBy = "model"
    model: str | None = None
    user: str | None = None
    team: str | None = None
    key: str | None = Field(None, description="A key's prefix, as lists show it.")
    since: datetime | None = None
    until: datetime | None = None


class UsageRow(Schema):
    group: str
    requests: int
    errors: int
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int = Field(description="Of the prompt tokens, those the engines found cached.")


@router.get("/usage", response=list[UsageRow], auth=reads("gateway.view_usagerecord"))
@paginate(Page)
def usage(request: HttpRequest, query: Query[UsageQuery]) -> Any:
    """Requests, errors and tokens per group over the period, largest token use first (days:
    oldest first). By team, a user in two teams counts in both."""
    rows = reports.usage(
        reports.UsageFilter(
            since=query.since,
            until=query.until,
            username=query.user,
            key_prefix=query.key,
            model=query.model,
        )
    )
    if query.team:
        rows = rows.filter(user__groups__name=query.team)
    return [r.as_dict() for r in reports.summarize(rows, query.by)]
