"""The shard supervisor: converges the engine processes on this node to the desired state.

Level-triggered: :meth:`Supervisor.apply` takes the node's *full* desired state and
:meth:`Supervisor.converge` compares it with what runs, so a snapshot applied twice changes
nothing the second time and a lost snapshot is repaired by the next one.

Each running shard has one lifecycle task: spawn → poll health until ready (or the start-up
deadline) → poll engine load while ready → drain (wait for in-flight requests, bounded) → stop
(SIGTERM to the process group, SIGKILL after a grace). A shard that exits on its own is failed
with a class read from its exit code and log. Processes are plain ``Popen`` children in their
own session, watched by polling: an agent that exits with ``--leave-shards-running`` leaves
them untouched (asyncio's subprocess transports would kill them on close), and the state file
lets the next agent adopt them instead of starting duplicates.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Final, Protocol

import httpx

from agents.engines import (
    LaunchContext,
    RecipeError,
    classify_failure,
    health_path,
    launch,
    parse_load,
    source_path,
    weights_overlap,
    weights_path,
)
from agents.gpus import GpuSource
from agents.protocol import (
    LOG_LINE_MAX_CHARS,
    DesiredShard,
    DesiredShardState,
    DesiredState,
    FailureClass,
    ShardState,
    ShardStatus,
    Status,
    WeightsReport,
    WeightsState,
)

logger = logging.getLogger(__name__)

LOG_TAIL_LINES: Final = 20
STATE_FILE: Final = "shards.json"
_FINISHED: Final = frozenset({ShardState.STOPPED, ShardState.FAILED, ShardState.PENDING})


class Want(StrEnum):
    """What the lifecycle task is asked to do next (set by converge, read by the task)."""

    RUN = "run"
    DRAIN = "drain"
    STOP = "stop"


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


class ProcessHandle(Protocol):
    pid: int

    def poll(self) -> int | None:
        """The exit code once the process has ended (None while it runs or when unknown)."""

    def exited(self) -> bool: ...

    def signal_group(self, signum: int) -> None: ...


class ChildProcess:
    """A shard this agent started."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.popen = popen
        self.pid = popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()

    def exited(self) -> bool:
        return self.popen.poll() is not None

    def signal_group(self, signum: int) -> None:
        # The shard leads its own process group, so engines' workers get the signal too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signum)


class AdoptedProcess:
    """A shard a previous agent started and left running; not our child, so no exit code."""

    def __init__(self, pid: int, start_ticks: str) -> None:
        self.pid = pid
        self.start_ticks = start_ticks

    def poll(self) -> int | None:
        return None

    def exited(self) -> bool:
        return process_start_ticks(self.pid) != self.start_ticks

    def signal_group(self, signum: int) -> None:
        if not self.exited():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signum)


