"""The ASGI application Daphne serves: HTTP (``/v1``, ``/admin``, ``/healthz``) and, later
in the routing table, the agents' WebSocket streams."""

from __future__ import annotations

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")

# Django must be set up before anything imports models (Channels routing does).
django_asgi = get_asgi_application()

from channels.routing import ProtocolTypeRouter  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402

application = ProtocolTypeRouter(
    {
        # The admin's CSS and scripts are served by the web process itself so that the
        # embedded default needs no separate web server; /v1 requests pass straight through.
        "http": ASGIStaticFilesHandler(django_asgi),
    }
)
