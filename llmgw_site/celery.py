"""The Celery application: beat ticks the reconciler, the worker runs it (leader-gated); with
tracing on (``telemetry.tracing``), each of their processes exports its own spans."""

from __future__ import annotations

import gc
import logging
import os
from typing import Any

from celery import Celery, signals
from celery.signals import beat_init, worker_process_init, worker_process_shutdown, worker_shutdown
from django.conf import settings
from django.utils import log
from kombu.transport import TRANSPORT_ALIASES

from llmgw_site import broker
from llmgw_site.diagnostics import process as diagnostics
from telemetry import tracing

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")
# The embedded default's broker (settings: CELERY_BROKER_URL): kombu's filesystem transport
# with atomic writes, so the worker never reads half a message.
TRANSPORT_ALIASES.setdefault(broker.ALIAS, "llmgw_site.broker:Transport")

app = Celery("llmgw")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@signals.celeryd_init.connect
def configure_logging(**kwargs: Any) -> None:
    """The worker's first signal, before Django is set up and before Celery warns of what it
    dislikes (being started as root): logging first, so that those lines are written as every
    other line of this process (``LLMGW_LOG_FORMAT``). Celery sends warnings to the log as
    well, once it has set its logging up: from here on already."""
    log.configure_logging(settings.LOGGING_CONFIG, settings.LOGGING)
    logging.captureWarnings(True)


@signals.worker_init.connect
@signals.beat_init.connect
def answer_diagnostics(**kwargs: Any) -> None:
    """The worker's and beat's stacks, profiles and heap for the admin's diagnostics."""
    diagnostics.start()


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
