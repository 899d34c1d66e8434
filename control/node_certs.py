"""The cluster's own certificate authority, and node certificates issued from it.

``manage.py init_ca`` makes the CA (and the agent listener's server certificate) in
``LLMGW_CA_DIR``; ``issue_node_cert NODE`` writes a node's certificate and key, the node's name
as the certificate's common name; ``revoke_node_cert NODE`` ends it. Private keys are written
mode 0600 (and the certificates beside them: every file here is its owner's alone) and never
leave the file they are written to.

Revocation is an allowlist rather than a list of the revoked: a node has exactly one valid
certificate, the one whose serial number its row holds (:attr:`Node.cert_serial`). Issuing a
new certificate therefore revokes the old one, and a certificate of a node that was deleted
opens nothing. Every open stream re-checks its serial on each resync.
"""

from __future__ import annotations

import datetime
import fcntl
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from django.db import transaction
from django.utils import timezone

from control import nudges
from control.models import Event, Node
from control.node_tokens import NodeIdentity, TokenRejected

CA_CERT: Final = "ca.pem"
CA_KEY: Final = "ca.key"
SERVER_CERT: Final = "server.pem"
SERVER_KEY: Final = "server.key"
INIT_LOCK: Final = ".init_ca.lock"
CA_DAYS: Final = 3650
LEAF_DAYS: Final = 397


class CaError(Exception):
    """The CA is missing, or would be overwritten."""


@dataclass(frozen=True)
class IssuedCert:
    cert_path: Path
    key_path: Path
    ca_path: Path
    serial: str


def serial_hex(cert: x509.Certificate) -> str:
    return format(cert.serial_number, "x")


