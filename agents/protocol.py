"""The agent protocol: every message an agent and the control plane exchange, defined once.

Both sides import this module (the agent has no Django; the control plane's session logic and
its transports do), so a field cannot mean one thing on one side and another on the other.

Wire format: one JSON object per WebSocket text frame, ``{"type": ..., "v": 1, ...fields}``;
over gRPC, the same fields in the frames of ``agents/agent.proto`` (:mod:`agents.grpc_wire`
turns one into the other, and a test proves the schema equal to this module field for field).
``v`` is the protocol version on every message; a peer speaking another version is refused
with :attr:`CloseCode.PROTOCOL_VERSION` before anything else is read. Within a version,
fields may be added (a reader ignores fields it does not know) but never removed or re-typed.

Agent → control plane: :class:`Hello` (once, first), :class:`Status` (on every change, and as
a periodic full report), :class:`Heartbeat` (in between).
Control plane → agent: :class:`Welcome` (the answer to hello), :class:`DesiredState` (the
node's *full* desired state, never a delta), :class:`ErrorMessage` (before a close).

Decoding validates every field and raises :class:`ProtocolError` with a message that names
the field (``shards[2].port must be an integer from 1 to 65535``) and the close code the
transport should use; it never raises anything else for any input.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from typing import Any, Final, TypeVar

PROTOCOL_VERSION: Final = 1
# The largest message either side accepts. A full desired state for a node with dozens of
# shards is a few tens of KiB; the web server's own frame limit (1 MiB) bounds memory first.
MAX_MESSAGE_BYTES: Final = 512 * 1024
# Where the control plane serves agent streams, and the header an agent names itself with
# (checked against its token at the handshake, so a node cannot claim another's name).
STREAM_PATH: Final = "/agents/stream"
NODE_HEADER: Final = "X-Llmgw-Node"
TOKEN_PREFIX: Final = "llmgw_node_"  # noqa: S105 - the visible prefix, not a secret

# Leader epochs rise by one per change of leader; no real cluster comes near this.
MAX_EPOCH: Final = 2**53
LOG_TAIL_MAX_LINES: Final = 50
LOG_LINE_MAX_CHARS: Final = 1000


class CloseCode(IntEnum):
    """WebSocket close codes; 4xxx mirror the HTTP status a human would expect.

    Applications may only send 1000 and 3000-4999 (RFC 6455 7.4.2; Daphne's WebSocket
    library enforces it), so even "too big" and "binary" get 4xxx codes here. 1009 is still
    what a peer sees when a frame exceeds the *transport's* own limit.
    """

    NORMAL = 1000
    GOING_AWAY = 1001
    SERVICE_RESTART = 1012  # the control plane's process is stopping: reconnect now, elsewhere
    MALFORMED = 4400
    UNAUTHORIZED = 4401  # token missing, wrong or revoked
    FORBIDDEN = 4403  # the hello names another node than the token's
    HELLO_TIMEOUT = 4408
    REPLACED = 4409  # a newer connection of the same node took over
    TOO_BIG = 4413
    RATE_LIMITED = 4429  # more messages than the control plane accepts from one stream
    UNSUPPORTED_DATA = 4415  # a binary frame: the protocol is JSON text only
    PROTOCOL_VERSION = 4426
    STORE_UNAVAILABLE = 4503  # the control plane cannot serve now (store down); retry later


class ProtocolError(Exception):
    """A message that cannot be accepted, with the close code that says why."""

    def __init__(self, code: CloseCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class ShardState(StrEnum):
    """A shard's observed lifecycle (the same words as ``control.models.Replica.Observed``)."""

    PENDING = "pending"
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"


class DesiredShardState(StrEnum):
    RUNNING = "running"
    DRAINING = "draining"
    STOPPED = "stopped"


class FailureClass(StrEnum):
    """Why a shard failed (the same values as ``control.models.FailureClass``)."""

    NONE = ""
    OOM = "oom"
    BAD_ARGS = "bad_args"
    DOWNLOAD = "download"
    CRASH = "crash"
    HEALTH_TIMEOUT = "health_timeout"


class Engine(StrEnum):
    VLLM = "vllm"
    SGLANG = "sglang"
    LLAMACPP = "llamacpp"
    SIM = "sim"


class WeightsState(StrEnum):
    PRESENT = "present"
    ABSENT = "absent"
    REMOVED = "removed"
    REFUSED = "refused"  # asked to remove, but a shard still uses them


# --------------------------------------------------------------------------- validation


