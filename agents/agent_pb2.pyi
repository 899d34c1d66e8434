from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GpuInfo(_message.Message):
    __slots__ = ("index", "uuid", "model", "memory_total_mib", "memory_used_mib")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_MIB_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_MIB_FIELD_NUMBER: _ClassVar[int]
    index: int
    uuid: str
    model: str
    memory_total_mib: int
    memory_used_mib: int
    def __init__(self, index: _Optional[int] = ..., uuid: _Optional[str] = ..., model: _Optional[str] = ..., memory_total_mib: _Optional[int] = ..., memory_used_mib: _Optional[int] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("node", "boot_id", "agent_version", "gpus", "addresses", "port_range", "highest_epoch")
    NODE_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    PORT_RANGE_FIELD_NUMBER: _ClassVar[int]
    HIGHEST_EPOCH_FIELD_NUMBER: _ClassVar[int]
    node: str
    boot_id: str
    agent_version: str
    gpus: _containers.RepeatedCompositeFieldContainer[GpuInfo]
    addresses: _containers.RepeatedScalarFieldContainer[str]
    port_range: _containers.RepeatedScalarFieldContainer[int]
    highest_epoch: int
    def __init__(self, node: _Optional[str] = ..., boot_id: _Optional[str] = ..., agent_version: _Optional[str] = ..., gpus: _Optional[_Iterable[_Union[GpuInfo, _Mapping]]] = ..., addresses: _Optional[_Iterable[str]] = ..., port_range: _Optional[_Iterable[int]] = ..., highest_epoch: _Optional[int] = ...) -> None: ...

class ShardStatus(_message.Message):
    __slots__ = ("shard_id", "replica_id", "generation", "state", "port", "exit_code", "failure_class", "message", "log_tail", "requests_running", "requests_waiting", "pid", "cache_tokens")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    FAILURE_CLASS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    LOG_TAIL_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_WAITING_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    CACHE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    shard_id: int
    replica_id: int
    generation: int
    state: str
    port: int
    exit_code: int
    failure_class: str
    message: str
    log_tail: _containers.RepeatedScalarFieldContainer[str]
    requests_running: int
    requests_waiting: int
    pid: int
    cache_tokens: int
    def __init__(self, shard_id: _Optional[int] = ..., replica_id: _Optional[int] = ..., generation: _Optional[int] = ..., state: _Optional[str] = ..., port: _Optional[int] = ..., exit_code: _Optional[int] = ..., failure_class: _Optional[str] = ..., message: _Optional[str] = ..., log_tail: _Optional[_Iterable[str]] = ..., requests_running: _Optional[int] = ..., requests_waiting: _Optional[int] = ..., pid: _Optional[int] = ..., cache_tokens: _Optional[int] = ...) -> None: ...

class WeightsReport(_message.Message):
    __slots__ = ("name", "state", "message")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    name: str
    state: str
    message: str
    def __init__(self, name: _Optional[str] = ..., state: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class Status(_message.Message):
    __slots__ = ("observed_revision", "observed_epoch", "shards", "gpus", "weights", "stale_rejected")
    OBSERVED_REVISION_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    STALE_REJECTED_FIELD_NUMBER: _ClassVar[int]
    observed_revision: int
    observed_epoch: int
    shards: _containers.RepeatedCompositeFieldContainer[ShardStatus]
    gpus: _containers.RepeatedCompositeFieldContainer[GpuInfo]
    weights: _containers.RepeatedCompositeFieldContainer[WeightsReport]
    stale_rejected: int
    def __init__(self, observed_revision: _Optional[int] = ..., observed_epoch: _Optional[int] = ..., shards: _Optional[_Iterable[_Union[ShardStatus, _Mapping]]] = ..., gpus: _Optional[_Iterable[_Union[GpuInfo, _Mapping]]] = ..., weights: _Optional[_Iterable[_Union[WeightsReport, _Mapping]]] = ..., stale_rejected: _Optional[int] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("seq",)
    SEQ_FIELD_NUMBER: _ClassVar[int]
    seq: int
    def __init__(self, seq: _Optional[int] = ...) -> None: ...

class Welcome(_message.Message):
    __slots__ = ("node", "heartbeat_interval", "server_version")
    NODE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    node: str
    heartbeat_interval: float
    server_version: str
    def __init__(self, node: _Optional[str] = ..., heartbeat_interval: _Optional[float] = ..., server_version: _Optional[str] = ...) -> None: ...

class DesiredShard(_message.Message):
    __slots__ = ("shard_id", "replica_id", "generation", "state", "engine", "model", "source", "port", "args", "env", "gpu_indices", "rank", "world_size", "head_address", "head_port", "health_path", "startup_timeout_s", "drain_timeout_s", "api_key")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    GPU_INDICES_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    HEAD_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HEAD_PORT_FIELD_NUMBER: _ClassVar[int]
    HEALTH_PATH_FIELD_NUMBER: _ClassVar[int]
    STARTUP_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    DRAIN_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    API_KEY_FIELD_NUMBER: _ClassVar[int]
    shard_id: int
    replica_id: int
    generation: int
    state: str
    engine: str
    model: str
    source: str
    port: int
    args: _containers.RepeatedScalarFieldContainer[str]
    env: _containers.ScalarMap[str, str]
    gpu_indices: _containers.RepeatedScalarFieldContainer[int]
    rank: int
    world_size: int
    head_address: str
    head_port: int
    health_path: str
    startup_timeout_s: float
    drain_timeout_s: float
    api_key: str
    def __init__(self, shard_id: _Optional[int] = ..., replica_id: _Optional[int] = ..., generation: _Optional[int] = ..., state: _Optional[str] = ..., engine: _Optional[str] = ..., model: _Optional[str] = ..., source: _Optional[str] = ..., port: _Optional[int] = ..., args: _Optional[_Iterable[str]] = ..., env: _Optional[_Mapping[str, str]] = ..., gpu_indices: _Optional[_Iterable[int]] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., head_address: _Optional[str] = ..., head_port: _Optional[int] = ..., health_path: _Optional[str] = ..., startup_timeout_s: _Optional[float] = ..., drain_timeout_s: _Optional[float] = ..., api_key: _Optional[str] = ...) -> None: ...

class DesiredState(_message.Message):
    __slots__ = ("node", "epoch", "revision", "shards", "remove_weights")
    NODE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    REMOVE_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    node: str
    epoch: int
    revision: int
    shards: _containers.RepeatedCompositeFieldContainer[DesiredShard]
    remove_weights: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, node: _Optional[str] = ..., epoch: _Optional[int] = ..., revision: _Optional[int] = ..., shards: _Optional[_Iterable[_Union[DesiredShard, _Mapping]]] = ..., remove_weights: _Optional[_Iterable[str]] = ...) -> None: ...

class ErrorMessage(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class AgentFrame(_message.Message):
    __slots__ = ("v", "hello", "status", "heartbeat", "error")
    V_FIELD_NUMBER: _ClassVar[int]
    HELLO_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    v: int
    hello: Hello
    status: Status
    heartbeat: Heartbeat
    error: ErrorMessage
    def __init__(self, v: _Optional[int] = ..., hello: _Optional[_Union[Hello, _Mapping]] = ..., status: _Optional[_Union[Status, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., error: _Optional[_Union[ErrorMessage, _Mapping]] = ...) -> None: ...

class ServerFrame(_message.Message):
    __slots__ = ("v", "welcome", "desired", "error")
    V_FIELD_NUMBER: _ClassVar[int]
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    DESIRED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    v: int
    welcome: Welcome
    desired: DesiredState
    error: ErrorMessage
    def __init__(self, v: _Optional[int] = ..., welcome: _Optional[_Union[Welcome, _Mapping]] = ..., desired: _Optional[_Union[DesiredState, _Mapping]] = ..., error: _Optional[_Union[ErrorMessage, _Mapping]] = ...) -> None: ...
