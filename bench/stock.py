"""For the benchmark only: llmgw with ``/v1`` served by Django's stock ASGI handler and the
full middleware stack, to measure what ``gateway.asgi.GatewayHandler`` saves."""

from __future__ import annotations

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")

app = get_asgi_application()
