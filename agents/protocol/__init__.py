"""The agent protocol: every message an agent and the control plane exchange, defined once.

Both sides import it (the agent has no Django; the control plane's session logic and its
transports do), so a field cannot mean one thing on one side and another on the other.

Wire format: one JSON object per WebSocket text frame, ``{"type": ..., "v": 1, ...fields}``;
over gRPC, the same fields in the frames of ``agents/agent.proto`` (:mod:`agents.grpc_wire`
turns one into the other, and a test proves the schema equal to the messages field for field).
``v`` is the protocol version on every message; a peer speaking another version is refused
with ``CloseCode.PROTOCOL_VERSION`` before anything else is read. Within a version, fields may
be added (a reader ignores fields it does not know) but never removed or re-typed.

Agent → control plane: ``Hello`` (once, first), ``Status`` (on every change, and as a periodic
full report), ``Heartbeat`` (in between). Control plane → agent: ``Welcome`` (the answer to
hello), ``DesiredState`` (the node's *full* desired state, never a delta), ``ErrorMessage``
(before a close).

Decoding validates every field and raises ``ProtocolError`` with a message that names the
field (``shards[2].port must be an integer from 1 to 65535``) and the close code the transport
should use; it never raises anything else for any input.

The modules, each over the ones before it:

- :mod:`~agents.protocol.vocabulary`: the words both sides share: the version, limits, the
  stream's path and header, close codes, ``ProtocolError``, the states a shard can be in;
- :mod:`~agents.protocol.names`: the node names, addresses and weights paths that may be used
  (the control plane's forms and commands check theirs with the same rules);
- :mod:`~agents.protocol.fields`: typed reads from one decoded JSON object;
- :mod:`~agents.protocol.messages`: every message, with its fields and their checks;
- :mod:`~agents.protocol.codec`: a message as the text of one frame, and back.
"""
