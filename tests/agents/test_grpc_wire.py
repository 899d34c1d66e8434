"""The gRPC schema (agents/agent.proto) carries the protocol's messages
(agents/protocol/messages.py) field for field: the same names, the same kinds, the same optional
fields, and every message survives the trip through a frame unchanged, with validation still
done by the one decoder."""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from agents import agent_pb2, grpc_wire
from agents.protocol import codec
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
from agents.protocol.vocabulary import CloseCode, ProtocolError
from tests.agents.test_protocol import DESIRED, DESIRED_SHARD, HELLO, STATUS

# The dataclass of each message and the schema's message of the same name.
MESSAGES = [
    GpuInfo,
    Hello,
    ShardStatus,
    WeightsReport,
    Status,
    Heartbeat,
    Welcome,
    DesiredShard,
    DesiredState,
    ErrorMessage,
]
# Not a field of the message on either wire: the envelope's ``v`` carries it.
ENVELOPE_ONLY = {("Hello", "protocol_version")}

_SCALARS = {
    FieldDescriptor.TYPE_STRING: str,
    FieldDescriptor.TYPE_INT32: int,
    FieldDescriptor.TYPE_INT64: int,
    FieldDescriptor.TYPE_UINT32: int,
    FieldDescriptor.TYPE_DOUBLE: float,
}


