"""The shard supervisor against real engine processes (``sim``) on loopback, no control plane:
start, readiness, idempotent snapshots, stale epochs, drains, failures, stops, adoption."""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest
from openai import AsyncOpenAI

from agents.engines import Launch, LaunchContext
from agents.gpus import SimulatedGpus, parse_simulated
from agents.plan import Want
from agents.processes import Launcher, ProcessHandle, spawn
from agents.protocol.messages import DesiredShard, DesiredState
from agents.protocol.vocabulary import (
    DesiredShardState,
    Engine,
    FailureClass,
    ShardState,
    WeightsState,
)
from agents.supervisor import Supervisor, SupervisorConfig
from tests.harness.procs import alive, free_port
from tests.harness.waits import await_until

pytestmark = pytest.mark.timeout(300)


GPUS = 6  # shard N runs on GPU N-1: the agent refuses two shards on one GPU


def make_supervisor(
    tmp_path: Path, *, stop_grace: float = 5.0, launcher: Launcher = spawn
) -> Supervisor:
    weights = tmp_path / "weights"
    weights.mkdir(exist_ok=True)
    return Supervisor(
        SupervisorConfig(
            launch=LaunchContext(host="127.0.0.1", python=sys.executable, weights_dir=weights),
            state_dir=tmp_path / "state",
            port_range=(1024, 65535),
            stop_grace=stop_grace,
            poll_interval=0.1,
            metrics_every=2,
        ),
        SimulatedGpus(parse_simulated(f"{GPUS}x80GiB", "t")),
        launcher=launcher,
    )


@pytest.fixture
async def supervisor(tmp_path: Path) -> AsyncIterator[Supervisor]:
    sup = make_supervisor(tmp_path)
    yield sup
    await sup.shutdown(leave_running=False)


def sim_shard(shard_id: int = 1, **changes: object) -> DesiredShard:
    shard = DesiredShard(
        shard_id=shard_id,
        replica_id=shard_id,
        generation=1,
        state=DesiredShardState.RUNNING,
        engine=Engine.SIM,
        model=f"tiny-{shard_id}",
        source="models/tiny",
        port=free_port(),
        gpu_indices=(shard_id - 1,),
        startup_timeout_s=20,
        drain_timeout_s=20,
    )
    return replace(shard, **changes)  # type: ignore[arg-type]


def desired(*shards: DesiredShard, epoch: int = 1, revision: int = 1, **kw: object) -> DesiredState:
    return DesiredState(node="t", epoch=epoch, revision=revision, shards=shards, **kw)  # type: ignore[arg-type]


async def served_once_more(sup: Supervisor, shard_id: int = 1) -> None:
    """Until the supervisor has read the shard's load again: a full turn of its loop after
    whatever the test just did (the positive signal before asserting that nothing changed)."""
    rt = sup.shards[shard_id]
    rt.requests_running = rt.requests_waiting = -1  # what no engine reports
    await await_until(lambda: rt.requests_running != -1, what=f"shard {shard_id} polled again")


def state_of(sup: Supervisor, shard_id: int = 1) -> ShardState | None:
    rt = sup.shards.get(shard_id)
    return rt.state if rt else None


async def test_a_shard_starts_becomes_ready_and_answers_chat_completions(
    supervisor: Supervisor,
) -> None:
    shard = sim_shard()
    assert supervisor.apply(desired(shard))
    await await_until(lambda: state_of(supervisor) is ShardState.READY, what="ready")
    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{shard.port}/v1", api_key="unused")
    answer = await client.chat.completions.create(
        model="tiny-1", messages=[{"role": "user", "content": "hello there"}], max_tokens=3
    )
    assert answer.choices[0].message.content == "tok1 tok2 tok3"
    await await_until(lambda: supervisor.shards[1].requests_running == 0, what="load read")
    report = supervisor.status().shards[0]
    assert report.state is ShardState.READY and report.pid is not None and alive(report.pid)
    assert report.port == shard.port
    assert any("sim listening" in line for line in report.log_tail)
    env = Path(f"/proc/{report.pid}/environ").read_bytes().split(b"\0")
    assert b"CUDA_VISIBLE_DEVICES=0" in env


