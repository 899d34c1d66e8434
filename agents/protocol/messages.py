"""Every message of the agent protocol, each a frozen dataclass that turns itself into the
fields of a frame (``to_dict``) and is read back from them with every field checked
(``from_fields``).

Agent → control plane: :class:`Hello`, :class:`Status` (with :class:`ShardStatus`,
:class:`GpuInfo` and :class:`WeightsReport`), :class:`Heartbeat`. Control plane → agent:
:class:`Welcome`, :class:`DesiredState` (with :class:`DesiredShard`). Both:
:class:`ErrorMessage`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from agents.protocol.fields import Fields
from agents.protocol.names import address_problem, valid_node_name, valid_weights_name
from agents.protocol.vocabulary import (
    LOG_LINE_MAX_CHARS,
    LOG_TAIL_MAX_LINES,
    MAX_ENGINE_COUNT,
    MAX_EPOCH,
    PROTOCOL_VERSION,
    CloseCode,
    DesiredShardState,
    Engine,
    FailureClass,
    ProtocolError,
    ShardState,
    WeightsState,
)

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,200}$")


@dataclass(frozen=True)
class GpuInfo:
    """One device as the agent sees it (NVML, or a simulated one)."""

    index: int
    uuid: str
    model: str
    memory_total_mib: int
    memory_used_mib: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "uuid": self.uuid,
            "model": self.model,
            "memory_total_mib": self.memory_total_mib,
            "memory_used_mib": self.memory_used_mib,
        }

    @classmethod
    def from_fields(cls, f: Fields) -> GpuInfo:
        return cls(
            index=f.integer("index", high=1023),
            uuid=f.text("uuid", "", max_len=100),
            model=f.text("model", "", max_len=100),
            memory_total_mib=f.integer("memory_total_mib", 0, high=2**31 - 1),
            memory_used_mib=f.integer("memory_used_mib", 0, high=2**31 - 1),
        )


@dataclass(frozen=True)
class Hello:
    """The agent's first message: who it is, what it has, where it can be reached."""

    TYPE = "hello"

    node: str
    boot_id: str
    agent_version: str
    gpus: tuple[GpuInfo, ...] = ()
    addresses: tuple[str, ...] = ()
    port_range: tuple[int, int] | None = None
    # The highest leader epoch this agent has accepted (kept across its restarts): a leader
    # below it moves its lease above it before sending desired state, which would be refused.
    highest_epoch: int = 0
    protocol_version: int = PROTOCOL_VERSION

    def to_dict(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "boot_id": self.boot_id,
            "agent_version": self.agent_version,
            "gpus": [g.to_dict() for g in self.gpus],
            "addresses": list(self.addresses),
            "port_range": list(self.port_range) if self.port_range else None,
            "highest_epoch": self.highest_epoch,
        }

    @classmethod
    def from_fields(cls, f: Fields) -> Hello:
        node = f.text("node", max_len=100)
        if not valid_node_name(node):
            raise ProtocolError(
                CloseCode.MALFORMED, "node must be 1-100 letters, digits, '-' or '_'"
            )
        port_range = None
        raw_range = f.raw.get("port_range")
        if raw_range is not None:
            if (
                not isinstance(raw_range, list)
                or len(raw_range) != 2
                or not all(isinstance(p, int) and not isinstance(p, bool) for p in raw_range)
                or not 1 <= raw_range[0] <= raw_range[1] <= 65535
            ):
                raise ProtocolError(
                    CloseCode.MALFORMED, "port_range must be [low, high] with 1 <= low <= high"
                )
            port_range = (raw_range[0], raw_range[1])
        gpus = tuple(GpuInfo.from_fields(g) for g in f.objects("gpus", max_items=1024))
        if len({g.index for g in gpus}) != len(gpus):
            raise ProtocolError(CloseCode.MALFORMED, "gpus must not repeat an index")
        return cls(
            node=node,
            boot_id=f.text("boot_id", max_len=100),
            agent_version=f.text("agent_version", max_len=50),
            gpus=gpus,
            addresses=_addresses(f.texts("addresses", max_items=32, max_len=255)),
            port_range=port_range,
            # Bounded well below the column's limit, so moving the lease above it cannot
            # overflow; absent (an older agent) reads as "seen nothing".
            highest_epoch=f.integer("highest_epoch", 0, high=MAX_EPOCH),
        )


def _addresses(addresses: tuple[str, ...]) -> tuple[str, ...]:
    for i, address in enumerate(addresses):
        problem = address_problem(address)
        if problem is not None:
            raise ProtocolError(CloseCode.MALFORMED, f"addresses[{i}] {problem}")
    return addresses