class _Fields:
    """Typed reads from one JSON object; every failure names the field by its full path."""

    def __init__(self, raw: object, path: str) -> None:
        if not isinstance(raw, dict):
            raise ProtocolError(CloseCode.MALFORMED, f"{path or 'message'} must be an object")
        self.raw: dict[str, Any] = raw
        self.path = path

    def _name(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def _get(self, key: str, default: Any) -> Any:
        if key in self.raw:
            return self.raw[key]
        if default is _REQUIRED:
            raise ProtocolError(CloseCode.MALFORMED, f"{self._name(key)} is required")
        return default

    def text(self, key: str, default: Any = None, *, max_len: int = 500) -> str:
        value = self._get(key, _REQUIRED if default is None else default)
        if not isinstance(value, str):
            raise ProtocolError(CloseCode.MALFORMED, f"{self._name(key)} must be a string")
        if len(value) > max_len:
            raise ProtocolError(
                CloseCode.MALFORMED, f"{self._name(key)} is longer than {max_len} characters"
            )
        return value

    def integer(self, key: str, default: Any = None, *, low: int = 0, high: int = 2**63 - 1) -> int:
        value = self._get(key, _REQUIRED if default is None else default)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ProtocolError(
                CloseCode.MALFORMED, f"{self._name(key)} must be an integer from {low} to {high}"
            )
        return value

    def opt_integer(self, key: str, *, low: int = -(2**31), high: int = 2**31 - 1) -> int | None:
        if self.raw.get(key) is None:
            return None
        return self.integer(key, low=low, high=high)

    def number(self, key: str, default: Any = None, *, low: float = 0.0) -> float:
        value = self._get(key, _REQUIRED if default is None else default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not value >= low:
            raise ProtocolError(
                CloseCode.MALFORMED, f"{self._name(key)} must be a number of at least {low:g}"
            )
        return float(value)

    def choice(self, key: str, kind: type[_E], default: Any = None) -> _E:
        value = self.text(key, default, max_len=50)
        try:
            return kind(value)
        except ValueError:
            allowed = ", ".join(repr(str(v.value)) for v in kind)
            raise ProtocolError(
                CloseCode.MALFORMED, f"{self._name(key)} must be one of {allowed}"
            ) from None

    def items(self, key: str, *, max_items: int = 1000) -> list[Any]:
        value = self._get(key, [])
        if not isinstance(value, list):
            raise ProtocolError(CloseCode.MALFORMED, f"{self._name(key)} must be a list")
        if len(value) > max_items:
            raise ProtocolError(
                CloseCode.MALFORMED, f"{self._name(key)} has more than {max_items} items"
            )
        return value

    def objects(self, key: str, *, max_items: int = 1000) -> list[_Fields]:
        return [
            _Fields(item, f"{self._name(key)}[{i}]")
            for i, item in enumerate(self.items(key, max_items=max_items))
        ]

    def texts(self, key: str, *, max_items: int = 1000, max_len: int = 500) -> tuple[str, ...]:
        items = self.items(key, max_items=max_items)
        for i, item in enumerate(items):
            if not isinstance(item, str) or len(item) > max_len:
                raise ProtocolError(
                    CloseCode.MALFORMED,
                    f"{self._name(key)}[{i}] must be a string of at most {max_len} characters",
                )
        return tuple(items)

    def integers(self, key: str, *, low: int = 0, high: int = 1023) -> tuple[int, ...]:
        items = self.items(key, max_items=high - low + 1)
        for i, item in enumerate(items):
            if isinstance(item, bool) or not isinstance(item, int) or not low <= item <= high:
                raise ProtocolError(
                    CloseCode.MALFORMED,
                    f"{self._name(key)}[{i}] must be an integer from {low} to {high}",
                )
        return tuple(items)

    def text_map(self, key: str) -> dict[str, str]:
        value = self._get(key, {})
        if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()
        ):
            raise ProtocolError(
                CloseCode.MALFORMED, f"{self._name(key)} must be an object of strings"
            )
        return dict(value)


_REQUIRED: Final = object()
_E = TypeVar("_E", bound=StrEnum)

# A weights name is a relative path under the agent's weights directory; nothing that could
# climb out of it (``..``, absolute paths, backslashes, NUL) is ever accepted.
_WEIGHTS_NAME = re.compile(r"^(?!/)(?!.*(?:^|/)\.\.?(?:/|$))[A-Za-z0-9._\-/]{1,300}$")
_NODE_NAME = re.compile(r"^[A-Za-z0-9_-]{1,100}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,200}$")


def valid_weights_name(name: str) -> bool:
    return bool(_WEIGHTS_NAME.match(name)) and "//" not in name


_HOST_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


def address_problem(address: str) -> str | None:
    """Why a node address cannot be used to reach its engines, or None: it must be a bare IP
    address or host name. Nothing with a scheme, port, path, user or query (the gateway builds
    engine URLs from it), and no numeric form but the canonical one (``2852039166`` and
    ``0xa9fea9fe`` are 169.254.169.254 to a resolver)."""
    if not address or len(address) > 253:
        return "must be 1-253 characters"
    try:
        ipaddress.ip_address(address)
    except ValueError:
        pass
    else:
        return None
    labels = address.rstrip(".").split(".")
    if not all(_HOST_LABEL.match(label) for label in labels):
        return "must be a bare IP address or host name (no scheme, port or path)"
    if labels[-1].isdigit() or labels[-1].lower().startswith("0x"):
        return "must be a canonical IP address (dotted decimal) or a host name"
    return None


def valid_node_name(name: str) -> bool:
    """The node names Django's ``SlugField`` (``Node.name``) accepts."""
    return bool(_NODE_NAME.match(name))


# --------------------------------------------------------------------------- messages


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
    def from_fields(cls, f: _Fields) -> GpuInfo:
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
    def from_fields(cls, f: _Fields) -> Hello:
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
            "pid": self.pid,
        }

    @classmethod
    def from_fields(cls, f: _Fields) -> ShardStatus:
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
    def from_fields(cls, f: _Fields) -> WeightsReport:
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
    def from_fields(cls, f: _Fields) -> Status:
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
    def from_fields(cls, f: _Fields) -> Heartbeat:
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
    def from_fields(cls, f: _Fields) -> Welcome:
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
        return cls.from_fields(_Fields(raw, "shard"))

    @classmethod
    def from_fields(cls, f: _Fields) -> DesiredShard:
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
    def from_fields(cls, f: _Fields) -> DesiredState:
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
    def from_fields(cls, f: _Fields) -> ErrorMessage:
        return cls(
            code=f.integer("code", 0, high=4999), message=f.text("message", "", max_len=2000)
        )


