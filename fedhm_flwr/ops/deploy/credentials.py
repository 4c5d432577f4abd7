"""A deployment's credentials: a CA, the SuperLink's TLS certificate, one key pair per SuperNode.

Written with the ``cryptography`` package (a dependency of Flower), because one library makes
both the X.509 certificates and the OpenSSH keys (what ``flower-supernode
--auth-supernode-private-key`` and ``flwr supernode register`` read), which ``openssl`` alone
cannot write; docs/DEPLOY.md gives the equivalent ``openssl`` / ``ssh-keygen`` commands.
``fedhm deploy-local --credentials-only DIR`` writes them for real machines.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.types import (
    CertificateIssuerPrivateKeyTypes,
    CertificateIssuerPublicKeyTypes,
)
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

#: names and addresses the SuperLink's certificate is always valid for
DEFAULT_SANS = ("localhost", "127.0.0.1", "::1")


def _write_private(path: Path, data: bytes) -> None:
    """Write a secret readable by its owner only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def create_ca(directory: Path, days: int = 30, name: str = "fedhm-flwr deployment CA") -> tuple[Path, Path]:
    """A self-signed certificate authority: (``ca.pem``, ``ca.key``)."""
    key = ec.generate_private_key(ec.SECP384R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "ca.pem").write_bytes(_pem(cert))
    _write_private(
        directory / "ca.key",
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
    )
    return directory / "ca.pem", directory / "ca.key"


def create_server_certificate(
    directory: Path, ca_cert: Path, ca_key: Path, sans: Sequence[str] = DEFAULT_SANS, days: int = 30
) -> tuple[Path, Path]:
    """The SuperLink's TLS certificate signed by the CA, valid for ``sans``: (``server.pem``, ``server.key``).

    Each SAN is an IP address when it parses as one, else a DNS name. A SuperNode (and the
    ``flwr`` CLI) must reach the SuperLink under one of these names.
    """
    ca = x509.load_pem_x509_certificate(ca_cert.read_bytes())
    # a CA's key (create_ca's EC key): one that signs certificates, which the loader's type does not say
    signer = cast(
        CertificateIssuerPrivateKeyTypes, serialization.load_pem_private_key(ca_key.read_bytes(), password=None)
    )
    key = ec.generate_private_key(ec.SECP384R1())
    names: list[x509.GeneralName] = []
    for san in dict.fromkeys(sans):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(san)))
        except ValueError:
            names.append(x509.DNSName(san))
    now = dt.datetime.now(dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, str(sans[0]))]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(cast(CertificateIssuerPublicKeyTypes, ca.public_key())),
            critical=False,
        )
        .sign(signer, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "server.pem").write_bytes(_pem(cert))
    _write_private(
        directory / "server.key",
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
    )
    return directory / "server.pem", directory / "server.key"


def create_node_keys(directory: Path, comment: str = "") -> tuple[Path, Path]:
    """A SuperNode's authentication key pair, EC P-384 in OpenSSH format: (``node.key``, ``node.pub``).

    The same as ``ssh-keygen -t ecdsa -b 384 -N "" -f node.key`` (``node.key.pub`` there).
    """
    key = ec.generate_private_key(ec.SECP384R1())
    _write_private(
        directory / "node.key",
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
        ),
    )
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    (directory / "node.pub").write_bytes(public + (f" {comment}".encode() if comment else b"") + b"\n")
    return directory / "node.key", directory / "node.pub"


@dataclass
class Credentials:
    """Where a deployment's credentials are (see :func:`create_credentials`)."""

    root: Path

    @property
    def ca_cert(self) -> Path:
        return self.root / "ca" / "ca.pem"

    @property
    def ca_key(self) -> Path:
        return self.root / "ca" / "ca.key"

    @property
    def server_dir(self) -> Path:
        return self.root / "superlink"

    def node_dir(self, name: str) -> Path:
        return self.root / "supernodes" / name


def create_credentials(
    root: Path, node_names: Sequence[str], sans: Sequence[str] = DEFAULT_SANS, days: int = 30
) -> Credentials:
    """The files of a deployment, laid out as they are handed out to the machines::

    ca/ca.pem, ca/ca.key                  the CA (keep ca.key offline)
    superlink/ca.pem, server.pem, server.key      -> the server
    supernodes/<name>/ca.pem, node.key, node.pub  -> device <name> (node.pub also to the server admin)
    """
    creds = Credentials(root.resolve())
    ca_cert, ca_key = create_ca(creds.ca_cert.parent, days)
    create_server_certificate(creds.server_dir, ca_cert, ca_key, list(sans), days)
    shutil.copyfile(ca_cert, creds.server_dir / "ca.pem")
    for name in node_names:
        add_node(creds, name)
    return creds


def add_node(creds: Credentials, name: str) -> Path:
    """Key pair and CA certificate for one more SuperNode; returns its folder."""
    folder = creds.node_dir(name)
    folder.mkdir(parents=True, exist_ok=True)
    create_node_keys(folder, comment=name)
    shutil.copyfile(creds.ca_cert, folder / "ca.pem")
    return folder