@dataclass(frozen=True)
class ShardStatus:
    """What the agent observes about one shard it runs (or ran)."""

    shard_id: int
    replica_id: int
    generation: int
    state: ShardState
    port: int
    exit_code: int | None = None
    failure_class: FailureClass = FailureClass.NONE
    message: str = ""
    log_tail: tuple[str, ...] = ()
    # Engine load from its metrics; None when the engine does not publish them.
    requests_running: int | None = None
    requests_waiting: int | None = None
    # The engine's KV cache capacity in tokens, from its metrics (the gateway bounds what it
    # remembers of that cache by it); None when not published, or from an older agent.
    cache_tokens: int | None = None
    pid: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "shard_id": self.shard_id,
            "replica_id": self.replica_id,
            "generation": self.generation,
            "state": self.state.value,
            "port": self.port,
            "exit_code": self.exit_code,
            "failure_class": self.failure_class.value,
            "message": self.message,
            "log_tail": list(self.log_tail),
            "requests_running": self.requests_running,
            "requests_waiting": self.requests_waiting,
            "cache_tokens": self.cache_tokens,
            "pid": self.pid,
        }

    @classmethod
    def from_fields(cls, f: Fields) -> ShardStatus:
        return cls(
            shard_id=f.integer("shard_id", low=1),
            replica_id=f.integer("replica_id", low=1),
            generation=f.integer("generation", 0),
            state=f.choice("state", ShardState),
            port=f.integer("port", low=1, high=65535),
            exit_code=f.opt_integer("exit_code"),
            failure_class=f.choice("failure_class", FailureClass, ""),
            message=f.text("message", "", max_len=2000),
            log_tail=f.texts("log_tail", max_items=LOG_TAIL_MAX_LINES, max_len=LOG_LINE_MAX_CHARS),
            requests_running=f.opt_integer("requests_running", low=0),
            requests_waiting=f.opt_integer("requests_waiting", low=0),
            cache_tokens=f.opt_integer("cache_tokens", low=1, high=MAX_ENGINE_COUNT),
            pid=f.opt_integer("pid", low=1),
        )


@dataclass(frozen=True)
class WeightsReport:
    """The outcome of one ``remove_weights`` entry, so a refusal reaches the operator."""

    name: str
    state: WeightsState
    message: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "state": self.state.value, "message": self.message}

    @classmethod
    def from_fields(cls, f: Fields) -> WeightsReport:
        return cls(
            name=f.text("name", max_len=300),
            state=f.choice("state", WeightsState),
            message=f.text("message", "", max_len=2000),
        )


@dataclass(frozen=True)
class Status:
    """The agent's full observation: every shard it knows, its GPUs, and what it refused."""

    TYPE = "status"

    observed_revision: int
    observed_epoch: int
    shards: tuple[ShardStatus, ...] = ()
    gpus: tuple[GpuInfo, ...] = ()
    weights: tuple[WeightsReport, ...] = ()
    # Desired states refused because their epoch was lower than the highest seen (N7).
    stale_rejected: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "observed_revision": self.observed_revision,
            "observed_epoch": self.observed_epoch,
            "shards": [s.to_dict() for s in self.shards],
            "gpus": [g.to_dict() for g in self.gpus],
            "weights": [w.to_dict() for w in self.weights],
            "stale_rejected": self.stale_rejected,
        }

    @classmethod
    def from_fields(cls, f: Fields) -> Status:
        shards = tuple(ShardStatus.from_fields(s) for s in f.objects("shards"))
        if len({s.shard_id for s in shards}) != len(shards):
            raise ProtocolError(CloseCode.MALFORMED, "shards must not repeat a shard_id")
        return cls(
            observed_revision=f.integer("observed_revision", 0),
            observed_epoch=f.integer("observed_epoch", 0),
            shards=shards,
            gpus=tuple(GpuInfo.from_fields(g) for g in f.objects("gpus", max_items=1024)),
            weights=tuple(WeightsReport.from_fields(w) for w in f.objects("weights")),
            stale_rejected=f.integer("stale_rejected", 0),
        )


@dataclass(frozen=True)
class Heartbeat:
    """ "Still here" between status reports; the control plane records it coalesced."""

    TYPE = "heartbeat"

    seq: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"seq": self.seq}

    @classmethod
    def from_fields(cls, f: Fields) -> Heartbeat:
        return cls(seq=f.integer("seq", 0))


@dataclass(frozen=True)
class Welcome:
    """The control plane's answer to hello: the agent is registered, and how often to beat."""

    TYPE = "welcome"

    node: str
    heartbeat_interval: float
    server_version: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "heartbeat_interval": self.heartbeat_interval,
            "server_version": self.server_version,
        }

    @classmethod
    def from_fields(cls, f: Fields) -> Welcome:
        return cls(
            node=f.text("node", max_len=100),
            heartbeat_interval=f.number("heartbeat_interval", low=0.05),
            server_version=f.text("server_version", "", max_len=50),
        )


