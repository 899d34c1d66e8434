"""The ASGI application Daphne serves: HTTP (``/v1``, ``/admin``, ``/healthz``) and, later
in the routing table, the agents' WebSocket streams."""

from __future__ import annotations

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")

# Django must be set up before anything imports models (Channels routing does).
django_asgi = get_asgi_application()

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402

from control.routing import websocket_urlpatterns  # noqa: E402
from gateway.asgi import GatewayHandler, by_path, install_daphne_body_limit  # noqa: E402

install_daphne_body_limit()

application = ProtocolTypeRouter(
    {
        # /v1 goes to a handler without Django's middleware (see gateway.asgi); the admin's
        # CSS and scripts are served by the web process itself so that the embedded default
        # needs no separate web server.
        "http": by_path("/v1/", GatewayHandler(), ASGIStaticFilesHandler(django_asgi)),
        # Agents' streams; node-token authentication is middleware on the route itself.
        "websocket": URLRouter(websocket_urlpatterns),
    }
)
