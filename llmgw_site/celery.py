"""The Celery application: beat ticks the reconciler, the worker runs it (leader-gated)."""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")

app = Celery("llmgw")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
