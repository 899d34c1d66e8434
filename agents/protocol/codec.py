"""A message of the agent protocol as the text of one frame, and a frame's text back as a
message: the envelope (``type`` and version) is checked first, then the message of that type
that the receiving side accepts."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

from agents.protocol.fields import Fields
from agents.protocol.messages import (
    AgentMessage,
    DesiredState,
    ErrorMessage,
    Heartbeat,
    Hello,
    Message,
    ServerMessage,
    Status,
    Welcome,
)
from agents.protocol.vocabulary import MAX_MESSAGE_BYTES, PROTOCOL_VERSION, CloseCode, ProtocolError

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


def _envelope(data: str | bytes | None) -> Fields:
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
    fields = Fields(raw, "")
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