@dataclass(frozen=True)
class DesiredShard:
    """One shard the node should run, drain or stop, with everything needed to start it.

    ``args`` is the profile's template; the agent fills ``{model}``, ``{source}``, ``{port}``,
    ``{host}``, ``{rank}``, ``{world_size}``, ``{head_address}``, ``{head_port}``, ``{gpus}``
    and ``{weights_dir}`` in, because only it knows its own paths and bind address.
    ``generation`` rises when the control plane wants a failed shard started again.
    """

    shard_id: int
    replica_id: int
    generation: int
    state: DesiredShardState
    engine: Engine
    model: str
    source: str
    port: int
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    gpu_indices: tuple[int, ...] = ()
    rank: int = 0
    world_size: int = 1
    head_address: str = ""
    head_port: int = 0
    health_path: str = "/health"
    startup_timeout_s: float = 600.0
    drain_timeout_s: float = 60.0
    # The replica's engine API key: the engine refuses calls without it, and only the gateway
    # is given it, so nobody who merely reaches the node can call the engine directly.
    api_key: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "shard_id": self.shard_id,
            "replica_id": self.replica_id,
            "generation": self.generation,
            "state": self.state.value,
            "engine": self.engine.value,
            "model": self.model,
            "source": self.source,
            "port": self.port,
            "args": list(self.args),
            "env": dict(self.env),
            "gpu_indices": list(self.gpu_indices),
            "rank": self.rank,
            "world_size": self.world_size,
            "head_address": self.head_address,
            "head_port": self.head_port,
            "health_path": self.health_path,
            "startup_timeout_s": self.startup_timeout_s,
            "drain_timeout_s": self.drain_timeout_s,
            "api_key": self.api_key,
        }

    @classmethod
    def from_dict(cls, raw: object) -> DesiredShard:
        """Validate a shard read back from somewhere other than a frame (the state file)."""
        return cls.from_fields(Fields(raw, "shard"))

    @classmethod
    def from_fields(cls, f: Fields) -> DesiredShard:
        env = f.text_map("env")
        for name in env:
            if not _ENV_NAME.match(name):
                raise ProtocolError(
                    CloseCode.MALFORMED, f"{f.path}.env has an invalid variable name {name!r}"
                )
        health_path = f.text("health_path", "/health", max_len=200)
        if not health_path.startswith("/"):
            raise ProtocolError(CloseCode.MALFORMED, f"{f.path}.health_path must start with /")
        world_size = f.integer("world_size", 1, low=1, high=1024)
        rank = f.integer("rank", 0, high=1023)
        if rank >= world_size:
            raise ProtocolError(CloseCode.MALFORMED, f"{f.path}.rank must be below world_size")
        return cls(
            shard_id=f.integer("shard_id", low=1),
            replica_id=f.integer("replica_id", low=1),
            generation=f.integer("generation", 0),
            state=f.choice("state", DesiredShardState),
            engine=f.choice("engine", Engine),
            model=f.text("model", max_len=200),
            source=f.text("source", max_len=500),
            port=f.integer("port", low=1, high=65535),
            args=f.texts("args", max_items=500, max_len=4000),
            env=env,
            gpu_indices=f.integers("gpu_indices"),
            rank=rank,
            world_size=world_size,
            head_address=f.text("head_address", "", max_len=255),
            head_port=f.integer("head_port", 0, high=65535),
            health_path=health_path,
            startup_timeout_s=f.number("startup_timeout_s", 600.0, low=0.1),
            drain_timeout_s=f.number("drain_timeout_s", 60.0),
            api_key=f.text("api_key", "", max_len=200),
        )


@dataclass(frozen=True)
class DesiredState:
    """The node's complete desired state. A shard the agent runs that is not listed here is
    stopped; a snapshot delivered twice has the effect of one."""

    TYPE = "desired"

    node: str
    epoch: int
    revision: int
    shards: tuple[DesiredShard, ...] = ()
    remove_weights: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "epoch": self.epoch,
            "revision": self.revision,
            "shards": [s.to_dict() for s in self.shards],
            "remove_weights": list(self.remove_weights),
        }

    @classmethod
    def from_fields(cls, f: Fields) -> DesiredState:
        shards = tuple(DesiredShard.from_fields(s) for s in f.objects("shards"))
        if len({s.shard_id for s in shards}) != len(shards):
            raise ProtocolError(CloseCode.MALFORMED, "shards must not repeat a shard_id")
        remove = f.texts("remove_weights", max_items=1000, max_len=300)
        for name in remove:
            if not valid_weights_name(name):
                raise ProtocolError(
                    CloseCode.MALFORMED,
                    f"remove_weights entry {name!r} is not a relative path inside the "
                    "weights directory",
                )
        return cls(
            node=f.text("node", max_len=100),
            epoch=f.integer("epoch"),
            revision=f.integer("revision"),
            shards=shards,
            remove_weights=remove,
        )


@dataclass(frozen=True)
class ErrorMessage:
    """Why the sender is about to close (or what it ignored), for the other side's log."""

    TYPE = "error"

    code: int
    message: str

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message}

    @classmethod
    def from_fields(cls, f: Fields) -> ErrorMessage:
        return cls(
            code=f.integer("code", 0, high=4999), message=f.text("message", "", max_len=2000)
        )


AgentMessage = Hello | Status | Heartbeat | ErrorMessage
ServerMessage = Welcome | DesiredState | ErrorMessage
Message = Hello | Status | Heartbeat | Welcome | DesiredState | ErrorMessage