async def test_the_same_snapshot_twice_has_one_effect(supervisor: Supervisor) -> None:
    shard = sim_shard()
    supervisor.apply(desired(shard))
    await await_until(lambda: state_of(supervisor) is ShardState.READY, what="shard 1 ready")
    running = supervisor.shards[1]
    pid = running.handle.pid  # type: ignore[union-attr]
    for revision in (1, 1, 2):  # re-sent, and a new revision that changes nothing here
        assert supervisor.apply(desired(shard, revision=revision))
        # Convergence decides at once: the same incarnation, still wanted running.
        assert supervisor.shards[1] is running and running.want is Want.RUN
    await served_once_more(supervisor)
    assert supervisor.starts == 1
    assert supervisor.shards[1].handle.pid == pid  # type: ignore[union-attr]
    assert alive(pid) and state_of(supervisor) is ShardState.READY


async def test_a_lower_epoch_is_rejected_counted_and_changes_nothing(
    supervisor: Supervisor,
) -> None:
    shard = sim_shard()
    supervisor.apply(desired(shard, epoch=5, revision=10))
    await await_until(lambda: state_of(supervisor) is ShardState.READY, what="shard 1 ready")
    running = supervisor.shards[1]
    assert not supervisor.apply(desired(epoch=4, revision=11))  # would stop the shard
    assert supervisor.shards[1] is running and running.want is Want.RUN
    await served_once_more(supervisor)
    assert state_of(supervisor) is ShardState.READY
    status = supervisor.status()
    assert (status.stale_rejected, status.observed_epoch, status.observed_revision) == (1, 5, 10)
    assert supervisor.apply(desired(shard, epoch=5, revision=12))  # the same epoch is fine
    assert supervisor.apply(desired(epoch=6, revision=13))  # a newer leader stops it
    await await_until(lambda: 1 not in supervisor.shards, what="shard stopped and forgotten")


async def test_a_shard_left_out_of_the_desired_state_is_stopped(supervisor: Supervisor) -> None:
    keep, drop = sim_shard(1), sim_shard(2)
    supervisor.apply(desired(keep, drop))
    await await_until(
        lambda: state_of(supervisor, 1) is state_of(supervisor, 2) is ShardState.READY,
        what="shards 1 and 2 ready",
    )
    pid = supervisor.shards[2].handle.pid  # type: ignore[union-attr]
    supervisor.apply(desired(keep, revision=2))
    await await_until(lambda: 2 not in supervisor.shards, what="shard 2 gone")
    assert not alive(pid)
    assert state_of(supervisor, 1) is ShardState.READY
    assert [s.shard_id for s in supervisor.status().shards] == [1]


async def test_drain_lets_in_flight_requests_finish_and_weights_in_use_are_not_removed(
    supervisor: Supervisor, tmp_path: Path
) -> None:
    weights = tmp_path / "weights" / "models" / "tiny"
    weights.mkdir(parents=True)
    (weights / "model.safetensors").write_bytes(b"\0" * 1024)
    shard = sim_shard(args=("--itl-ms", "40"))
    supervisor.apply(desired(shard))
    await await_until(lambda: state_of(supervisor) is ShardState.READY, what="shard 1 ready")
    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{shard.port}/v1", api_key="unused")
    stream = await client.chat.completions.create(
        model="tiny-1", messages=[{"role": "user", "content": "go"}], max_tokens=40, stream=True
    )
    chunks = aiter(stream)
    first = await anext(chunks)
    assert first.choices[0].delta.role == "assistant"

    draining = replace(shard, state=DesiredShardState.DRAINING)
    supervisor.apply(desired(draining, revision=2, remove_weights=("models/tiny",)))
    await await_until(lambda: state_of(supervisor) is ShardState.DRAINING, what="draining")
    await await_until(lambda: "models/tiny" in supervisor.weights, what="weights report")
    report = supervisor.weights["models/tiny"]
    assert report.state is WeightsState.REFUSED
    assert "in use by shard(s) 1" in report.message
    assert weights.exists()

    text, finish = [], None
    async for chunk in chunks:
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert "".join(text).split()[-1] == "tok40"  # every token of the in-flight request
    assert finish == "length"
    await await_until(
        lambda: state_of(supervisor) is ShardState.STOPPED, what="stopped after drain"
    )
    # Once nothing uses them, the next convergence removes the weights.
    await await_until(lambda: not weights.exists(), what="weights removed")
    # The files go first, then the report says so.
    await await_until(
        lambda: supervisor.weights["models/tiny"].state is WeightsState.REMOVED,
        what="the removal reported",
    )


