"""The embedded default's Celery broker: kombu's filesystem transport, with atomic writes.

kombu's filesystem transport writes a message straight into its final file name, while the
reader lists the folder, moves the first file whose name matches the queue and reads it
without taking the writer's lock. Under load the reader can therefore take a file the writer
has created but not finished, and the worker dies on ``JSONDecodeError`` (a known, open kombu
problem). Here every message is written and flushed to a hidden temporary name that no queue
matches, then renamed into place: ``rename`` within one folder is atomic, so a reader sees
either no file or the whole message, never part of one.

Used as the ``llmgwfs://`` broker URL (registered as a kombu transport alias by
``llmgw_site.celery``); with ``REDIS_URL`` set Redis is the broker instead.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils import json as kombu_json

ALIAS = "llmgwfs"


def message_name(queue: str, now_ms: int) -> str:
    """The final name kombu's reader looks for: ``<order>_<id>.<queue>.msg``, where the part
    after the first dot must be exactly ``<queue>.msg``."""
    return f"{now_ms}_{uuid.uuid4()}.{queue}.msg"


def write_atomically(folder: str, name: str, data: bytes) -> None:
    """Write ``data`` under ``folder/name`` so that no reader ever sees part of it.

    The temporary name starts with a dot and has no ``.msg`` suffix, so neither the reader
    (which matches ``<x>.<queue>.msg``) nor the size and purge scans ever count it.
    """
    temporary = os.path.join(folder, f".{uuid.uuid4().hex}.partial")
    try:
        # Owner-only from the first byte: a task's arguments are no other local user's to read.
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, os.path.join(folder, name))
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise ChannelError(f"cannot add a message to {folder!r}: {exc}") from exc


class Channel(filesystem.Channel):
    # The signature of kombu's filesystem Channel, which already names AbstractChannel's
    # ``message`` ``payload``; no signature satisfies both.
    def _put(self, queue: Any, payload: Any, **kwargs: Any) -> None:  # type: ignore[override]
        """Put ``payload`` onto ``queue``, whole or not at all."""
        name = message_name(str(queue), round(time.monotonic() * 1000))
        # kombu's own encoder, the one its reader's decoder pairs with (dates, UUIDs...).
        data = str(kombu_json.dumps(payload)).encode()  # type: ignore[no-untyped-call]
        write_atomically(self.data_folder_out, name, data)


class Transport(filesystem.Transport):
    Channel = Channel
    # Shares the state of kombu's own filesystem transport: it is the same folder format.
    driver_name = "filesystem-atomic"
