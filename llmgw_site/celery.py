"""The Celery application: beat ticks the reconciler, the worker runs it (leader-gated)."""

from __future__ import annotations

import gc
import os
from typing import Any

from celery import Celery, signals
from kombu.transport import TRANSPORT_ALIASES

from llmgw_site import broker
from llmgw_site.diagnostics import process as diagnostics

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")
# The embedded default's broker (settings: CELERY_BROKER_URL): kombu's filesystem transport
# with atomic writes, so the worker never reads half a message.
TRANSPORT_ALIASES.setdefault(broker.ALIAS, "llmgw_site.broker:Transport")

app = Celery("llmgw")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@signals.worker_init.connect
@signals.beat_init.connect
def answer_diagnostics(**kwargs: Any) -> None:
    """The worker's and beat's stacks, profiles and heap for the admin's diagnostics."""
    diagnostics.start()


# A web process imports this module on first use (an early reconcile tick), after it froze what
# it had loaded at start (gateway.routing.upstreams): Celery's objects are kept out of the cyclic
# collector's full scans too.
gc.freeze()