async def test_failures_are_reported_with_their_class_and_log(supervisor: Supervisor) -> None:
    bad_args = sim_shard(1, args=("--port", "not-a-port"))
    crashes = sim_shard(2, args=("--crash-after", "1"))
    never_ready = sim_shard(3, args=("--startup-delay", "30"), startup_timeout_s=1.0)
    outside = sim_shard(4, port=80)
    no_gpu = sim_shard(5, gpu_indices=(7,))
    supervisor.apply(desired(bad_args, crashes, never_ready, outside, no_gpu))
    await await_until(lambda: state_of(supervisor, 2) is ShardState.READY, what="shard 2 ready")
    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{crashes.port}/v1", api_key="x", max_retries=0)
    await client.chat.completions.create(
        model="tiny-2", messages=[{"role": "user", "content": "a"}]
    )
    with pytest.raises(Exception):  # noqa: B017 - the engine dies mid-request; any error will do
        await client.chat.completions.create(
            model="tiny-2", messages=[{"role": "user", "content": "b"}]
        )
    await await_until(
        lambda: all(state_of(supervisor, i) is ShardState.FAILED for i in range(1, 6)),
        what="all five failed",
    )
    reports = {s.shard_id: s for s in supervisor.status().shards}
    assert reports[1].failure_class is FailureClass.BAD_ARGS and reports[1].exit_code == 2
    assert any("invalid int value" in line for line in reports[1].log_tail)
    assert reports[2].failure_class is FailureClass.CRASH and reports[2].exit_code == 70
    assert reports[3].failure_class is FailureClass.HEALTH_TIMEOUT
    assert "within the start-up timeout (1s)" in reports[3].message
    pid3 = supervisor.shards[3].handle.pid  # type: ignore[union-attr]
    assert not alive(pid3)  # killed, not left behind
    assert reports[4].failure_class is FailureClass.BAD_ARGS
    assert "outside this agent's port range" in reports[4].message
    assert reports[5].failure_class is FailureClass.BAD_ARGS
    assert "GPU(s) [7] do not exist" in reports[5].message
    assert supervisor.starts == 3  # 4 and 5 never ran

    # A failed shard stays failed for the same generation; a new generation starts it again.
    failed = supervisor.shards[2]
    supervisor.apply(desired(bad_args, crashes, revision=2))
    assert supervisor.shards[2] is failed and failed.state is ShardState.FAILED
    assert supervisor.starts == 3
    supervisor.apply(desired(bad_args, replace(crashes, generation=2), revision=3))
    await await_until(lambda: state_of(supervisor, 2) is ShardState.READY, what="restarted")
    assert supervisor.starts == 4


async def test_stop_escalates_to_sigkill_when_the_engine_outlives_the_grace(
    tmp_path: Path,
) -> None:
    sup = make_supervisor(tmp_path, stop_grace=0.5)
    try:
        # The engine waits up to 30s for in-flight requests on SIGTERM; the agent will not.
        shard = sim_shard(args=("--itl-ms", "200", "--shutdown-grace", "30"))
        sup.apply(desired(shard))
        await await_until(lambda: state_of(sup) is ShardState.READY, what="shard 1 ready")
        client = AsyncOpenAI(base_url=f"http://127.0.0.1:{shard.port}/v1", api_key="x")
        stream = await client.chat.completions.create(
            model="tiny-1",
            messages=[{"role": "user", "content": "go"}],
            max_tokens=100,
            stream=True,
        )
        await anext(aiter(stream))
        sup.apply(desired(replace(shard, state=DesiredShardState.STOPPED), revision=2))
        await await_until(lambda: state_of(sup) is ShardState.STOPPED, what="stopped")
        assert sup.shards[1].exit_code == -9  # killed after the grace, not waited for
        await stream.close()
    finally:
        await sup.shutdown(leave_running=False)


