"""Celery tasks of the gateway: thin edges over ``gateway.ledger.rollups``."""

from __future__ import annotations

import logging

from celery import shared_task
from django.conf import settings

from control import serving
from gateway.identity import budgets
from gateway.ledger import rollups

logger = logging.getLogger(__name__)

ROLL_UP_TASK = "gateway.tasks.roll_up_usage"
BUDGET_TASK = "gateway.tasks.refresh_budgets"


@shared_task(
    name=ROLL_UP_TASK,
    ignore_result=True,
    soft_time_limit=settings.LLMGW_USAGE_ROLLUP_INTERVAL * 0.9,
    time_limit=settings.LLMGW_USAGE_ROLLUP_INTERVAL,
)
def roll_up_usage() -> None:
    """Sum the hours that are over and expire old raw rows, on the leader only (beat sends
    it to every worker's queue; a run that repeats one is harmless, see gateway.ledger.rollups)."""
    if not serving.this_process_leads():
        logger.debug("usage rollups: not the leader")
        return
    run = rollups.roll_up()
    logger.info(
        "usage rollups through %s: %d rows, %d raw rows expired",
        run.rolled_through,
        run.rollups,
        run.deleted,
    )


@shared_task(
    name=BUDGET_TASK,
    ignore_result=True,
    soft_time_limit=settings.LLMGW_BUDGET_REFRESH_INTERVAL * 0.9,
    time_limit=settings.LLMGW_BUDGET_REFRESH_INTERVAL,
)
def refresh_budgets() -> int:
    """Lift budget counters to the spend the records show, on the leader only."""
    if not serving.this_process_leads():
        logger.debug("budget refresh: not the leader")
        return 0
    raised = budgets.refresh()
    if raised:
        logger.warning("budget refresh: %d counter(s) were below the recorded spend", raised)
    return raised