def process_start_ticks(pid: int) -> str | None:
    """When a process started (clock ticks since boot), to tell it from a later one that
    reused its pid. None when it is gone (or this is not Linux)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses; fields after it are plain.
    fields = stat.rpartition(")")[2].split()
    if len(fields) < 20 or fields[0] == "Z":  # a zombie has exited already
        return None
    return fields[19]


def fingerprint(spec: DesiredShard) -> str:
    """What identifies one incarnation: a change here means stop the old process and start
    anew. Timeouts, the health path and the desired state change in place."""
    identity = {
        k: v
        for k, v in spec.to_dict().items()
        if k not in ("state", "health_path", "startup_timeout_s", "drain_timeout_s")
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def read_log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> tuple[str, ...]:
    try:
        with path.open("rb") as log:
            log.seek(0, os.SEEK_END)
            size = log.tell()
            log.seek(max(0, size - 16 * 1024))
            data = log.read()
    except OSError:
        return ()
    text = data.decode("utf-8", errors="replace").splitlines()
    if size > 16 * 1024 and text:
        text = text[1:]  # the first line was cut by the seek
    return tuple(line[:LOG_LINE_MAX_CHARS] for line in text[-lines:])


def _exit_words(code: int | None) -> str:
    if code is None:
        return "exited (code unknown: started by a previous agent)"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


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
    task: asyncio.Task[None] | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def finished(self) -> bool:
        return self.state in _FINISHED and (self.task is None or self.task.done())

    def request(self, want: Want) -> None:
        # Stopping outranks draining outranks running: a drain in progress cannot be undone
        # (the engine may have refused new work), so a later "running" waits for the stop.
        order = [Want.RUN, Want.DRAIN, Want.STOP]
        if order.index(want) > order.index(self.want):
            self.want = want
            self.wake.set()

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
    ) -> None:
        self.config = config
        self.gpus = gpus
        self.base_env = dict(os.environ if base_env is None else base_env)
        self.clock = clock
        self.shards: dict[int, ShardRuntime] = {}
        self.desired: DesiredState | None = None
        self.highest_epoch = 0
        self.stale_rejected = 0
        self.weights: dict[str, WeightsReport] = {}
        self.changed = asyncio.Event()
        self.starts = 0  # processes spawned by this agent, for logs and tests
        self._weights_task: asyncio.Task[None] | None = None
        self._closing = False
        self._http = httpx.AsyncClient(timeout=config.health_timeout, trust_env=False)
        (config.state_dir / "logs").mkdir(parents=True, exist_ok=True)

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
        """Start, drain or stop shards until what runs matches the desired state."""
        if self.desired is None:
            return  # nothing is stopped before the control plane has said what it wants
        wanted = {s.shard_id: s for s in self.desired.shards}
        for shard_id, spec in wanted.items():
            rt = self.shards.get(shard_id)
            fp = fingerprint(spec)
            if rt is not None and rt.fingerprint == fp:
                rt.spec = spec  # timeouts and the health path update in place
            if spec.state is DesiredShardState.RUNNING:
                if rt is None:
                    self._start(spec, fp)
                elif rt.finished:
                    # A failed incarnation stays failed until the control plane asks again
                    # with a new generation (its backoff, not ours); a stopped one restarts.
                    if rt.fingerprint != fp or rt.state is not ShardState.FAILED:
                        self._start(spec, fp)
                elif rt.fingerprint != fp:
                    logger.info("shard %s changed: restarting it", shard_id)
                    rt.request(Want.STOP)
            elif spec.state is DesiredShardState.DRAINING:
                if rt is None:
                    self._record_stopped(spec, fp)
                elif not rt.finished:
                    rt.request(Want.DRAIN)
            elif rt is None:
                self._record_stopped(spec, fp)
            elif not rt.finished:
                rt.request(Want.STOP)
        for shard_id, rt in list(self.shards.items()):
            if shard_id in wanted:
                continue
            if rt.finished:
                del self.shards[shard_id]  # no longer wanted, nothing running: forget it
                self._changed()
            elif rt.want is not Want.STOP:
                logger.info("shard %s is not in the desired state: stopping it", shard_id)
                rt.request(Want.STOP)
        if self.desired.remove_weights and (
            self._weights_task is None or self._weights_task.done()
        ):
            self._weights_task = asyncio.create_task(self._remove_weights())
        elif not self.desired.remove_weights:
            self.weights.clear()

    def _record_stopped(self, spec: DesiredShard, fp: str) -> None:
        self.shards[spec.shard_id] = ShardRuntime(
            spec=spec, fingerprint=fp, log_path=self._log_path(spec), state=ShardState.STOPPED
        )

    def _log_path(self, spec: DesiredShard) -> Path:
        return self.config.state_dir / "logs" / f"shard-{spec.shard_id}.log"

    # ----------------------------------------------------------------------- starting

    def _refuse(self, spec: DesiredShard) -> str:
        """Why this node cannot run the shard as specified, or ''."""
        low, high = self.config.port_range
        if not low <= spec.port <= high:
            return f"port {spec.port} is outside this agent's port range {low}-{high}"
        for other in self.shards.values():
            busy = other.spec.shard_id != spec.shard_id and not other.finished
            if busy and other.spec.port == spec.port:
                return f"port {spec.port} is already used by shard {other.spec.shard_id}"
        known = {g.index for g in self.gpus.read()}
        missing = [i for i in spec.gpu_indices if i not in known]
        if missing:
            have = ",".join(str(i) for i in sorted(known)) or "none"
            return f"GPU(s) {missing} do not exist on this node (it has {have})"
        return ""

    def _start(self, spec: DesiredShard, fp: str) -> None:
        rt = ShardRuntime(spec=spec, fingerprint=fp, log_path=self._log_path(spec))
        self.shards[spec.shard_id] = rt
        reason = self._refuse(spec)
        plan = None
        if not reason:
            try:
                plan = launch(spec, self.config.launch, self.base_env)
            except RecipeError as exc:
                reason = str(exc)
        if plan is None:
            logger.error("shard %s cannot start: %s", spec.shard_id, reason)
            self._fail(rt, FailureClass.BAD_ARGS, reason, exit_code=None)
            return
        rt.state = ShardState.STARTING
        rt.task = asyncio.create_task(self._run(rt, plan.argv, plan.env))
        self._changed()

    def _spawn(self, rt: ShardRuntime, argv: tuple[str, ...], env: Mapping[str, str]) -> None:
        rt.log_path.parent.mkdir(parents=True, exist_ok=True)
        with rt.log_path.open("wb") as log:
            popen = subprocess.Popen(  # noqa: S603 - argv from a recipe, no shell
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(env),
                cwd=self.config.state_dir,
                # Its own session: a signal to the agent's terminal or group does not reach
                # it, and the agent can signal the engine's whole process tree at once.
                start_new_session=True,
            )
        rt.handle = ChildProcess(popen)
        self.starts += 1
        logger.info(
            "shard %s (replica %s, %s %s) started: pid %s, port %s, gpus [%s], log %s",
            rt.spec.shard_id,
            rt.spec.replica_id,
            rt.spec.engine.value,
            rt.spec.model,
            popen.pid,
            rt.spec.port,
            ",".join(map(str, rt.spec.gpu_indices)),
            rt.log_path,
        )

    # ----------------------------------------------------------------------- lifecycle

    async def _run(
        self, rt: ShardRuntime, argv: tuple[str, ...] | None, env: Mapping[str, str] | None
    ) -> None:
        try:
            if argv is not None and env is not None:
                try:
                    await asyncio.to_thread(self._spawn, rt, argv, env)
                except OSError as exc:
                    self._fail(rt, FailureClass.BAD_ARGS, f"cannot execute {argv[0]}: {exc}")
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
            response = await self._http.get(self._url(rt, "/metrics"))
        except httpx.HTTPError:
            return None
        load = parse_load(response.text) if response.status_code == 200 else None
        running = None if load is None else load.running
        waiting = None if load is None else load.waiting
        if (running, waiting) != (rt.requests_running, rt.requests_waiting):
            rt.requests_running, rt.requests_waiting = running, waiting
        return None if load is None else load.running + load.waiting

    def _url(self, rt: ShardRuntime, path: str) -> str:
        host = self.config.launch.host
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)  # noqa: S104
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{rt.spec.port}{path}"

    async def _healthy(self, rt: ShardRuntime) -> bool:
        try:
            response = await self._http.get(self._url(rt, health_path(rt.spec)))
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def _stop(self, rt: ShardRuntime) -> None:
        await self._terminate(rt)
        rt.state = ShardState.STOPPED
        rt.failure_class = FailureClass.NONE
        rt.message = "stopped by the agent"
        rt.requests_running = rt.requests_waiting = None
        logger.info("shard %s stopped (%s)", rt.spec.shard_id, _exit_words(rt.exit_code))
        self._changed()

    async def _terminate(self, rt: ShardRuntime) -> None:
        """SIGTERM the shard's process group; SIGKILL it if it outlives the grace."""
        handle = rt.handle
        if handle is None or handle.exited():
            if handle is not None:
                rt.exit_code = handle.poll()
            return
        handle.signal_group(signal.SIGTERM)
        if not await self._wait_exit(handle, self.config.stop_grace):
            logger.warning(
                "shard %s ignored SIGTERM for %gs: SIGKILL",
                rt.spec.shard_id,
                self.config.stop_grace,
            )
            handle.signal_group(signal.SIGKILL)
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
        self._fail(rt, failure, f"{_exit_words(code)} while it should run", exit_code=code)

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
        rt.requests_running = rt.requests_waiting = None
        logger.error(
            "shard %s failed (%s): %s", rt.spec.shard_id, failure.value or "unknown", message
        )
        self._changed()

    # ----------------------------------------------------------------------- weights

    def _weights_users(self, target: Path) -> list[int]:
        """Shards that use (or are about to use) files under ``target``."""
        users: set[int] = set()
        weights_dir = self.config.launch.weights_dir
        for rt in self.shards.values():
            if not rt.finished and weights_overlap(
                source_path(rt.spec.source, weights_dir), target
            ):
                users.add(rt.spec.shard_id)
        for spec in self.desired.shards if self.desired else ():
            if spec.state is DesiredShardState.RUNNING and weights_overlap(
                source_path(spec.source, weights_dir), target
            ):
                users.add(spec.shard_id)
        return sorted(users)

    async def _remove_weights(self) -> None:
        assert self.desired is not None
        reports: dict[str, WeightsReport] = {}
        for name in self.desired.remove_weights:
            target = weights_path(name, self.config.launch.weights_dir)
            if target is None:
                reports[name] = WeightsReport(
                    name, WeightsState.REFUSED, "outside the weights directory"
                )
                continue
            users = self._weights_users(target)
            if not target.exists():
                previous = self.weights.get(name)
                done = previous is not None and previous.state is WeightsState.REMOVED
                reports[name] = (
                    previous
                    if done and previous
                    else WeightsReport(name, WeightsState.ABSENT, "not on this node")
                )
            elif users:
                message = (
                    f"refused: in use by shard(s) {', '.join(map(str, users))}; "
                    "they must stop before their weights are removed"
                )
                if self.weights.get(name) != WeightsReport(name, WeightsState.REFUSED, message):
                    logger.warning("weights %s: %s", name, message)
                reports[name] = WeightsReport(name, WeightsState.REFUSED, message)
            else:
                try:
                    await asyncio.to_thread(_remove_path, target)
                except OSError as exc:
                    reports[name] = WeightsReport(
                        name, WeightsState.REFUSED, f"cannot remove: {exc}"
                    )
                    logger.error("weights %s: cannot remove: %s", name, exc)
                else:
                    logger.info("weights %s removed (%s)", name, target)
                    reports[name] = WeightsReport(name, WeightsState.REMOVED, str(target))
        if reports != self.weights:
            self.weights = reports
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

    # ----------------------------------------------------------------------- persistence

    def _state_path(self) -> Path:
        return self.config.state_dir / STATE_FILE

    def _save_state(self) -> None:
        """Record live processes and the highest epoch, for the next agent on this node."""
        live = []
        for rt in self.shards.values():
            if rt.handle is None or rt.state in _FINISHED:
                continue
            start = process_start_ticks(rt.handle.pid)
            if start is None:
                continue
            live.append({"spec": rt.spec.to_dict(), "pid": rt.handle.pid, "start": start})
        data = {"highest_epoch": self.highest_epoch, "shards": live}
        path = self._state_path()
        tmp = path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(data, indent=1))
            tmp.replace(path)
        except OSError as exc:
            logger.warning("cannot write %s: %s", path, exc)

    def recover(self) -> None:
        """Adopt the shards a previous agent left running, and remember its highest epoch."""
        path = self._state_path()
        try:
            data: Any = json.loads(path.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            logger.warning("ignoring unreadable %s: %s", path, exc)
            return
        if not isinstance(data, dict):
            return
        epoch = data.get("highest_epoch")
        if isinstance(epoch, int) and epoch >= 0:
            self.highest_epoch = epoch
        for entry in data.get("shards") or []:
            try:
                spec = DesiredShard.from_dict(entry.get("spec"))
                pid, start = int(entry["pid"]), str(entry["start"])
            except Exception as exc:
                logger.warning("ignoring a shard in %s: %s", path, exc)
                continue
            if process_start_ticks(pid) != start:
                logger.info("shard %s (pid %s) is gone since the last agent", spec.shard_id, pid)
                continue
            rt = ShardRuntime(
                spec=spec,
                fingerprint=fingerprint(spec),
                log_path=self._log_path(spec),
                state=ShardState.STARTING,
                handle=AdoptedProcess(pid, start),
            )
            self.shards[spec.shard_id] = rt
            rt.task = asyncio.create_task(self._run(rt, None, None))
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
            live = sum(1 for rt in self.shards.values() if rt.state not in _FINISHED)
            logger.info("leaving %d shard(s) running for the next agent", live)
        else:
            for rt in self.shards.values():
                rt.request(Want.STOP)
            await asyncio.gather(*tasks, return_exceptions=True)
            self._save_state()
        if self._weights_task is not None:
            self._weights_task.cancel()
            await asyncio.gather(self._weights_task, return_exceptions=True)
        await self._http.aclose()


def _remove_path(target: Path) -> None:
    if target.is_dir() and not target.is_symlink():
        shutil.rmtree(target)
    else:
        target.unlink()