AgentMessage = Hello | Status | Heartbeat | ErrorMessage
ServerMessage = Welcome | DesiredState | ErrorMessage
Message = Hello | Status | Heartbeat | Welcome | DesiredState | ErrorMessage

_AGENT_TYPES: Final[dict[str, Any]] = {
    Hello.TYPE: Hello,
    Status.TYPE: Status,
    Heartbeat.TYPE: Heartbeat,
    ErrorMessage.TYPE: ErrorMessage,
}
_SERVER_TYPES: Final[dict[str, Any]] = {
    Welcome.TYPE: Welcome,
    DesiredState.TYPE: DesiredState,
    ErrorMessage.TYPE: ErrorMessage,
}


def encode(message: Message) -> str:
    """One message as the text of one frame."""
    body = {"type": message.TYPE, "v": PROTOCOL_VERSION}
    body.update(message.to_dict())
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False)


def _envelope(data: str | bytes | None) -> _Fields:
    if data is None:
        raise ProtocolError(CloseCode.MALFORMED, "empty frame")
    if isinstance(data, bytes | bytearray):
        raise ProtocolError(
            CloseCode.UNSUPPORTED_DATA, "binary frames are not part of the protocol; send JSON text"
        )
    # Characters, not bytes, for speed; a character is at most four bytes, and the transport
    # has already bounded the frame in bytes.
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(
            CloseCode.TOO_BIG, f"message larger than {MAX_MESSAGE_BYTES} bytes refused"
        )
    try:
        raw = json.loads(data)
    except ValueError as exc:
        raise ProtocolError(CloseCode.MALFORMED, f"not JSON: {exc}") from None
    except RecursionError:
        raise ProtocolError(CloseCode.MALFORMED, "not JSON: nested too deeply") from None
    fields = _Fields(raw, "")
    version = fields.raw.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            CloseCode.PROTOCOL_VERSION,
            f"protocol version {version!r} is not supported; this peer speaks "
            f"version {PROTOCOL_VERSION}",
        )
    return fields


def _decode(data: str | bytes | None, types: Mapping[str, Any], side: str) -> Any:
    fields = _envelope(data)
    kind = fields.raw.get("type")
    cls = types.get(kind) if isinstance(kind, str) else None
    if cls is None:
        known = ", ".join(sorted(types))
        raise ProtocolError(
            CloseCode.MALFORMED, f"unknown message type {kind!r} from {side}; expected {known}"
        )
    try:
        return cls.from_fields(fields)
    except ProtocolError as exc:
        raise ProtocolError(exc.code, f"{kind}: {exc.message}") from None


def decode_agent_message(data: str | bytes | None) -> AgentMessage:
    """Parse and validate a frame an agent sent; raises :class:`ProtocolError` only."""
    message: AgentMessage = _decode(data, _AGENT_TYPES, "an agent")
    return message


def decode_server_message(data: str | bytes | None) -> ServerMessage:
    """Parse and validate a frame the control plane sent; raises :class:`ProtocolError` only."""
    message: ServerMessage = _decode(data, _SERVER_TYPES, "the control plane")
    return message
