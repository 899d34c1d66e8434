"""The site's app: the commands that span both apps, and, at start, the control plane given
the way to send an early reconcile tick through the site's Celery app (the control plane sits
below the site and never imports it)."""

from __future__ import annotations

from django.apps import AppConfig


class SiteConfig(AppConfig):
    name = "llmgw_site"

    def ready(self) -> None:
        from control import serving  # noqa: PLC0415 - apps are ready only now

        serving.send_ticks_with(send_task)


def send_task(name: str, *, expires: float, retry: bool) -> None:
    """Send the Celery task ``name`` through the site's app."""
    # Imported here: most web processes never send one (only a request for a model with no
    # ready replica does), and importing Celery is a large part of a web process's start.
    from llmgw_site.celery import app  # noqa: PLC0415

    app.send_task(name, expires=expires, retry=retry)
