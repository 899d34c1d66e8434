"""WebSocket routes: the agents' stream (behind node-token authentication), nothing else."""

from __future__ import annotations

from typing import Any

from django.urls import path, re_path

from agents.protocol.vocabulary import STREAM_PATH
from control.consumers import AgentConsumer, NodeTokenAuthMiddleware, reject_unknown_path


def _asgi(app: Any) -> Any:
    """Channels routes ASGI apps with Django's ``path``, whose stubs expect views."""
    return app


websocket_urlpatterns: list[Any] = [
    path(STREAM_PATH.lstrip("/"), _asgi(NodeTokenAuthMiddleware(AgentConsumer.as_asgi()))),
    re_path(r"", _asgi(reject_unknown_path)),
]
