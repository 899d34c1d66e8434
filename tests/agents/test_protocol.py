"""The agent protocol's contract: one schema both sides use, strict about what it accepts, and
never failing with anything but a ProtocolError that names the field and the close code."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from dataclasses import replace
from typing import Any

import pytest

from agents.protocol.codec import decode_agent_message, decode_server_message, encode
from agents.protocol.messages import (
    DesiredShard,
    DesiredState,
    ErrorMessage,
    GpuInfo,
    Heartbeat,
    Hello,
    ShardStatus,
    Status,
    WeightsReport,
    Welcome,
)
from agents.protocol.names import valid_weights_name
from agents.protocol.vocabulary import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    CloseCode,
    DesiredShardState,
    Engine,
    FailureClass,
    ProtocolError,
    ShardState,
    WeightsState,
)
from tests.harness.procs import REPO_ROOT

GPUS = (
    GpuInfo(index=0, uuid="GPU-a", model="H100", memory_total_mib=81920, memory_used_mib=100),
    GpuInfo(index=1, uuid="GPU-b", model="H100", memory_total_mib=81920),
)
HELLO = Hello(
    node="gpu-01",
    boot_id="b00t",
    agent_version="0.1.0",
    gpus=GPUS,
    addresses=("10.0.0.7",),
    port_range=(20000, 20999),
)
SHARD_STATUS = ShardStatus(
    shard_id=7,
    replica_id=3,
    generation=2,
    state=ShardState.FAILED,
    port=20001,
    exit_code=-9,
    failure_class=FailureClass.OOM,
    message="killed by SIGKILL while it should run",
    log_tail=("loading", "CUDA out of memory"),
    requests_running=None,
    requests_waiting=None,
    pid=None,
)
STATUS = Status(
    observed_revision=12,
    observed_epoch=4,
    shards=(
        SHARD_STATUS,
        replace(SHARD_STATUS, shard_id=8, state=ShardState.READY, pid=99, cache_tokens=131072),
    ),
    gpus=GPUS,
    weights=(WeightsReport("org/model", WeightsState.REFUSED, "in use by shard 7"),),
    stale_rejected=2,
)
DESIRED_SHARD = DesiredShard(
    shard_id=7,
    replica_id=3,
    generation=2,
    state=DesiredShardState.RUNNING,
    engine=Engine.VLLM,
    model="llama3",
    source="meta-llama/Llama-3-8B",
    port=20001,
    args=("--tensor-parallel-size", "2", "--hf-overrides", '{"a": 1}'),
    env={"VLLM_LOGGING_LEVEL": "DEBUG"},
    gpu_indices=(0, 1),
    rank=1,
    world_size=2,
    head_address="10.0.0.8",
    head_port=20000,
    health_path="/health",
    startup_timeout_s=900.0,
    drain_timeout_s=30.0,
)
DESIRED = DesiredState(
    node="gpu-01",
    epoch=4,
    revision=12,
    shards=(DESIRED_SHARD,),
    remove_weights=("org/old-model",),
)


def frame(message_type: str, **fields: Any) -> str:
    return json.dumps({"type": message_type, "v": PROTOCOL_VERSION, **fields})


def rejected(data: str | bytes | None, *, agent: bool = True) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        (decode_agent_message if agent else decode_server_message)(data)
    return info.value


@pytest.mark.parametrize("message", [HELLO, STATUS, Heartbeat(seq=5), ErrorMessage(4400, "x")])
def test_every_agent_message_survives_the_wire_unchanged(message: Any) -> None:
    assert decode_agent_message(encode(message)) == message


@pytest.mark.parametrize(
    "message", [Welcome("gpu-01", 2.0, "0.1.0"), DESIRED, ErrorMessage(1011, "store down")]
)
def test_every_server_message_survives_the_wire_unchanged(message: Any) -> None:
    assert decode_server_message(encode(message)) == message


def test_each_side_refuses_the_other_sides_message_types() -> None:
    assert "unknown message type 'desired'" in rejected(encode(DESIRED)).message
    assert "unknown message type 'hello'" in rejected(encode(HELLO), agent=False).message


def test_a_wrong_protocol_version_is_refused_with_its_own_close_code() -> None:
    body = json.loads(encode(HELLO))
    for version in (2, 0, "1", None):
        body["v"] = version
        error = rejected(json.dumps(body))
        assert error.code is CloseCode.PROTOCOL_VERSION
        assert f"protocol version {version!r} is not supported" in error.message
    del body["v"]
    assert rejected(json.dumps(body)).code is CloseCode.PROTOCOL_VERSION


@pytest.mark.parametrize(
    ("data", "code", "words"),
    [
        ("not json", CloseCode.MALFORMED, "not JSON"),
        ("[1, 2]", CloseCode.MALFORMED, "message must be an object"),
        ("", CloseCode.MALFORMED, "not JSON"),
        (None, CloseCode.MALFORMED, "empty frame"),
        (b'{"type": "hello"}', CloseCode.UNSUPPORTED_DATA, "binary frames"),
        ("[" * 100_000, CloseCode.MALFORMED, "not JSON"),
        (json.dumps({"v": 1}), CloseCode.MALFORMED, "unknown message type None"),
        (frame("bogus"), CloseCode.MALFORMED, "unknown message type 'bogus'"),
    ],
)
def test_garbage_is_refused_with_a_clear_reason(
    data: str | bytes | None, code: CloseCode, words: str
) -> None:
    error = rejected(data)
    assert error.code is code
    assert words in error.message


def test_a_message_over_the_size_limit_is_refused_before_parsing() -> None:
    big = frame("heartbeat", pad="x" * MAX_MESSAGE_BYTES)
    error = rejected(big)
    assert error.code is CloseCode.TOO_BIG
    assert str(MAX_MESSAGE_BYTES) in error.message


def _desired_with(**changes: Any) -> str:
    body = json.loads(encode(DESIRED))
    body["shards"][0].update(changes)
    return json.dumps(body)


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"port": 0}, "desired: shards[0].port must be an integer from 1 to 65535"),
        ({"port": "20001"}, "shards[0].port must be an integer"),
        ({"port": True}, "shards[0].port must be an integer"),
        ({"shard_id": None}, "shards[0].shard_id must be an integer"),
        ({"engine": "tgi"}, "shards[0].engine must be one of 'vllm', 'sglang', 'llamacpp', 'sim'"),
        ({"state": "paused"}, "shards[0].state must be one of"),
        ({"rank": 2, "world_size": 2}, "shards[0].rank must be below world_size"),
        ({"args": "--tp 2"}, "shards[0].args must be a list"),
        ({"args": [1]}, "shards[0].args[0] must be a string"),
        ({"env": {"A": 1}}, "shards[0].env must be an object of strings"),
        ({"env": {"BAD NAME": "x"}}, "invalid variable name 'BAD NAME'"),
        ({"gpu_indices": [-1]}, "shards[0].gpu_indices[0] must be an integer from 0"),
        ({"health_path": "health"}, "shards[0].health_path must start with /"),
        ({"startup_timeout_s": -1}, "shards[0].startup_timeout_s must be a number"),
        ({"model": "m" * 201}, "shards[0].model is longer than 200 characters"),
    ],
)
def test_a_bad_field_is_named_in_the_error(changes: dict[str, Any], words: str) -> None:
    error = rejected(_desired_with(**changes), agent=False)
    assert error.code is CloseCode.MALFORMED
    assert words in error.message


def test_a_missing_required_field_is_named() -> None:
    body = json.loads(encode(DESIRED))
    del body["shards"][0]["port"]
    assert "shards[0].port is required" in rejected(json.dumps(body), agent=False).message


def test_duplicate_shard_ids_are_refused() -> None:
    body = json.loads(encode(DESIRED))
    body["shards"].append(body["shards"][0])
    assert "must not repeat a shard_id" in rejected(json.dumps(body), agent=False).message


@pytest.mark.parametrize(
    "name", ["../etc", "/etc/passwd", "a/../../b", "a/./b", "..", ".", "", "a//b", "a\\b", "a\0b"]
)
def test_weights_names_that_could_leave_the_weights_directory_are_refused(name: str) -> None:
    assert not valid_weights_name(name)
    body = json.loads(encode(DESIRED))
    body["remove_weights"] = [name]
    error = rejected(json.dumps(body), agent=False)
    assert error.code is CloseCode.MALFORMED
    assert "remove_weights" in error.message


@pytest.mark.parametrize("name", ["org/model", "tiny.gguf", "a/b/c-1_2.safetensors"])
def test_ordinary_weights_names_are_accepted(name: str) -> None:
    assert valid_weights_name(name)


@pytest.mark.parametrize(
    ("hello", "words"),
    [
        ({"node": "bad name"}, "node must be 1-100 letters"),
        ({"port_range": [2, 1]}, "port_range must be [low, high]"),
        ({"gpus": [{"index": 0}, {"index": 0}]}, "gpus must not repeat an index"),
        ({"gpus": [{"index": 0, "memory_total_mib": -1}]}, "gpus[0].memory_total_mib"),
        ({"boot_id": 5}, "boot_id must be a string"),
    ],
)
def test_a_bad_hello_is_refused_with_the_field_named(hello: dict[str, Any], words: str) -> None:
    body = json.loads(encode(HELLO))
    body.update(hello)
    error = rejected(json.dumps(body))
    assert error.code is CloseCode.MALFORMED
    assert words in error.message


def test_a_status_from_an_agent_that_predates_the_cache_size_reads_as_not_known() -> None:
    body = json.loads(encode(STATUS))
    for shard in body["shards"]:
        del shard["cache_tokens"]
    status = decode_agent_message(json.dumps(body))
    assert isinstance(status, Status)
    assert [s.cache_tokens for s in status.shards] == [None, None]


@pytest.mark.parametrize("tokens", [0, -5, 2**31, "131072", 1.5])
def test_a_cache_size_that_is_no_size_is_refused_with_the_field_named(tokens: object) -> None:
    body = json.loads(encode(STATUS))
    body["shards"][1]["cache_tokens"] = tokens
    error = rejected(json.dumps(body))
    assert error.code is CloseCode.MALFORMED
    assert "shards[1].cache_tokens must be an integer from 1 to 2147483647" in error.message


def test_unknown_fields_are_ignored_within_a_version() -> None:
    body = json.loads(encode(HELLO))
    body["future_field"] = {"anything": True}
    assert decode_agent_message(json.dumps(body)) == HELLO


def _mutations(value: Any, rng: random.Random) -> Any:
    """Replace one random leaf (or container) of a JSON value with something else."""
    junk = [None, -1, 2**70, 1.5, "", "x" * 300, [], {}, True, [None], {"a": None}]
    if isinstance(value, dict) and value and rng.random() < 0.8:
        key = rng.choice(list(value))
        return {**value, key: _mutations(value[key], rng)}
    if isinstance(value, list) and value and rng.random() < 0.8:
        index = rng.randrange(len(value))
        return [*value[:index], _mutations(value[index], rng), *value[index + 1 :]]
    return rng.choice(junk)


@pytest.mark.parametrize("seed", range(5))
def test_mutated_messages_never_fail_with_anything_but_a_protocol_error(seed: int) -> None:
    rng = random.Random(seed)
    cases = [
        (json.loads(encode(HELLO)), decode_agent_message),
        (json.loads(encode(STATUS)), decode_agent_message),
        (json.loads(encode(DESIRED)), decode_server_message),
    ]
    outcomes = {"accepted": 0, "refused": 0}
    for _ in range(400):
        body, decode = rng.choice(cases)
        mutated = _mutations(body, rng)
        try:
            decode(json.dumps(mutated))
        except ProtocolError as exc:
            assert exc.message
            assert exc.code in set(CloseCode)
            outcomes["refused"] += 1
        else:
            outcomes["accepted"] += 1
    assert outcomes["refused"] > 100  # the mutations really do break things


def test_the_agents_package_imports_without_django() -> None:
    code = (
        "import sys, importlib, pkgutil, agents\n"
        "names = [m.name for m in pkgutil.walk_packages(agents.__path__, 'agents.')]\n"
        # A package's __main__ may start its program on import; agents' own is guarded.
        "names = [n for n in names if not n.endswith('__main__')] + ['agents.__main__']\n"
        "for name in names: importlib.import_module(name)\n"
        "loaded = [m for m in sys.modules if m == 'django' or m.startswith('django.')]\n"
        "assert not loaded, loaded\n"
        "assert 'agents.protocol' in sys.modules and 'agents.supervisor' in sys.modules\n"
        "print(len(names))\n"
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) >= 6  # protocol, engines, gpus, shards, agent, __main__, sim


@pytest.mark.parametrize(
    "address",
    [
        "http://169.254.169.254",
        "10.0.0.7:8000",
        "10.0.0.7/latest/meta-data",
        "user@10.0.0.7",
        "2852039166",  # 169.254.169.254 to a resolver
        "0xa9fea9fe",
        "0251.0376.0251.0376",
        "host name",
        "",
    ],
)
def test_a_node_address_must_be_a_bare_ip_or_host_name(address: str) -> None:
    """The gateway builds engine URLs from these; nothing else may ride along."""
    error = rejected(encode(replace(HELLO, addresses=("10.0.0.8", address))))
    assert error.code is CloseCode.MALFORMED
    assert "addresses[1]" in error.message


@pytest.mark.parametrize("address", ["10.0.0.7", "fd00::7", "gpu-07.example.com", "gpu07"])
def test_ips_and_host_names_are_node_addresses(address: str) -> None:
    decoded = decode_agent_message(encode(replace(HELLO, addresses=(address,))))
    assert isinstance(decoded, Hello) and decoded.addresses == (address,)
