"""How every llmgw process writes its log lines: as it always did (``plain``), or with
``LLMGW_LOG_FORMAT=json`` one JSON object a line, for a log collector to index without a parser
of its own.

A JSON line has ``time`` (UTC, ISO 8601, milliseconds), ``level``, ``logger``, ``message``,
``pid`` and the fields its process adds to all of its lines (``process``: ``web``, ``worker``,
``beat``, ``agent``, a ``manage.py`` command's name; the agent's ``node``); a line written while
serving a request adds its ``request_id`` and, when the client sent a W3C ``traceparent``, its
``trace_id`` (``telemetry.logs`` puts them on the record); a traceback is ``exc``, in the same
line. Nothing else of the record is written: an ``extra`` a caller passed never leaks a value
into the line.

Defined here, in the node program's package, because the agent runs without Django and
without the rest of llmgw (it installs alone) while every other process may import it: the
line has one definition.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import TextIO

FORMATS = ("plain", "json")
# What a record may carry beyond the standard fields, written when present.
CONTEXT_FIELDS = ("request_id", "trace_id")


class JsonFormatter(logging.Formatter):
    """One JSON object a line; ``fields`` are added to every line of this process."""

    def __init__(self, fields: Mapping[str, str] | None = None) -> None:
        super().__init__()
        self.fields = dict(fields or {})

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC)
            .isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,
            **self.fields,
        }
        for name in CONTEXT_FIELDS:
            value = record.__dict__.get(name)
            if value is not None:
                line[name] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exc"] = record.exc_text
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def formatter(log_format: str, plain: str, fields: Mapping[str, str]) -> logging.Formatter:
    """The formatter of ``log_format`` (one of :data:`FORMATS`); ``plain`` is the plain one's
    format string."""
    if log_format not in FORMATS:
        raise ValueError(f"the log format must be one of {', '.join(FORMATS)}, not {log_format!r}")
    return JsonFormatter(fields) if log_format == "json" else logging.Formatter(plain)


def configure(
    log_format: str,
    level: int | str,
    *,
    plain: str = logging.BASIC_FORMAT,
    fields: Mapping[str, str] | None = None,
    stream: TextIO | None = None,
) -> None:
    """The root logger writes to ``stream`` (standard error) in ``log_format``: for a process
    without Django's ``LOGGING`` (the agent; a web process until its application loads)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(formatter(log_format, plain, fields or {}))
    logging.basicConfig(level=level, handlers=[handler])
