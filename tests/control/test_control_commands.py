"""`manage.py reconcile` and `manage.py explain_placement`."""

from __future__ import annotations

import io
import sys
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from control import leases
from control.models import Replica
from tests.harness.factories import gib, make_model, make_node
from tests.harness.procs import Proc
from tests.harness.store import child_env
from tests.harness.waits import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def run_command(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    try:
        call_command(*args, stdout=out, stderr=out)
    except SystemExit as exc:
        return int(exc.code or 0), out.getvalue()
    return 0, out.getvalue()


def test_reconcile_once_places_what_is_missing_and_says_so() -> None:
    make_node("a", gpus=gib(80))
    make_model("m", min_replicas=1)
    code, text = run_command("reconcile", "--once")
    assert code == 0
    assert text.startswith("tick done (epoch 1): 1 placed")
    assert Replica.objects.filter(model__name="m").count() == 1


def test_reconcile_once_refuses_to_act_while_another_process_leads(election_on: Any) -> None:
    make_node("a", gpus=gib(80))
    make_model("m", min_replicas=1)
    leases.claim(owner="elsewhere:1:x", ttl=60)
    with pytest.raises(CommandError, match="did not act: another process leads"):
        call_command("reconcile", "--once", stdout=io.StringIO())
    assert not Replica.objects.exists()


def test_reconcile_needs_a_mode() -> None:
    with pytest.raises(CommandError, match="one of the arguments --once --loop is required"):
        call_command("reconcile", stdout=io.StringIO())


def test_reconcile_loop_ticks_until_sigterm_then_releases_the_lease(tmp_path: Any) -> None:
    make_node("a", gpus=gib(80))
    make_model("m", min_replicas=1)
    # The node has no agent: its one heartbeat must stay fresh however long a loaded machine
    # takes to start the loop.
    env = child_env(
        LLMGW_VAR_DIR=str(tmp_path),
        LLMGW_UNREACHABLE_AFTER="3600",
        LLMGW_LOST_AFTER="7200",
    )
    argv = [sys.executable, "manage.py", "reconcile", "--loop", "--interval", "0.2"]
    loop = Proc("reconcile", argv, tmp_path, env).start()
    try:
        wait_until(Replica.objects.exists, what="a placement by the loop", logs=[loop])
        assert Replica.objects.count() == 1
        view = leases.read()
        assert view is not None and view.held
    finally:
        code = loop.stop()
    assert code == 0, loop.tail()
    view = leases.read()
    assert view is not None and not view.held, "released on SIGTERM"


def test_explain_placement_shows_where_a_replica_would_go() -> None:
    make_node("a", gpus=gib(80, 80))
    make_model("m", gpus=2, memory_gib=40)
    code, text = run_command("explain_placement", "m")
    assert code == 0
    assert "model m (profile m-sim: sim, 1 shard(s) × 2 GPU(s) with 40960 MiB free each" in text
    assert "would place rank 0 on a: GPUs [0, 1], port 20000" in text


def test_explain_placement_says_why_a_replica_cannot_be_placed() -> None:
    make_node("gpu-3", gpus=gib(80))
    make_model("big", gpus=2, memory_gib=80)
    code, text = run_command("explain_placement", "big")
    assert code == 1
    assert "cannot place now: needs 2×80 GiB on one node; largest free is 1×80 GiB on gpu-3" in text


def test_explain_placement_of_an_unknown_model_is_a_clear_error() -> None:
    with pytest.raises(CommandError, match="no model named 'nope' in the catalog"):
        call_command("explain_placement", "nope", stdout=io.StringIO())
