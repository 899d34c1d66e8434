"""The site's app: the commands that span both apps, and, at start, the control plane given
the way to send an early reconcile tick through the site's Celery app (the control plane sits
below the site and never imports it), and the tracing variables checked (every process)."""

from __future__ import annotations

import os

from django.apps import AppConfig
from django.core.exceptions import ImproperlyConfigured

from telemetry import tracing


class SiteConfig(AppConfig):
    name = "llmgw_site"

    def ready(self) -> None:
        from control import serving  # noqa: PLC0415 - apps are ready only now

        serving.send_ticks_with(send_task)
        # Checked here, in every process at start, though each starts tracing later (after
        # any fork): a variable tracing cannot honour stops start-up, naming it.
        try:
            tracing.wanted(os.environ)
        except tracing.TracingConfigError as error:
            raise ImproperlyConfigured(f"llmgw cannot start:\n  {error}") from None


def send_task(name: str, *, expires: float, retry: bool) -> None:
    """Send the Celery task ``name`` through the site's app."""
    # Imported here: most web processes never send one (only a request for a model with no
    # ready replica does), and importing Celery is a large part of a web process's start.
    from llmgw_site.celery import app  # noqa: PLC0415

    app.send_task(name, expires=expires, retry=retry)
