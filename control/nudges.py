"""Nudges: telling a node's agent streams, through the channel layer, that something changed.

A nudge carries no state. Desired state is always read from the database, so a nudge lost on
the way (channel layer down, a process without Redis) only delays a change until the stream's
periodic resync. Nudges go out after commit, so a stream never re-reads before the change is
visible.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any, Final

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import transaction
from django.db.models import F

from control.models import Node

logger = logging.getLogger(__name__)

# Channel-layer message types the agent consumer handles (dots become underscores).
DESIRED_CHANGED: Final = "desired.changed"
TOKEN_REVOKED: Final = "token.revoked"  # noqa: S105 - a message type, not a secret
SESSION_TAKEOVER: Final = "session.takeover"


# The Redis channel layer takes a pool connection for each call in flight, and redis-py's pool
# refuses a call past its 100 connections (MaxConnectionsError) instead of queueing it: a
# reconnect storm's calls past that ran as if the layer were down (docs/decisions.md,
# 'channel-layer calls in flight'). Calls of the streams (WebSocket and gRPC) beyond this many
# wait their turn.
LAYER_CALLS_IN_FLIGHT = 32
_layer_slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
    weakref.WeakKeyDictionary()
)


@asynccontextmanager
async def layer_slot() -> AsyncIterator[None]:
    """Hold one of this event loop's channel-layer call slots."""
    loop = asyncio.get_running_loop()
    slots = _layer_slots.get(loop)
    if slots is None:
        slots = _layer_slots[loop] = asyncio.Semaphore(LAYER_CALLS_IN_FLIGHT)
    async with slots:
        yield


def node_group(node_id: int) -> str:
    """The channel-layer group of every stream held for one node."""
    return f"llmgw.node.{node_id}"


def nudge_node(node_id: int) -> None:
    """Say "node N's desired state changed". Call inside the transaction that changed it.

    Bumps the node's desired revision now and tells its streams after commit; a nudge lost on
    the way is repaired by the periodic resync, because the stream re-reads everything from
    the database either way.
    """
    Node.objects.filter(pk=node_id).update(desired_revision=F("desired_revision") + 1)
    send_on_commit(node_id, DESIRED_CHANGED)


_batch = threading.local()


@contextmanager
def batched() -> Iterator[None]:
    """Nudges committed inside the block go out together when it ends, each node's once.

    A tick that places hundreds of replicas would otherwise open the channel layer once per
    placement (from sync code, each send runs an event loop and a connection of its own:
    docs/decisions.md, 'placing many replicas in one tick'). They leave at most one tick late;
    a nudge is a hint, the desired state itself is read from the store."""
    pending: dict[tuple[int, str], dict[str, Any]] = {}
    _batch.pending = pending
    try:
        yield
    finally:
        _batch.pending = None
        _send_all(pending)


def send_on_commit(node_id: int, message_type: str, **extra: Any) -> None:
    """Send to the node's streams once the current transaction commits (never if it rolls
    back); inside :func:`batched`, when the block ends."""
    transaction.on_commit(lambda: _send_or_keep(node_id, message_type, extra))


def _send_or_keep(node_id: int, message_type: str, extra: dict[str, Any]) -> None:
    pending: dict[tuple[int, str], dict[str, Any]] | None = getattr(_batch, "pending", None)
    if pending is None:
        send_to_node(node_id, message_type, **extra)
    else:
        pending[(node_id, message_type)] = extra


def _send_all(pending: dict[tuple[int, str], dict[str, Any]]) -> None:
    layer = get_channel_layer()
    if layer is None or not pending:
        return

    async def send() -> None:
        # One after the other on one connection: hundreds at once would exhaust the layer's
        # connection pool.
        for (node_id, message_type), extra in pending.items():
            await layer.group_send(node_group(node_id), {"type": message_type, **extra})

    try:
        async_to_sync(send)()
    except Exception as exc:
        logger.warning(
            "%d nudge(s) not all delivered through the channel layer (%s); the periodic "
            "resync will deliver the changes",
            len(pending),
            type(exc).__name__,
        )


def send_to_node(node_id: int, message_type: str, **extra: Any) -> bool:
    """Best effort: a channel layer that is down must never fail the caller's work."""
    layer = get_channel_layer()
    if layer is None:
        return False
    try:
        async_to_sync(layer.group_send)(node_group(node_id), {"type": message_type, **extra})
    except Exception as exc:
        logger.warning(
            "node %s: %s not delivered through the channel layer (%s); the periodic resync "
            "will deliver the change",
            node_id,
            message_type,
            type(exc).__name__,
        )
        return False
    return True
