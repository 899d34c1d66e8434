"""The ids of the request being served, for every log line written while serving it.

The relay's entry calls :func:`begin_request` once it has minted the request id; the id, and
the trace id of the W3C ``traceparent`` header the client sent (if any), are kept in a context
variable, which every task and thread the request starts inherits (asyncio copies the context
into each task, ``sync_to_async`` into its thread). :class:`RequestIds`, a filter on the log
handler, puts them on each record as ``request_id`` and ``trace_id``, where the JSON format
(``agents.logs``) writes them; the plain format is unchanged.

Nothing resets the variable: each request is served in a task of its own, whose context ends
with it, and the lines its answer's stream writes after the entry returned must carry the ids.
"""

from __future__ import annotations

import logging
import re
from contextvars import ContextVar
from typing import NamedTuple

# version "-" trace-id "-" parent-id "-" flags; version ff is forbidden, an all-zero id invalid.
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")


class Ids(NamedTuple):
    request_id: str
    trace_id: str | None


current: ContextVar[Ids | None] = ContextVar("llmgw_request_ids", default=None)


def trace_id_of(traceparent: str | None) -> str | None:
    """The trace id of a ``traceparent`` header, or None if there is none or it is malformed
    (then the request starts no trace of the client's: W3C Trace Context, section 3.2)."""
    if not traceparent:
        return None
    match = _TRACEPARENT.fullmatch(traceparent.strip())
    if match is None:
        return None
    version, trace_id, parent_id, _, rest = match.groups()
    if version == "ff" or (version == "00" and rest) or set(trace_id) == {"0"}:
        return None
    if set(parent_id) == {"0"}:
        return None
    return trace_id


def begin_request(request_id: str, traceparent: str | None = None) -> None:
    """From here on, this request's lines carry its ids."""
    current.set(Ids(request_id, trace_id_of(traceparent)))


class RequestIds(logging.Filter):
    """Puts the current request's ids on each record (a record of no request gets none)."""

    def filter(self, record: logging.LogRecord) -> bool:
        ids = current.get()
        if ids is not None:
            record.request_id = ids.request_id
            if ids.trace_id is not None:
                record.trace_id = ids.trace_id
        return True