def _python_kind(hint: Any) -> tuple[str, Any]:
    """(shape, element type) of a dataclass field's annotation."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        (inner,) = [a for a in typing.get_args(hint) if a is not type(None)]
        shape, element = _python_kind(inner)
        return ("optional" if shape == "scalar" else "repeated", element)
    if origin is tuple:
        return ("repeated", typing.get_args(hint)[0])
    if origin in (Mapping, dict) or hint is Mapping:
        return ("map", str)
    if isinstance(hint, type) and issubclass(hint, StrEnum):
        return ("scalar", str)
    if dataclasses.is_dataclass(hint):
        return ("message", hint)
    return ("scalar", hint)


def _schema_kind(field: FieldDescriptor) -> tuple[str, Any]:
    if grpc_wire._is_map(field):
        return ("map", str)
    element = (
        field.message_type.name
        if field.type == FieldDescriptor.TYPE_MESSAGE
        else _SCALARS[field.type]
    )
    if grpc_wire._is_repeated(field):
        return ("repeated", element)
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return ("message", element)
    return ("optional" if field.has_presence else "scalar", element)


@pytest.mark.parametrize("cls", MESSAGES, ids=lambda c: c.__name__)
def test_the_schema_has_every_field_of_the_protocol_and_nothing_else(cls: type) -> None:
    descriptor: Descriptor = getattr(agent_pb2, cls.__name__).DESCRIPTOR
    hints = typing.get_type_hints(cls)
    ours = {
        f.name: _python_kind(hints[f.name])
        for f in dataclasses.fields(cls)
        if (cls.__name__, f.name) not in ENVELOPE_ONLY
    }
    theirs = {f.name: _schema_kind(f) for f in descriptor.fields}
    # port_range is a pair in Python and a repeated int32 in the schema (empty: not given).
    if "port_range" in ours:
        assert ours.pop("port_range") == ("repeated", int)
        assert theirs.pop("port_range") == ("repeated", int)
    normalized = {
        name: (
            shape,
            element.__name__
            if isinstance(element, type) and dataclasses.is_dataclass(element)
            else element,
        )
        for name, (shape, element) in ours.items()
    }
    assert normalized == theirs


def test_the_envelopes_carry_each_sides_message_types_under_their_protocol_names() -> None:
    agent = {f.name for f in agent_pb2.AgentFrame.DESCRIPTOR.oneofs_by_name["body"].fields}
    server = {f.name for f in agent_pb2.ServerFrame.DESCRIPTOR.oneofs_by_name["body"].fields}
    assert agent == set(codec._AGENT_TYPES)
    assert server == set(codec._SERVER_TYPES)


@pytest.mark.parametrize(
    "message", [HELLO, STATUS, Heartbeat(seq=5), ErrorMessage(4400, "x")], ids=str
)
def test_every_agent_message_survives_a_grpc_frame_unchanged(message: Any) -> None:
    frame = grpc_wire.to_frame(message, agent_pb2.AgentFrame)
    again = grpc_wire.parse_agent_frame(grpc_wire.serialize(frame))
    assert decode_agent_message(grpc_wire.frame_to_text(again)) == message
    # And the session's JSON text makes the very same frame.
    assert grpc_wire.text_to_frame(encode(message), agent_pb2.AgentFrame) == frame


@pytest.mark.parametrize(
    "message",
    [
        Welcome("gpu-01", 2.0, "0.1.0"),
        DESIRED,
        dataclasses.replace(DESIRED, shards=(dataclasses.replace(DESIRED_SHARD, api_key="k"),)),
        ErrorMessage(1011, "store down"),
    ],
    ids=str,
)
def test_every_server_message_survives_a_grpc_frame_unchanged(message: Any) -> None:
    frame = grpc_wire.text_to_frame(encode(message), agent_pb2.ServerFrame)
    again = grpc_wire.parse_server_frame(grpc_wire.serialize(frame))
    assert decode_server_message(grpc_wire.frame_to_text(again)) == message


def test_a_hello_without_a_port_range_stays_without_one() -> None:
    hello = dataclasses.replace(HELLO, port_range=None, addresses=())
    frame = grpc_wire.to_frame(hello, agent_pb2.AgentFrame)
    assert decode_agent_message(grpc_wire.frame_to_text(frame)) == hello


def test_frames_are_validated_by_the_one_decoder() -> None:
    bad = agent_pb2.AgentFrame(v=1)
    bad.status.shards.add(shard_id=0, replica_id=1, state="ready", port=1)
    with pytest.raises(ProtocolError) as info:
        decode_agent_message(grpc_wire.frame_to_text(bad))
    assert info.value.code is CloseCode.MALFORMED
    assert "shards[0].shard_id" in info.value.message

    empty = agent_pb2.AgentFrame(v=1)
    with pytest.raises(ProtocolError) as info:
        decode_agent_message(grpc_wire.frame_to_text(empty))
    assert "unknown message type None" in info.value.message

    old = grpc_wire.to_frame(Heartbeat(seq=1), agent_pb2.AgentFrame)
    old.v = 2
    with pytest.raises(ProtocolError) as info:
        decode_agent_message(grpc_wire.frame_to_text(old))
    assert info.value.code is CloseCode.PROTOCOL_VERSION


def test_bytes_that_are_not_a_frame_are_a_protocol_error() -> None:
    with pytest.raises(ProtocolError) as info:
        grpc_wire.parse_agent_frame(b"\xff\xff\xff\xff")
    assert info.value.code is CloseCode.MALFORMED


_PROTO_FIELD = re.compile(
    r"^\s*(?P<label>optional |repeated )?(?P<type>map<\w+,\s*\w+>|[\w.]+)\s+"
    r"(?P<name>\w+)\s*=\s*(?P<number>\d+);"
)
_PROTO_TYPES = {
    "string": FieldDescriptor.TYPE_STRING,
    "int32": FieldDescriptor.TYPE_INT32,
    "int64": FieldDescriptor.TYPE_INT64,
    "uint32": FieldDescriptor.TYPE_UINT32,
    "double": FieldDescriptor.TYPE_DOUBLE,
}


def _fields_written_in_the_proto() -> dict[str, set[tuple[str, int, str, str]]]:
    """Each message of agents/agent.proto as written: (name, number, label, type) per field."""
    messages: dict[str, set[tuple[str, int, str, str]]] = {}
    current: str | None = None
    for raw in (Path(agent_pb2.__file__).parent / "agent.proto").read_text().splitlines():
        line = raw.split("//", 1)[0]
        if opened := re.match(r"^message (\w+) \{", line):
            current = opened.group(1)
            messages[current] = set()
        elif line.startswith("}"):
            current = None
        elif current and (field := _PROTO_FIELD.match(line)):
            label = (field.group("label") or "").strip()
            kind = "map" if field.group("type").startswith("map<") else field.group("type")
            messages[current].add((field.group("name"), int(field.group("number")), label, kind))
    return messages


def _label(field: FieldDescriptor) -> str:
    if grpc_wire._is_repeated(field):
        return "repeated"
    # A proto3 `optional` is a oneof of its own, named after the field with a leading "_".
    oneof = field.containing_oneof
    if oneof is not None and oneof.name == "_" + field.name:
        return "optional"
    return ""


def _fields_generated(message: Descriptor) -> set[tuple[str, int, str, str]]:
    fields = set()
    for field in message.fields:
        if grpc_wire._is_map(field):
            fields.add((field.name, field.number, "", "map"))
            continue
        kind = (
            field.message_type.name
            if field.type == FieldDescriptor.TYPE_MESSAGE
            else next(name for name, code in _PROTO_TYPES.items() if code == field.type)
        )
        fields.add((field.name, field.number, _label(field), kind))
    return fields


def test_the_generated_module_is_the_proto_as_written() -> None:
    """agents/agent_pb2.py is checked in: an edit to agent.proto without `make proto` fails here."""
    written = _fields_written_in_the_proto()
    generated = {
        name: _fields_generated(message)
        for name, message in agent_pb2.DESCRIPTOR.message_types_by_name.items()
    }
    assert written == generated
    (service,) = agent_pb2.DESCRIPTOR.services_by_name.values()
    (method,) = service.methods
    assert (method.name, method.input_type.name, method.output_type.name) == (
        "Stream", "AgentFrame", "ServerFrame",
    )  # fmt: skip
    assert method.client_streaming and method.server_streaming
