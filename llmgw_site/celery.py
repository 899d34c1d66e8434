"""The Celery application: beat ticks the reconciler, the worker runs it (leader-gated); with
tracing on (``telemetry.tracing``), each of their processes exports its own spans."""

from __future__ import annotations

import gc
import os
from typing import Any

from celery import Celery
from celery.signals import beat_init, worker_process_init, worker_process_shutdown, worker_shutdown
from kombu.transport import TRANSPORT_ALIASES

from llmgw_site import broker
from telemetry import tracing

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")
# The embedded default's broker (settings: CELERY_BROKER_URL): kombu's filesystem transport
# with atomic writes, so the worker never reads half a message.
TRANSPORT_ALIASES.setdefault(broker.ALIAS, "llmgw_site.broker:Transport")

app = Celery("llmgw")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
# A web process imports this module on first use (an early reconcile tick), after it froze what
# it had loaded at start (gateway.routing.upstreams): Celery's objects are kept out of the cyclic
# collector's full scans too.
gc.freeze()


@worker_process_init.connect
def trace_worker(**kwargs: Any) -> None:
    """Traces from the process that runs the tasks (the pool's child, after its fork; the worker
    itself with the solo pool), if the environment asks for them: the reconciler's ticks."""
    tracing.start("worker")


@beat_init.connect
def trace_beat(**kwargs: Any) -> None:
    """Beat makes no span of its own today; started so that what it may trace is exported."""
    tracing.start("beat")


@worker_process_shutdown.connect
@worker_shutdown.connect
def export_queued_spans(**kwargs: Any) -> None:
    """A clean stop exports the spans still queued (beat's exit does it at exit)."""
    tracing.shutdown()
