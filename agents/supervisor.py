"""The shard supervisor: runs the engine processes on this node as the desired state says.

Level-triggered: :meth:`Supervisor.apply` takes the node's *full* desired state, and
:meth:`Supervisor.converge` asks the pure :func:`agents.plan.plan` what to do about the
difference from what runs, then does it. A snapshot applied twice changes nothing the second
time, and a lost snapshot is repaired by the next one.

Each running shard has one lifecycle task: start → poll health until ready (or the start-up
deadline) → poll engine load while ready → drain (wait for in-flight requests, bounded) → stop
(terminate, kill after a grace). A shard that exits on its own is failed with a class read
from its exit code and log. Engines are started by a :class:`~agents.processes.Launcher` and
driven through a :class:`~agents.processes.ProcessHandle`; the state file
(:mod:`agents.adoption`) lets the next agent adopt the ones left running; weights are removed
by :class:`~agents.weights.WeightsJanitor`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from agents import adoption
from agents.engines import (
    Launch,
    LaunchContext,
    RecipeError,
    classify_failure,
    health_path,
    launch,
    parse_load,
)
from agents.gpus import GpuSource
from agents.plan import (
    FINISHED,
    Action,
    Drain,
    Forget,
    NodeFacts,
    RecordStopped,
    Refuse,
    RunningShard,
    Start,
    Stop,
    Update,
    Wait,
    Want,
    escalates,
    fingerprint,
    plan,
)
from agents.processes import (
    AdoptedProcess,
    Launcher,
    ProcessHandle,
    exit_words,
    read_log_tail,
    spawn,
)
from agents.protocol.messages import DesiredShard, DesiredState, ShardStatus, Status, WeightsReport
from agents.protocol.vocabulary import DesiredShardState, FailureClass, ShardState
from agents.weights import WeightsJanitor, weights_users

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SupervisorConfig:
    launch: LaunchContext
    state_dir: Path
    port_range: tuple[int, int]
    stop_grace: float = 10.0
    # How often a ready shard's exit is checked, and its load read (every few checks).
    poll_interval: float = 0.5
    metrics_every: int = 4
    health_timeout: float = 2.0


@dataclass
class ShardRuntime:
    """One incarnation of a shard on this node, and what the agent observes about it."""

    spec: DesiredShard
    fingerprint: str
    log_path: Path
    state: ShardState = ShardState.PENDING
    want: Want = Want.RUN
    handle: ProcessHandle | None = None
    exit_code: int | None = None
    failure_class: FailureClass = FailureClass.NONE
    message: str = ""
    requests_running: int | None = None
    requests_waiting: int | None = None
    # The engine's KV cache in tokens, once its metrics said (fixed for this incarnation).
    cache_tokens: int | None = None
    task: asyncio.Task[None] | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def finished(self) -> bool:
        return self.state in FINISHED and (self.task is None or self.task.done())

    def request(self, want: Want) -> None:
        if escalates(self.want, want):
            self.want = want
            self.wake.set()

    def view(self) -> RunningShard:
        return RunningShard(self.spec, self.fingerprint, self.state, self.want, self.finished)

    def to_status(self) -> ShardStatus:
        return ShardStatus(
            shard_id=self.spec.shard_id,
            replica_id=self.spec.replica_id,
            generation=self.spec.generation,
            state=self.state,
            port=self.spec.port,
            exit_code=self.exit_code,
            failure_class=self.failure_class,
            message=self.message,
            log_tail=read_log_tail(self.log_path),
            requests_running=self.requests_running,
            requests_waiting=self.requests_waiting,
            cache_tokens=self.cache_tokens,
            pid=self.handle.pid if self.handle is not None and not self.finished else None,
        )


class Supervisor:
    """Owns every shard process on this node and converges them to the desired state."""

    def __init__(
        self,
        config: SupervisorConfig,
        gpus: GpuSource,
        *,
        base_env: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        launcher: Launcher = spawn,
    ) -> None:
        self.config = config
        self.gpus = gpus
        self.base_env = dict(os.environ if base_env is None else base_env)
        self.clock = clock
        self.launcher = launcher
        self.shards: dict[int, ShardRuntime] = {}
        self.desired: DesiredState | None = None
        self.highest_epoch = 0
        self.stale_rejected = 0
        self.changed = asyncio.Event()
        self.starts = 0  # engines started by this agent, for logs and tests
        self.janitor = WeightsJanitor(config.launch.weights_dir, self._weights_users, self._changed)
        self._closing = False
        self._http = httpx.AsyncClient(timeout=config.health_timeout, trust_env=False)
        (config.state_dir / "logs").mkdir(parents=True, exist_ok=True)

    @property
    def weights(self) -> dict[str, WeightsReport]:
        """The janitor's latest report per weights name."""
        return self.janitor.reports

    # ----------------------------------------------------------------------- desired state

    def apply(self, desired: DesiredState) -> bool:
        """Take a full desired state; False (and counted) when a deposed leader sent it."""
        if self._closing:
            return False  # shutting down: start nothing new
        if desired.epoch < self.highest_epoch:
            self.stale_rejected += 1
            logger.warning(
                "rejected desired state revision %s: epoch %s is lower than %s, the highest "
                "seen (a deposed leader); %s rejected so far",
                desired.revision,
                desired.epoch,
                self.highest_epoch,
                self.stale_rejected,
            )
            self._changed()
            return False
        if self.desired is None or desired.revision != self.desired.revision:
            logger.info(
                "desired state revision %s (epoch %s): %d shard(s), %d weights removal(s)",
                desired.revision,
                desired.epoch,
                len(desired.shards),
                len(desired.remove_weights),
            )
        self.highest_epoch = desired.epoch
        self.desired = desired
        self.converge()
        self._save_state()
        self._changed()
        return True

    def converge(self) -> None:
        """Do what the plan says to make what runs match the desired state."""
        if self.desired is None:
            return  # nothing is stopped before the control plane has said what it wants
        node = NodeFacts(self.config.port_range, frozenset(g.index for g in self.gpus.read()))
        running = {shard_id: rt.view() for shard_id, rt in self.shards.items()}
        for action in plan(self.desired, running, node):
            self._execute(action)
        self.janitor.want_removed(self.desired.remove_weights)

    def _execute(self, action: Action) -> None:
        match action:
            case Start(spec, fp):
                self._start(spec, fp)
            case Refuse(spec, fp, reason):
                rt = self._new_runtime(spec, fp)
                logger.error("shard %s cannot start: %s", spec.shard_id, reason)
                self._fail(rt, FailureClass.BAD_ARGS, reason)
            case Wait(spec, fp, reason):
                self._wait_to_start(spec, fp, reason)
            case Update(spec):
                self.shards[spec.shard_id].spec = spec
            case Drain(shard_id):
                self.shards[shard_id].request(Want.DRAIN)
            case Stop(shard_id, why):
                if why:
                    logger.info("shard %s %s", shard_id, why)
                self.shards[shard_id].request(Want.STOP)
            case RecordStopped(spec, fp):
                self._new_runtime(spec, fp).state = ShardState.STOPPED
            case Forget(shard_id):
                del self.shards[shard_id]
                self._changed()

    def _wait_to_start(self, spec: DesiredShard, fp: str, reason: str) -> None:
        """Report the shard pending, with why; said once, however often the plan runs."""
        rt = self.shards.get(spec.shard_id)
        if (
            rt is not None
            and rt.state is ShardState.PENDING
            and (rt.fingerprint, rt.message) == (fp, reason)
        ):
            return
        rt = self._new_runtime(spec, fp)
        rt.message = reason
        logger.info("shard %s not started yet: %s", spec.shard_id, reason)
        self._changed()

    def _new_runtime(self, spec: DesiredShard, fp: str) -> ShardRuntime:
        rt = ShardRuntime(spec=spec, fingerprint=fp, log_path=self._log_path(spec))
        self.shards[spec.shard_id] = rt
        return rt

    def _log_path(self, spec: DesiredShard) -> Path:
        return self.config.state_dir / "logs" / f"shard-{spec.shard_id}.log"

    def _weights_users(self, target: Path) -> list[int]:
        """Shards that use (or are about to use) files under ``target``."""
        live = [rt.spec for rt in self.shards.values() if not rt.finished]
        wanted = [
            spec
            for spec in (self.desired.shards if self.desired else ())
            if spec.state is DesiredShardState.RUNNING
        ]
        return weights_users(target, self.config.launch.weights_dir, [*live, *wanted])

    # ----------------------------------------------------------------------- lifecycle

    def _start(self, spec: DesiredShard, fp: str) -> None:
        rt = self._new_runtime(spec, fp)
        try:
            command = launch(spec, self.config.launch, self.base_env)
        except RecipeError as exc:
            logger.error("shard %s cannot start: %s", spec.shard_id, exc)
            self._fail(rt, FailureClass.BAD_ARGS, str(exc))
            return
        rt.state = ShardState.STARTING
        rt.task = asyncio.create_task(self._run(rt, command))
        self._changed()

    async def _launch(self, rt: ShardRuntime, command: Launch) -> None:
        starting = asyncio.ensure_future(
            self.launcher(rt.spec, command, rt.log_path, self.config.state_dir)
        )
        try:
            rt.handle = await asyncio.shield(starting)
        except asyncio.CancelledError:
            # The agent is shutting down mid-start: let the start finish, so the engine is
            # recorded for the next agent (or stopped) rather than left running unknown.
            with contextlib.suppress(Exception):
                rt.handle = await starting
            raise
        self.starts += 1
        logger.info(
            "shard %s (replica %s, %s %s) started: pid %s, port %s, gpus [%s], log %s",
            rt.spec.shard_id,
            rt.spec.replica_id,
            rt.spec.engine.value,
            rt.spec.model,
            rt.handle.pid,
            rt.spec.port,
            ",".join(map(str, rt.spec.gpu_indices)),
            rt.log_path,
        )

    async def _run(self, rt: ShardRuntime, command: Launch | None) -> None:
        """One incarnation's whole life; ``command`` None: adopt the engine in ``rt.handle``."""
        try:
            if command is not None:
                try:
                    await self._launch(rt, command)
                except OSError as exc:
                    self._fail(
                        rt, FailureClass.BAD_ARGS, f"cannot execute {command.argv[0]}: {exc}"
                    )
                    return
                self._save_state()
            if await self._wait_ready(rt):
                await self._serve(rt)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("shard %s: supervisor error; stopping it", rt.spec.shard_id)
            await self._terminate(rt)
            self._fail(rt, FailureClass.CRASH, "the agent's supervisor failed; see its log")
        finally:
            if rt.task is asyncio.current_task():
                rt.task = None
            self._save_state()
            self._changed()
            # What should happen next (a restart with a new spec, say) is decided afresh.
            if not self._closing:
                asyncio.get_running_loop().call_soon(self.converge)

    async def _pause(self, rt: ShardRuntime, seconds: float) -> None:
        """Sleep, but wake at once when converge asks this shard for something else."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(rt.wake.wait(), timeout=seconds)
        rt.wake.clear()

    async def _wait_ready(self, rt: ShardRuntime) -> bool:
        assert rt.handle is not None
        deadline = self.clock() + rt.spec.startup_timeout_s
        interval = 0.1
        while True:
            if rt.want is not Want.RUN:
                await self._stop(rt)
                return False
            if rt.handle.exited():
                self._exited(rt)
                return False
            if await self._healthy(rt):
                rt.state = ShardState.READY
                logger.info("shard %s ready on port %s", rt.spec.shard_id, rt.spec.port)
                self._changed()
                return True
            if self.clock() >= deadline:
                await self._terminate(rt)
                self._fail(
                    rt,
                    FailureClass.HEALTH_TIMEOUT,
                    f"not healthy at {health_path(rt.spec)} within the start-up timeout "
                    f"({rt.spec.startup_timeout_s:g}s)",
                )
                return False
            await self._pause(rt, min(interval, max(0.0, deadline - self.clock())))
            # A request may be waiting for this engine (scale from zero): every poll interval
            # is added to its first token, so stay quick; a health GET on loopback is cheap.
            interval = min(interval * 1.5, 0.25)

    async def _serve(self, rt: ShardRuntime) -> None:
        assert rt.handle is not None
        tick = 0
        while True:
            if rt.handle.exited():
                self._exited(rt)
                return
            if rt.want is Want.STOP:
                await self._stop(rt)
                return
            if rt.want is Want.DRAIN:
                await self._drain(rt)
                return
            if tick % self.config.metrics_every == 0:
                await self._read_load(rt)
            tick += 1
            await self._pause(rt, self.config.poll_interval)

    async def _drain(self, rt: ShardRuntime) -> None:
        """Let in-flight requests finish (the gateway sends no new ones to a draining replica),
        up to the drain deadline, then stop."""
        assert rt.handle is not None
        rt.state = ShardState.DRAINING
        self._changed()
        deadline = self.clock() + rt.spec.drain_timeout_s
        logger.info("shard %s draining (up to %gs)", rt.spec.shard_id, rt.spec.drain_timeout_s)
        while rt.want is Want.DRAIN and not rt.handle.exited():
            load = await self._read_load(rt)
            if load is None:
                # No metrics: the engine's own graceful shutdown (SIGTERM, then the grace)
                # is what lets its requests finish.
                logger.info("shard %s publishes no load metrics; stopping it", rt.spec.shard_id)
                break
            if load == 0:
                logger.info("shard %s drained: no requests in flight", rt.spec.shard_id)
                break
            if self.clock() >= deadline:
                logger.warning(
                    "shard %s drain deadline passed with %s request(s) in flight; stopping",
                    rt.spec.shard_id,
                    load,
                )
                break
            await self._pause(rt, 0.2)
        await self._stop(rt)

    async def _read_load(self, rt: ShardRuntime) -> int | None:
        """Requests in flight (running + waiting) from the engine's metrics, or None."""
        try:
            response = await self._http.get(self._url(rt, "/metrics"), headers=_auth(rt))
        except httpx.HTTPError:
            return None
        load = parse_load(response.text) if response.status_code == 200 else None
        running = None if load is None else load.running
        waiting = None if load is None else load.waiting
        if (running, waiting) != (rt.requests_running, rt.requests_waiting):
            rt.requests_running, rt.requests_waiting = running, waiting
        if load is not None and load.cache_tokens is not None:
            # Kept through a scrape that lacks it: the size is set when the engine starts.
            rt.cache_tokens = load.cache_tokens
        return None if load is None else load.running + load.waiting

    def _url(self, rt: ShardRuntime, path: str) -> str:
        host = self.config.launch.host
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)  # noqa: S104
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{rt.spec.port}{path}"

    async def _healthy(self, rt: ShardRuntime) -> bool:
        try:
            response = await self._http.get(self._url(rt, health_path(rt.spec)), headers=_auth(rt))
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def _stop(self, rt: ShardRuntime) -> None:
        await self._terminate(rt)
        rt.state = ShardState.STOPPED
        rt.failure_class = FailureClass.NONE
        rt.message = "stopped by the agent"
        rt.requests_running = rt.requests_waiting = rt.cache_tokens = None
        logger.info("shard %s stopped (%s)", rt.spec.shard_id, exit_words(rt.exit_code))
        self._changed()

    async def _terminate(self, rt: ShardRuntime) -> None:
        """Ask the engine to stop; kill it if it outlives the grace."""
        handle = rt.handle
        if handle is None or handle.exited():
            if handle is not None:
                rt.exit_code = handle.poll()
            return
        handle.terminate()
        if not await self._wait_exit(handle, self.config.stop_grace):
            logger.warning(
                "shard %s ignored SIGTERM for %gs: SIGKILL",
                rt.spec.shard_id,
                self.config.stop_grace,
            )
            handle.kill()
            await self._wait_exit(handle, None)
        rt.exit_code = handle.poll()

    async def _wait_exit(self, handle: ProcessHandle, within: float | None) -> bool:
        """Poll for the exit: a process has no awaitable end that survives an agent restart."""
        deadline = None if within is None else self.clock() + within
        while not handle.exited():
            if deadline is not None and self.clock() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    def _exited(self, rt: ShardRuntime) -> None:
        assert rt.handle is not None
        code = rt.handle.poll()
        tail = read_log_tail(rt.log_path)
        failure = classify_failure(code, tail)
        self._fail(rt, failure, f"{exit_words(code)} while it should run", exit_code=code)

    def _fail(
        self,
        rt: ShardRuntime,
        failure: FailureClass,
        message: str,
        *,
        exit_code: int | None = None,
    ) -> None:
        rt.state = ShardState.FAILED
        rt.failure_class = failure
        rt.message = message
        if exit_code is not None:
            rt.exit_code = exit_code  # else keep what _terminate recorded, if anything
        rt.requests_running = rt.requests_waiting = rt.cache_tokens = None
        logger.error(
            "shard %s failed (%s): %s", rt.spec.shard_id, failure.value or "unknown", message
        )
        self._changed()

    # ----------------------------------------------------------------------- reporting

    def _changed(self) -> None:
        self.changed.set()

    def status(self) -> Status:
        return Status(
            observed_revision=self.desired.revision if self.desired else 0,
            observed_epoch=self.highest_epoch,
            shards=tuple(self.shards[k].to_status() for k in sorted(self.shards)),
            gpus=self.gpus.read(),
            weights=tuple(self.weights[k] for k in sorted(self.weights)),
            stale_rejected=self.stale_rejected,
        )

    # ----------------------------------------------------------------------- adoption

    def _state_path(self) -> Path:
        return self.config.state_dir / adoption.STATE_FILE

    def _save_state(self) -> None:
        """Record live engines and the highest epoch, for the next agent on this node."""
        live = []
        for rt in self.shards.values():
            if rt.handle is None or rt.state in FINISHED:
                continue
            mark = rt.handle.mark()
            if mark is not None:
                live.append(adoption.SavedShard(rt.spec, mark))
        adoption.save(self._state_path(), self.highest_epoch, live)

    def recover(self) -> None:
        """Adopt the shards a previous agent left running, and remember its highest epoch."""
        saved = adoption.load(self._state_path())
        self.highest_epoch = max(self.highest_epoch, saved.highest_epoch)
        for entry in saved.shards:
            spec, pid = entry.spec, entry.mark.pid
            handle = AdoptedProcess.find(entry.mark)
            if handle is None:
                logger.info("shard %s (pid %s) is gone since the last agent", spec.shard_id, pid)
                continue
            rt = self._new_runtime(spec, fingerprint(spec))
            rt.state, rt.handle = ShardState.STARTING, handle
            rt.task = asyncio.create_task(self._run(rt, None))
            logger.info(
                "adopted shard %s (pid %s, port %s) left running by a previous agent",
                spec.shard_id,
                pid,
                spec.port,
            )
        self._changed()

    # ----------------------------------------------------------------------- shutdown

    async def shutdown(self, *, leave_running: bool) -> None:
        """Stop every shard (or leave them running for the next agent), then return."""
        self._closing = True
        tasks = [rt.task for rt in self.shards.values() if rt.task is not None]
        if leave_running:
            self._save_state()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            live = sum(1 for rt in self.shards.values() if rt.state not in FINISHED)
            logger.info("leaving %d shard(s) running for the next agent", live)
        else:
            for rt in self.shards.values():
                rt.request(Want.STOP)
            await asyncio.gather(*tasks, return_exceptions=True)
            self._save_state()
        await self.janitor.close()
        await self._http.aclose()


def _auth(rt: ShardRuntime) -> dict[str, str]:
    """The engine's key on the agent's own polls (llama.cpp's readiness path is under /v1)."""
    return {"Authorization": f"Bearer {rt.spec.api_key}"} if rt.spec.api_key else {}
