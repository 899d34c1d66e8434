"""Prefixed bearer secrets: issue one, hash it for storage, compare it, name it by its prefix.

Each kind of secret (an API key ``llmgw-…``, an admin token ``llmgw-admin-…``, a node token
``llmgw_node_…``) is a :class:`BearerSecret`: its marker followed by 43 URL-safe characters,
the 256 random bits of ``secrets.token_urlsafe(32)``. The marker says what a secret is for
at a glance (in a config file, a leaked paste, a secret scanner's rules); the marker and the
first few random characters are stored as its prefix, so operators tell secrets apart without
the secret.

The store keeps only a SHA-256 of each secret. A slow password hash protects low-entropy
secrets from guessing; 256 random bits cannot be guessed, so one fast hash is right, and
checking a secret on every request costs microseconds rather than milliseconds. Looking a
secret up by its hash also takes no time that depends on the secret.

Every secret already issued keeps working only while its marker, length and hash stay exactly
as they are: changing any of them for a kind locks out every holder of that kind.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass, field
from typing import Final

ENTROPY_BYTES: Final = 32
# token_urlsafe(32): 32 bytes as unpadded URL-safe base64 is always 43 characters.
BODY_LENGTH: Final = 43
_BODY: Final = f"[A-Za-z0-9_-]{{{BODY_LENGTH}}}"


@dataclass(frozen=True)
class Issued:
    """A secret just made: the secret to show once, and the two things to store."""

    secret: str = field(repr=False)  # shown once, never stored, never logged
    prefix: str
    hash: str


class BearerSecret:
    """One kind of secret: ``marker`` then 43 URL-safe characters. Its prefix is the marker
    and the first ``shown`` of those characters."""

    __slots__ = ("_form", "marker", "prefix_length", "shown")

    def __init__(self, marker: str, *, shown: int) -> None:
        # No random characters would tell no two secrets apart; all of them would store the
        # secret itself.
        if not marker or not 0 < shown < BODY_LENGTH:
            raise ValueError(f"a prefix of {marker!r} and {shown} characters of the secret")
        self.marker: Final = marker
        self.shown: Final = shown
        self.prefix_length: Final = len(marker) + shown
        self._form: Final = re.compile(re.escape(marker) + _BODY)

    def __repr__(self) -> str:
        return f"BearerSecret({self.marker!r}, shown={self.shown})"

    def issue(self) -> Issued:
        """A new secret of this kind, with the prefix and hash to store for it."""
        secret = self.marker + secrets.token_urlsafe(ENTROPY_BYTES)
        return Issued(secret, self.prefix(secret), self.hash(secret))

    def well_formed(self, secret: str) -> bool:
        """Whether ``secret`` has this kind's marker and length: anything else is refused
        without hashing it or looking it up."""
        return self._form.fullmatch(secret) is not None

    def prefix(self, secret: str) -> str:
        """What is stored (and may be shown or logged) to tell this secret from others; of any
        string, so a wrong secret can be named by the same part as a right one."""
        return secret[: self.prefix_length]

    @staticmethod
    def hash(secret: str) -> str:
        """The SHA-256 (hex) the store keeps instead of ``secret``."""
        return hashlib.sha256(secret.encode()).hexdigest()

    def matches(self, secret: str, stored_hash: str) -> bool:
        """Whether ``secret`` is a well-formed secret of this kind whose hash is
        ``stored_hash``, compared in constant time."""
        return self.well_formed(secret) and hmac.compare_digest(self.hash(secret), stored_hash)
