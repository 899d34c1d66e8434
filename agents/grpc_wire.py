"""The protocol's messages as gRPC frames (``agents/agent.proto``), and back.

A frame is turned into exactly the JSON object the WebSocket transport carries and handed to
the one decoder in :mod:`agents.protocol.codec`, so both transports validate every field the same
way; this module only moves fields between the two shapes, guided by the schema's own
descriptors (no hand-written list of fields to fall out of step).

Both directions agree on two conventions of the schema: an unset ``optional`` field is
``null``, and an empty repeated field is left out (every list in the protocol defaults to
empty, and ``port_range`` reads "not given" from its absence).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, Message

from agents import agent_pb2
from agents.protocol.messages import Message as ProtocolMessage
from agents.protocol.vocabulary import PROTOCOL_VERSION, CloseCode, ProtocolError

SERVICE: Final = "llmgw.agent.v1.AgentPlane"
METHOD: Final = f"/{SERVICE}/Stream"
# The protocol's close code travels in the call's trailing metadata; gRPC's own status code
# says the same in gRPC's words, for tools that know only those.
CLOSE_CODE_KEY: Final = "llmgw-close-code"
NODE_KEY: Final = "x-llmgw-node"

AgentFrame = agent_pb2.AgentFrame
ServerFrame = agent_pb2.ServerFrame


def _is_repeated(field: FieldDescriptor) -> bool:
    # ``label`` is deprecated in newer protobuf releases in favour of ``is_repeated``.
    repeated = getattr(field, "is_repeated", None)
    if repeated is not None:
        return bool(repeated)
    return bool(field.label == FieldDescriptor.LABEL_REPEATED)


def _is_map(field: FieldDescriptor) -> bool:
    return (
        field.type == FieldDescriptor.TYPE_MESSAGE
        and field.message_type is not None
        and field.message_type.GetOptions().map_entry
    )


def message_to_dict(message: Message) -> dict[str, Any]:
    """A protobuf message as the protocol's JSON object."""
    out: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if _is_map(field):
            if value:
                out[field.name] = dict(value)
        elif _is_repeated(field):
            if value:
                if field.type == FieldDescriptor.TYPE_MESSAGE:
                    out[field.name] = [message_to_dict(item) for item in value]
                else:
                    out[field.name] = list(value)
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            if message.HasField(field.name):
                out[field.name] = message_to_dict(value)
        elif field.has_presence and not message.HasField(field.name):
            out[field.name] = None
        else:
            out[field.name] = value
    return out


def fill(message: Message, values: Mapping[str, Any]) -> None:
    """Set ``message``'s fields from the protocol's JSON object (one ``to_dict()``)."""
    fields = message.DESCRIPTOR.fields_by_name
    for name, value in values.items():
        field = fields.get(name)
        if field is None:
            raise ValueError(f"{message.DESCRIPTOR.name} has no field {name!r}")
        if value is None:
            continue  # optional and unset; repeated ``port_range`` left empty
        if _is_map(field):
            getattr(message, name).update(value)
        elif _is_repeated(field):
            target = getattr(message, name)
            if field.type == FieldDescriptor.TYPE_MESSAGE:
                for item in value:
                    fill(target.add(), item)
            else:
                target.extend(value)
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            fill(getattr(message, name), value)
        else:
            setattr(message, name, value)


def to_frame(message: ProtocolMessage, frame_type: type[Message]) -> Message:
    """One protocol message in its frame (``AgentFrame`` or ``ServerFrame``)."""
    frame = frame_type()
    frame.v = PROTOCOL_VERSION
    body = getattr(frame, message.TYPE)
    body.SetInParent()
    fill(body, message.to_dict())
    return frame


def text_to_frame(text: str, frame_type: type[Message]) -> Message:
    """A frame from the JSON text :func:`agents.protocol.codec.encode` made (what a session sends
    through any transport)."""
    raw = json.loads(text)
    kind = raw.pop("type")
    frame = frame_type()
    frame.v = raw.pop("v")
    body = getattr(frame, kind)
    body.SetInParent()
    fill(body, raw)
    return frame


def frame_to_text(frame: Message) -> str:
    """A received frame as the JSON text the protocol's decoder validates. A frame without a
    body decodes to an unknown message type there, with the usual close code."""
    kind = frame.WhichOneof("body")
    body: dict[str, Any] = {"type": kind, "v": frame.v}
    if kind is not None:
        body.update(message_to_dict(getattr(frame, kind)))
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False)


def parse_agent_frame(data: bytes) -> AgentFrame:
    """gRPC's request deserializer: bytes that are not a frame become a protocol error the
    stream closes with, not a crash."""
    frame = AgentFrame()
    try:
        frame.ParseFromString(data)
    except DecodeError as exc:
        raise ProtocolError(CloseCode.MALFORMED, f"not an AgentFrame: {exc}") from None
    return frame


def parse_server_frame(data: bytes) -> ServerFrame:
    frame = ServerFrame()
    try:
        frame.ParseFromString(data)
    except DecodeError as exc:
        raise ProtocolError(CloseCode.MALFORMED, f"not a ServerFrame: {exc}") from None
    return frame


def serialize(frame: Message) -> bytes:
    data: bytes = frame.SerializeToString()
    return data
