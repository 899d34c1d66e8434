"""Bearer secrets: their form, their hash, their prefix, and what is refused (pure, no store)."""

from __future__ import annotations

import hashlib
import re

import pytest

from control import node_tokens
from credentials.bearer import BODY_LENGTH, BearerSecret
from gateway.identity import keys
from llmgw_site.admin_api import tokens

KIND = BearerSecret("llmgw-test-", shown=8)
URL_SAFE = re.compile(r"[A-Za-z0-9_-]+")


def test_an_issued_secret_is_the_marker_then_43_url_safe_characters() -> None:
    new = KIND.issue()
    assert new.secret.startswith("llmgw-test-") and len(new.secret) == len("llmgw-test-") + 43
    assert URL_SAFE.fullmatch(new.secret.removeprefix("llmgw-test-"))
    assert KIND.well_formed(new.secret)
    assert len({KIND.issue().secret for _ in range(100)}) == 100


def test_the_stored_prefix_is_the_marker_and_the_first_shown_characters() -> None:
    new = KIND.issue()
    assert new.prefix == new.secret[: len("llmgw-test-") + 8] == KIND.prefix(new.secret)
    assert KIND.prefix_length == len(new.prefix)
    # A wrong secret is named by the same part, so a log can say which one was tried.
    assert KIND.prefix("llmgw-test-wrongful-guess") == "llmgw-test-wrongful"


def test_the_hash_is_the_sha256_of_the_secret_and_never_the_secret() -> None:
    new = KIND.issue()
    assert new.hash == KIND.hash(new.secret) == hashlib.sha256(new.secret.encode()).hexdigest()
    assert len(new.hash) == 64 and new.hash != new.secret
    assert new.secret not in new.hash and new.secret.removeprefix("llmgw-test-") not in new.hash
    assert new.secret not in repr(new)  # the secret never reaches a log through its repr
    assert KIND.hash(KIND.issue().secret) != new.hash


def test_a_secret_matches_only_its_own_hash() -> None:
    new, other = KIND.issue(), KIND.issue()
    assert KIND.matches(new.secret, new.hash)
    assert not KIND.matches(new.secret, other.hash)
    assert not KIND.matches(other.secret, new.hash)
    assert not KIND.matches(new.secret, new.hash.upper())
    assert not KIND.matches(new.secret, "")
    assert not KIND.matches(new.secret, new.secret)  # a stored secret is not a stored hash


@pytest.mark.parametrize(
    "wrong",
    [
        "",
        "llmgw-test-",
        "llmgw-test-" + "A" * 42,  # one short
        "llmgw-test-" + "A" * 44,  # one long
        "llmgw-test-" + "A" * 42 + "=",  # padded base64 is not what is issued
        "llmgw-test-" + "A" * 42 + "/",  # nor the standard alphabet
        "llmgw-test-" + "A" * 42 + "\n",
        " llmgw-test-" + "A" * 43,
        "llmgw-text-" + "A" * 43,  # another marker
        "LLMGW-TEST-" + "A" * 43,
        "A" * (len("llmgw-test-") + 43),
    ],
)
def test_a_malformed_or_wrongly_prefixed_secret_is_refused(wrong: str) -> None:
    assert not KIND.well_formed(wrong)
    # Refused even where the stored hash is its own: a malformed secret is never looked up.
    assert not KIND.matches(wrong, KIND.hash(wrong))


def test_one_kind_refuses_another_kinds_secrets() -> None:
    other = BearerSecret("llmgw-", shown=8)
    assert not other.well_formed(KIND.issue().secret)
    assert not KIND.well_formed(other.issue().secret)


@pytest.mark.parametrize("shown", [0, -1, BODY_LENGTH, BODY_LENGTH + 1])
def test_a_prefix_that_tells_nothing_apart_or_shows_the_whole_secret_is_refused(
    shown: int,
) -> None:
    with pytest.raises(ValueError, match="characters of the secret"):
        BearerSecret("llmgw-test-", shown=shown)
    with pytest.raises(ValueError):
        BearerSecret("", shown=8)


@pytest.mark.parametrize(
    ("kind", "marker", "prefix_length"),
    [
        (keys.API_KEY, "llmgw-", 14),
        (tokens.ADMIN_TOKEN, "llmgw-admin-", 20),
        (node_tokens.NODE_TOKEN, "llmgw_node_", 17),
    ],
)
def test_keys_admin_tokens_and_node_tokens_keep_the_form_already_issued(
    kind: BearerSecret, marker: str, prefix_length: int
) -> None:
    # Secrets issued before keep working only while marker, length and hash are these.
    issued_before = marker + "0123456789abcdefghijklmnopqrstuvwxyzABCDEFG"
    assert kind.well_formed(issued_before)
    assert kind.matches(issued_before, hashlib.sha256(issued_before.encode()).hexdigest())
    assert kind.prefix(issued_before) == issued_before[:prefix_length]
    new = kind.issue()
    assert new.secret.startswith(marker) and len(new.secret) == len(marker) + 43
    assert len(new.prefix) == prefix_length
