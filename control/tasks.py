"""Celery tasks of the control plane: thin edges over ``control.reconciler``."""

from __future__ import annotations

import logging
from typing import Any

from celery import shared_task
from celery.signals import worker_process_shutdown, worker_shutdown
from django.conf import settings

from control import reconciler

logger = logging.getLogger(__name__)


@shared_task(
    name="control.tasks.reconcile",
    ignore_result=True,
    # A tick that outlives the renew deadline could not write anyway (the fence refuses);
    # stop it rather than let it hold the worker.
    soft_time_limit=settings.LLMGW_LEASE_RENEW_DEADLINE,
    time_limit=settings.LLMGW_LEASE_TTL,
)
def reconcile() -> None:
    """One tick, acting only if this process leads (beat sends one about every second)."""
    reconciler.process_reconciler().run_once()


def request_tick() -> None:
    """Ask for a tick now instead of at the next beat (a cold model has a request waiting).
    Best effort and never blocking: the beat's next tick does the same work anyway."""
    try:
        reconcile.apply_async(expires=settings.LLMGW_RECONCILE_INTERVAL, retry=False)
    except Exception as exc:  # a broker that is down must not fail the request path
        logger.warning("could not ask for an early reconcile tick: %s", type(exc).__name__)


@worker_process_shutdown.connect
@worker_shutdown.connect
def release_lease_on_shutdown(**kwargs: Any) -> None:
    """A clean stop gives the lease back, so a standby leads within one tick, not one TTL."""
    reconciler.process_reconciler().shutdown()
