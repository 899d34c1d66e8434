"""``manage.py usage_report [--since 7d] [--by model|user|key|day] [--format table|csv|json]``"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from gateway.identity import keys
from gateway.ledger import reports


class Command(BaseCommand):
    help = "Requests, errors and tokens per model, user, key or day, over a time range."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--since",
            default="30d",
            help="Start: a date (2026-01-01), a timestamp, or a duration back from now "
            "(30d, 12h, 90m). Default: %(default)s.",
        )
        parser.add_argument("--until", help="End (exclusive), same forms. Default: now.")
        parser.add_argument("--user", help="Only this user's requests.")
        parser.add_argument("--key", help="Only this key's requests (its prefix).")
        parser.add_argument("--model", help="Only this model's requests.")
        parser.add_argument("--by", choices=reports.GROUPS, default="model")
        parser.add_argument("--format", choices=("table", "csv", "json"), default="table")

    def handle(self, *args: Any, **options: Any) -> None:
        since = _moment(options["since"], "--since")
        until = _moment(options["until"], "--until") if options["until"] else None
        if until is not None and until <= since:
            raise CommandError("--until must be after --since")
        rows = reports.summary_rows(
            reports.UsageFilter(
                since=since,
                until=until,
                username=options["user"],
                key_prefix=options["key"].rstrip("…") if options["key"] else None,
                model=options["model"],
            ),
            options["by"],
        )
        out = options["format"]
        if out == "json":
            self.stdout.write(json.dumps([row.as_dict() for row in rows], indent=2))
        elif out == "csv":
            reports.write_summary_csv(rows, self.stdout)
        else:
            self._table(rows, options["by"], since, until)

    def _table(
        self,
        rows: list[reports.SummaryRow],
        by: str,
        since: datetime,
        until: datetime | None,
    ) -> None:
        end = until.isoformat(timespec="seconds") if until else "now"
        self.stdout.write(f"usage {since.isoformat(timespec='seconds')} .. {end}, by {by}")
        if not rows:
            self.stdout.write("no requests in this range")
            return
        header = (by.upper(), "REQUESTS", "ERRORS", "PROMPT", "COMPLETION", "TOTAL")
        lines = [header] + [
            (
                row.group,
                str(row.requests),
                str(row.errors),
                str(row.prompt_tokens),
                str(row.completion_tokens),
                str(row.total_tokens),
            )
            for row in rows
        ]
        widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
        for line in lines:
            cells = [line[0].ljust(widths[0])] + [
                cell.rjust(width) for cell, width in zip(line[1:], widths[1:], strict=True)
            ]
            self.stdout.write("  ".join(cells))


def _moment(text: str, flag: str) -> datetime:
    try:
        if text[-1:] in "dhm" and text[:-1].isdigit():
            # parse_expiry counts forward; a report's range counts back from now.
            now = timezone.now()
            return now - (keys.parse_expiry(text, now=now) - now)
        return keys.parse_expiry(text)
    except (ValueError, IndexError):
        raise CommandError(
            f"{flag} {text!r} is not a date (2026-01-01), a timestamp or a duration (30d)"
        ) from None
