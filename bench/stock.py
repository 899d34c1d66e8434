"""For the benchmark only: llmgw with ``/v1`` served by Django's stock ASGI handler and the
full middleware stack, to measure what ``gateway.edge.asgi.V1App`` saves."""

from __future__ import annotations

import os
from typing import Any

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")

django_app = get_asgi_application()


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":  # Django answers only HTTP; the server asks this first
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    await django_app(scope, receive, send)
