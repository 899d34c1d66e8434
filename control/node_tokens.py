"""Node tokens: issued and revoked by operators, checked at every stream's handshake.

A token is ``llmgw_node_`` and 43 URL-safe characters (``credentials.bearer`` mints, hashes and
checks it); it is shown once, and only its SHA-256 and a visible prefix are stored. Re-issuing or
revoking a token closes the streams that hold the old one (through a nudge after commit), so a
leaked token stops working at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from django.db import transaction
from django.utils import timezone

from agents.protocol.vocabulary import TOKEN_PREFIX
from control import nudges
from control.models import Event, Node
from credentials.bearer import BearerSecret

# The marker is the protocol's: the agent checks it too, to refuse a wrong kind of secret.
NODE_TOKEN: Final = BearerSecret(TOKEN_PREFIX, shown=6)
TOKEN_VISIBLE_CHARS: Final = NODE_TOKEN.prefix_length
hash_token: Final = NODE_TOKEN.hash


@dataclass(frozen=True)
class NodeIdentity:
    """Who is on the other end of a stream, as its token (or certificate) proved.

    ``token_hash`` or ``cert_serial`` is the credential the stream was opened with; an open
    stream re-checks it against the store on every resync (:func:`still_valid`), so a revoked
    or re-issued credential ends the stream on every web process, with or without a channel
    layer to carry the news.
    """

    id: int
    name: str
    token_hash: str = ""
    cert_serial: str = ""


class TokenRejected(Exception):
    """The handshake's token is missing, unknown or revoked, or claims another node."""


def issue_node_token(name: str) -> str:
    """A new token for node ``name`` (created if new), replacing any earlier one.

    Returned once; only its hash and visible prefix are kept. Streams holding the old token
    are closed after commit, so a leaked token stops working at once when re-issued.
    """
    new = NODE_TOKEN.issue()
    with transaction.atomic():
        node, created = Node.objects.get_or_create(name=name)
        Node.objects.filter(pk=node.pk).update(
            token_hash=new.hash, token_prefix=new.prefix, token_issued_at=timezone.now()
        )
        Event.objects.create(
            kind=Event.Kind.NODE,
            subject=f"node/{name}",
            message=f"node token issued ({new.prefix}…)"
            + (", node registered" if created else ", the previous token no longer works"),
        )
        if not created:
            nudges.send_on_commit(node.pk, nudges.TOKEN_REVOKED)
    return new.secret


def revoke_node_token(name: str) -> bool:
    """Revoke a node's token; its streams are closed after commit. False: nothing to revoke."""
    with transaction.atomic():
        node = Node.objects.filter(name=name).only("pk").first()
        if node is None:
            return False
        revoked = (
            Node.objects.filter(pk=node.pk)
            .exclude(token_hash="")
            .update(token_hash="", token_prefix="")
        )
        if revoked:
            Event.objects.create(
                kind=Event.Kind.NODE, subject=f"node/{name}", message="node token revoked"
            )
            nudges.send_on_commit(node.pk, nudges.TOKEN_REVOKED)
    return bool(revoked)


def authenticate(token: str, claimed_node: str | None) -> NodeIdentity:
    """The node a token belongs to. Raises :class:`TokenRejected` with a reason for the log
    (never containing the token)."""
    if not token:
        raise TokenRejected("no node token")
    if not NODE_TOKEN.well_formed(token):
        raise TokenRejected("not a node token")
    token_hash = NODE_TOKEN.hash(token)
    row = Node.objects.filter(token_hash=token_hash).values_list("pk", "name").first()
    if row is None:
        raise TokenRejected("unknown or revoked node token")
    identity = NodeIdentity(id=row[0], name=row[1], token_hash=token_hash)
    if claimed_node is not None and claimed_node != identity.name:
        raise TokenRejected(f"the token of node {identity.name!r} claims node {claimed_node!r}")
    return identity


def still_valid(identity: NodeIdentity) -> bool:
    """Whether the credential a stream was opened with is still the node's (not revoked, not
    replaced by a newer one). One indexed read."""
    row = Node.objects.filter(pk=identity.id).values_list("token_hash", "cert_serial").first()
    return row is not None and holds_credential(identity, *row)


def holds_credential(identity: NodeIdentity, token_hash: str, cert_serial: str) -> bool:
    """Whether a node row (its ``token_hash`` and ``cert_serial``) still holds the credential
    ``identity`` was proved with: :func:`still_valid`, and the streams' batched resyncs (which
    read many rows together), decide with it."""
    if identity.cert_serial:
        return cert_serial == identity.cert_serial
    if identity.token_hash:
        return token_hash == identity.token_hash
    return False