async def test_shards_left_running_are_adopted_by_the_next_agent(tmp_path: Path) -> None:
    first = make_supervisor(tmp_path)
    shard = sim_shard()
    first.apply(desired(shard, epoch=7))
    await await_until(lambda: state_of(first) is ShardState.READY, what="shard 1 ready")
    pid = first.shards[1].handle.pid  # type: ignore[union-attr]
    await first.shutdown(leave_running=True)
    assert alive(pid)

    second = make_supervisor(tmp_path)
    try:
        second.recover()
        assert second.highest_epoch == 7  # a stale leader is still refused after a restart
        await await_until(lambda: state_of(second) is ShardState.READY, what="adopted and ready")
        adopted = second.shards[1]
        assert adopted.handle is not None and adopted.handle.pid == pid
        second.apply(desired(shard, epoch=7))
        assert second.shards[1] is adopted and adopted.want is Want.RUN
        await served_once_more(second)
        assert second.starts == 0  # nothing started twice
        assert alive(pid)
        assert not second.apply(desired(epoch=6))
    finally:
        await second.shutdown(leave_running=False)
    await await_until(lambda: not alive(pid), what="adopted shard stopped")


async def test_a_shard_on_the_gpu_of_an_adopted_one_no_longer_wanted_waits_for_its_end(
    tmp_path: Path,
) -> None:
    """A node back from being lost still runs an engine whose replica the control plane has
    stopped and whose GPU it has given to a new shard: the new engine starts only once the
    old one has exited, never beside it on the GPU."""
    first = make_supervisor(tmp_path)
    old = sim_shard(1)
    first.apply(desired(old, epoch=3))
    await await_until(lambda: state_of(first) is ShardState.READY, what="shard 1 ready")
    old_pid = first.shards[1].handle.pid  # type: ignore[union-attr]
    await first.shutdown(leave_running=True)

    alive_at_launch: dict[int, bool] = {}

    async def launcher(
        spec: DesiredShard, command: Launch, log_path: Path, cwd: Path
    ) -> ProcessHandle:
        alive_at_launch[spec.shard_id] = alive(old_pid)
        return await spawn(spec, command, log_path, cwd)

    second = make_supervisor(tmp_path, launcher=launcher)
    try:
        second.recover()
        new = sim_shard(2, gpu_indices=old.gpu_indices)
        second.apply(desired(new, epoch=3, revision=2))
        waiting = second.status().shards[1]
        assert waiting.state is ShardState.PENDING and waiting.pid is None
        assert waiting.message == ("waiting for stopping shards to free GPU(s) [0] (shard(s) [1])")
        await await_until(lambda: state_of(second, 2) is ShardState.READY, what="new shard ready")
        assert alive_at_launch == {2: False}
        assert not alive(old_pid)
        assert [s.shard_id for s in second.status().shards] == [2]
    finally:
        await second.shutdown(leave_running=False)


async def test_an_adopted_shard_that_dies_is_reported_failed(tmp_path: Path) -> None:
    first = make_supervisor(tmp_path)
    first.apply(desired(sim_shard()))
    await await_until(lambda: state_of(first) is ShardState.READY, what="shard 1 ready")
    pid = first.shards[1].handle.pid  # type: ignore[union-attr]
    await first.shutdown(leave_running=True)
    second = make_supervisor(tmp_path)
    try:
        second.recover()
        await await_until(lambda: state_of(second) is ShardState.READY, what="shard 1 ready")
        os.kill(pid, 9)
        await await_until(lambda: state_of(second) is ShardState.FAILED, what="failure noticed")
        assert second.shards[1].exit_code is None  # not our child: the code is unknowable
        assert "started by a previous agent" in second.shards[1].message
    finally:
        await second.shutdown(leave_running=False)


async def test_weights_are_removed_when_unused_and_absent_ones_are_reported(
    supervisor: Supervisor, tmp_path: Path
) -> None:
    old = tmp_path / "weights" / "org" / "old"
    old.mkdir(parents=True)
    (old / "w.bin").write_bytes(b"x")
    supervisor.apply(desired(remove_weights=("org/old", "org/never-here")))
    await await_until(lambda: len(supervisor.weights) == 2, what="weights reports")
    assert not old.exists()
    assert supervisor.weights["org/old"].state is WeightsState.REMOVED
    assert supervisor.weights["org/never-here"].state is WeightsState.ABSENT
    assert (tmp_path / "weights" / "org").exists()  # only what was named
