"""The words both sides of the agent protocol share: its version, its limits, where agent
streams are served and how an agent names itself, the close codes and the one error a decoder
raises, and the states a shard can be in or be asked for."""

from __future__ import annotations

from enum import IntEnum, StrEnum
from typing import Final

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
# What an engine's gauges (requests running and waiting, its KV cache in tokens) travel as at
# most: a column's limit, far past any real engine; the agent clamps what it reads to it.
MAX_ENGINE_COUNT: Final = 2**31 - 1
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