def write_private(path: Path, data: bytes) -> None:
    """Write a file readable by its owner only, from the first byte (never chmod after: the
    file would be world-readable in between). Certificates too: nobody else on this machine
    has a reason to read them."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT; make it 0600
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "llmgw"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _san(names: list[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for name in names:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


def _leaf(
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    common_name: str,
    names: list[str],
    usage: x509.ObjectIdentifier,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=LEAF_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(_san(names), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return cert, key


def init_ca(ca_dir: Path, server_names: list[str], *, force: bool = False) -> Path:
    """Make the cluster CA and the agent listener's certificate (valid for ``server_names``:
    the host names and addresses agents dial). Refuses to replace an existing CA unless
    ``force``: every node certificate issued from it would stop working.

    One at a time in ``ca_dir`` (an exclusive lock on a file there): two run together (a deploy
    script on every host of shared storage) would both find no CA and write one each, leaving
    one's key beside the other's certificate; holding the lock, the second is refused as if it
    had come later."""
    ca_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(ca_dir / INIT_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return _make_ca(ca_dir, server_names, force=force)
    finally:
        os.close(fd)  # the lock goes with the descriptor


def _make_ca(ca_dir: Path, server_names: list[str], *, force: bool) -> Path:
    ca_path = ca_dir / CA_CERT
    if ca_path.exists() and not force:
        raise CaError(
            f"{ca_path} exists; every node certificate depends on it (use --force to replace "
            "it, then issue every node a new certificate)"
        )
    key = ec.generate_private_key(ec.SECP384R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("llmgw cluster CA"))
        .issuer_name(_name("llmgw cluster CA"))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    ca_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_private(ca_dir / CA_KEY, _key_pem(key))
    write_private(ca_path, cert.public_bytes(serialization.Encoding.PEM))
    server_cert, server_key = _leaf(
        cert, key, server_names[0], server_names, ExtendedKeyUsageOID.SERVER_AUTH
    )
    write_private(ca_dir / SERVER_KEY, _key_pem(server_key))
    write_private(ca_dir / SERVER_CERT, server_cert.public_bytes(serialization.Encoding.PEM))
    return ca_path


def load_ca(ca_dir: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    try:
        cert = x509.load_pem_x509_certificate((ca_dir / CA_CERT).read_bytes())
        key = serialization.load_pem_private_key((ca_dir / CA_KEY).read_bytes(), password=None)
    except OSError as exc:
        raise CaError(
            f"no CA in {ca_dir} ({exc.strerror}); run `manage.py init_ca` first"
        ) from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise CaError(f"{ca_dir / CA_KEY} is not an EC key made by init_ca")
    return cert, key


@dataclass(frozen=True)
class MintedCert:
    """A node's new certificate, its private key and the CA certificate, as PEM: the key exists
    nowhere else (the caller writes it to a 0600 file or hands it over once)."""

    cert_pem: bytes
    key_pem: bytes
    ca_pem: bytes
    serial: str


def mint_node_cert(name: str, ca_dir: Path) -> MintedCert:
    """The state change: a new certificate and key for node ``name`` (registered if new),
    whose serial becomes the node's one valid certificate. The node's earlier certificate stops
    working, and its streams are closed after commit. ``issue_node_cert`` (``manage.py``) and
    the admin API both come through here."""
    ca_cert, ca_key = load_ca(ca_dir)
    cert, key = _leaf(ca_cert, ca_key, name, [name], ExtendedKeyUsageOID.CLIENT_AUTH)
    serial = serial_hex(cert)
    with transaction.atomic():
        node, created = Node.objects.get_or_create(name=name)
        replaced = bool(node.cert_serial)
        Node.objects.filter(pk=node.pk).update(cert_serial=serial, cert_issued_at=timezone.now())
        Event.objects.create(
            kind=Event.Kind.NODE,
            subject=f"node/{name}",
            message=f"node certificate issued (serial {serial[:12]}…)"
            + (", node registered" if created else "")
            + (", the previous certificate no longer works" if replaced else ""),
        )
        if replaced:
            nudges.send_on_commit(node.pk, nudges.TOKEN_REVOKED)
    return MintedCert(
        cert.public_bytes(serialization.Encoding.PEM),
        _key_pem(key),
        ca_cert.public_bytes(serialization.Encoding.PEM),
        serial,
    )


def issue_node_cert(name: str, ca_dir: Path, out_dir: Path) -> IssuedCert:
    """A new certificate and key for node ``name`` (see :func:`mint_node_cert`) written to
    ``out_dir``, with a copy of the CA certificate the agent verifies the control plane by."""
    minted = mint_node_cert(name, ca_dir)
    out_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    key_path, cert_path, ca_path = (
        out_dir / f"{name}.key",
        out_dir / f"{name}.pem",
        out_dir / CA_CERT,
    )
    write_private(key_path, minted.key_pem)
    write_private(cert_path, minted.cert_pem)
    write_private(ca_path, minted.ca_pem)
    return IssuedCert(cert_path, key_path, ca_path, minted.serial)


def revoke_node_cert(name: str) -> bool:
    """End node ``name``'s certificate; its streams close after commit, and within one resync
    interval on every web process without a channel layer. False: nothing to revoke."""
    with transaction.atomic():
        node = Node.objects.filter(name=name).only("pk").first()
        if node is None:
            return False
        revoked = Node.objects.filter(pk=node.pk).exclude(cert_serial="").update(cert_serial="")
        if revoked:
            Event.objects.create(
                kind=Event.Kind.NODE, subject=f"node/{name}", message="node certificate revoked"
            )
            nudges.send_on_commit(node.pk, nudges.TOKEN_REVOKED)
    return bool(revoked)


def peer_identity(pem: bytes) -> tuple[str, str]:
    """(common name, serial) of a client certificate the TLS layer has already verified
    against the CA."""
    cert = x509.load_pem_x509_certificate(pem)
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    common_name = str(names[0].value) if names else ""
    return common_name, serial_hex(cert)


def authenticate_certificate(pem: bytes, claimed_node: str | None) -> NodeIdentity:
    """The node a verified client certificate names, if it is that node's current one.
    Raises :class:`TokenRejected` with a reason for the log."""
    common_name, serial = peer_identity(pem)
    row = (
        Node.objects.filter(name=common_name, cert_serial=serial).values_list("pk", "name").first()
    )
    if row is None:
        raise TokenRejected(f"the certificate of node {common_name!r} is revoked or replaced")
    if claimed_node is not None and claimed_node != row[1]:
        raise TokenRejected(f"the certificate of node {row[1]!r} claims node {claimed_node!r}")
    return NodeIdentity(id=row[0], name=row[1], cert_serial=serial)
