"""Celery tasks of the control plane: thin edges over ``control.reconciler.runner``."""

from __future__ import annotations

from typing import Any

from celery import shared_task
from celery.signals import worker_process_shutdown, worker_shutdown
from django.conf import settings

from control import serving
from control.reconciler.runner import process_reconciler


@shared_task(
    # By name, so the web process asks for a tick without importing this module's reconciler.
    name=serving.RECONCILE_TASK,
    ignore_result=True,
    # A tick that outlives the renew deadline could not write anyway (the fence refuses);
    # stop it rather than let it hold the worker.
    soft_time_limit=settings.LLMGW_LEASE_RENEW_DEADLINE,
    time_limit=settings.LLMGW_LEASE_TTL,
)
def reconcile() -> None:
    """One tick, acting only if this process leads (beat sends one about every second). A
    tick that stopped on its budget while placing asks for the next one at once: a wave is
    placed in short ticks back to back, not one short tick a second."""
    if process_reconciler().run_once().more_to_place:
        serving.request_tick()


@worker_process_shutdown.connect
@worker_shutdown.connect
def release_lease_on_shutdown(**kwargs: Any) -> None:
    """A clean stop gives the lease back, so a standby leads within one tick, not one TTL."""
    process_reconciler().shutdown()
