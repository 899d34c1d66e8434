"""The cluster CA and node certificates: made by management commands, keys private, one valid
certificate per node, revocation and replacement honoured by the authentication the gRPC
listener uses."""

from __future__ import annotations

import functools
import stat
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import NameOID
from django.core.management import CommandError, call_command

from control import node_certs, node_tokens
from control.models import Event, Node
from tests.harness.modes import assert_owner_only, umask
from tests.harness.racers import at_once

pytestmark = pytest.mark.django_db


@pytest.fixture
def ca_dir(tmp_path: Path, settings: Any) -> Path:
    settings.LLMGW_CA_DIR = tmp_path / "ca"
    call_command("init_ca", stdout=StringIO())
    return Path(settings.LLMGW_CA_DIR)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_init_ca_writes_the_ca_and_the_listeners_certificate_with_private_keys(
    ca_dir: Path,
) -> None:
    assert mode(ca_dir / "ca.key") == 0o600
    assert mode(ca_dir / "server.key") == 0o600
    ca = x509.load_pem_x509_certificate((ca_dir / "ca.pem").read_bytes())
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    server = x509.load_pem_x509_certificate((ca_dir / "server.pem").read_bytes())
    assert server.issuer == ca.subject
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "localhost" in names.get_values_for_type(x509.DNSName)
    with pytest.raises(CommandError, match="exists"):
        call_command("init_ca", stdout=StringIO())  # never silently replaced


def test_init_ca_eight_times_at_once_makes_one_ca_that_signed_the_listeners_certificate(
    tmp_path: Path,
) -> None:
    """Eight at the same instant, over many rounds: one makes the CA, the others are refused
    as if they had come later, and what is on disk is one pair (the CA's key is its
    certificate's, and it signed the listener's certificate, whose key is on disk beside it)."""
    for round_number in range(20):
        ca_dir = tmp_path / f"ca{round_number}"
        outcomes = at_once(8, functools.partial(node_certs.init_ca, ca_dir, ["localhost"]))
        made = [o for o in outcomes if isinstance(o, Path)]
        refused = [o for o in outcomes if isinstance(o, node_certs.CaError) and "exists" in str(o)]
        assert (len(made), len(refused)) == (1, 7), outcomes
        ca = x509.load_pem_x509_certificate((ca_dir / "ca.pem").read_bytes())
        server = x509.load_pem_x509_certificate((ca_dir / "server.pem").read_bytes())
        for cert, key_file in ((ca, "ca.key"), (server, "server.key")):
            key = serialization.load_pem_private_key((ca_dir / key_file).read_bytes(), None)
            assert key.public_key() == cert.public_key(), key_file
        server.verify_directly_issued_by(ca)  # raises unless the CA's key signed it


def test_issue_node_cert_names_the_node_and_replaces_the_previous_one(
    ca_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "n1"
    call_command("issue_node_cert", "n1", "--output-dir", str(out), stdout=StringIO())
    assert mode(out / "n1.key") == 0o600
    first = (out / "n1.pem").read_bytes()
    cert = x509.load_pem_x509_certificate(first)
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "n1"
    node = Node.objects.get(name="n1")
    assert node.cert_serial == format(cert.serial_number, "x")
    identity = node_certs.authenticate_certificate(first, "n1")
    assert (identity.name, identity.cert_serial) == ("n1", node.cert_serial)
    assert node_tokens.still_valid(identity)

    call_command("issue_node_cert", "n1", "--output-dir", str(out), stdout=StringIO())
    with pytest.raises(node_tokens.TokenRejected, match="revoked or replaced"):
        node_certs.authenticate_certificate(first, "n1")
    assert not node_tokens.still_valid(identity)  # an open stream ends at its next resync


def test_a_certificate_opens_only_its_own_nodes_stream(ca_dir: Path, tmp_path: Path) -> None:
    issued = node_certs.issue_node_cert("n1", ca_dir, tmp_path / "n1")
    node_certs.issue_node_cert("n2", ca_dir, tmp_path / "n2")
    with pytest.raises(node_tokens.TokenRejected, match="claims node 'n2'"):
        node_certs.authenticate_certificate(issued.cert_path.read_bytes(), "n2")


def test_revoke_node_cert_ends_it(ca_dir: Path, tmp_path: Path) -> None:
    issued = node_certs.issue_node_cert("n1", ca_dir, tmp_path / "n1")
    call_command("revoke_node_cert", "n1", stdout=StringIO())
    assert Node.objects.get(name="n1").cert_serial == ""
    with pytest.raises(node_tokens.TokenRejected):
        node_certs.authenticate_certificate(issued.cert_path.read_bytes(), None)
    assert Event.objects.filter(subject="node/n1", message="node certificate revoked").exists()
    with pytest.raises(CommandError, match="no valid certificate"):
        call_command("revoke_node_cert", "n1", stdout=StringIO())


def test_issuing_without_a_ca_says_what_to_run(tmp_path: Path, settings: Any) -> None:
    settings.LLMGW_CA_DIR = tmp_path / "none"
    with pytest.raises(CommandError, match="init_ca"):
        call_command("issue_node_cert", "n1", stdout=StringIO())


def test_every_close_code_has_a_grpc_status_of_its_own_meaning() -> None:
    from agents.protocol.vocabulary import CloseCode
    from control.agent_grpc import grpc_status

    unknown = [code for code in CloseCode if grpc_status(code).name == "UNKNOWN"]
    assert unknown == []
    assert grpc_status(CloseCode.RATE_LIMITED).name == "RESOURCE_EXHAUSTED"
    assert grpc_status(CloseCode.FORBIDDEN).name == "PERMISSION_DENIED"


def test_the_ca_and_a_nodes_certificate_are_owner_only_whatever_the_umask(
    tmp_path: Path, settings: Any
) -> None:
    """Another local user reads neither the CA nor a node's files, even when the process
    creating them has a umask that lets everyone read and write (000). (Folders above the one
    named, where missing, get their mode from the umask, which the settings restrict.)"""
    settings.LLMGW_CA_DIR = tmp_path / "ca"
    with umask(0):
        call_command("init_ca", stdout=StringIO())
        out = ["--output-dir", str(tmp_path / "n1")]
        call_command("issue_node_cert", "n1", *out, stdout=StringIO())
    assert {"ca.pem", "ca.key", "server.pem", "server.key"} <= {
        path.name for path in (tmp_path / "ca").iterdir()
    }
    assert {path.name for path in (tmp_path / "n1").iterdir()} == {"n1.key", "n1.pem", "ca.pem"}
    assert_owner_only(tmp_path / "ca")
    assert_owner_only(tmp_path / "n1")
