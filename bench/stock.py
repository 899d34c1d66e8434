"""For the benchmark only: llmgw with ``/v1`` served by Django's stock ASGI handler and the
full middleware stack, to measure what ``gateway.edge.asgi.V1App`` saves.

llmgw serves its relay routes through that front door alone; the conventional way is built
here instead, as a Django project would write it: ninja operations (bearer auth, the view
handed a request object) that relay, on this module's URLconf, under every middleware of the
site's settings.
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")

django_app = get_asgi_application()

from django.conf import settings  # noqa: E402
from django.http import HttpRequest  # noqa: E402
from django.http.response import HttpResponseBase  # noqa: E402
from django.urls import path  # noqa: E402
from ninja import NinjaAPI  # noqa: E402

from gateway.edge.api import BearerKey, to_django  # noqa: E402
from gateway.identity.keys import KeyInfo  # noqa: E402
from gateway.relay import entry  # noqa: E402
from gateway.relay.routes import RELAY_ROUTES, RelayRoute  # noqa: E402

stock = NinjaAPI(urls_namespace="stock", auth=BearerKey(), docs_url=None, openapi_url=None)


def _relay_view(route: RelayRoute) -> Callable[[HttpRequest], Awaitable[HttpResponseBase]]:
    async def view(request: HttpRequest) -> HttpResponseBase:
        key = request.auth  # type: ignore[attr-defined]
        assert isinstance(key, KeyInfo)
        return to_django(await entry.relay(request.body, key, route, time.perf_counter()))

    return view


for _route in RELAY_ROUTES:
    stock.post(_route.path.removeprefix("/v1"))(_relay_view(_route))

urlpatterns = [path("v1/", stock.urls)]
# Django's handler reads the URLconf from the settings on every request.
settings.ROOT_URLCONF = __name__


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":  # Django answers only HTTP; the server asks this first
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    await django_app(scope, receive, send)
