"""Throwaway PKI for TLS tests: a CA plus server and client certificates it signed, as PEM files.

    pki = make_pki(tmp_path)
    server_credentials(pki.server_cert, pki.server_key, client_ca_file=pki.ca_cert)
    channel_credentials(pki.ca_cert, pki.client_cert, pki.client_key)

The server certificate is valid for localhost, 127.0.0.1 and ::1.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pki:
    ca_cert: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


@dataclass(frozen=True)
class _Issuer:
    name: x509.Name
    key: ec.EllipticCurvePrivateKey


def make_pki(directory: Path, prefix: str = "") -> Pki:
    """Write a fresh CA and a server and a client certificate under `directory` (names start with `prefix`)."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name(f"{prefix}test CA")
    ca = _builder(ca_name, ca_name, ca_key.public_key()).add_extension(
        x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(ca_key, hashes.SHA256())
    issuer = _Issuer(ca_name, ca_key)
    sans = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
            x509.IPAddress(ipaddress.ip_address("::1"))]
    server_cert, server_key = _leaf(issuer, "localhost", ExtendedKeyUsageOID.SERVER_AUTH, sans)
    client_cert, client_key = _leaf(issuer, "splitspec test client", ExtendedKeyUsageOID.CLIENT_AUTH, [])

    def write(name: str, pem: bytes) -> Path:
        path = directory / f"{prefix}{name}.pem"
        path.write_bytes(pem)
        return path

    return Pki(
        ca_cert=write("ca", ca.public_bytes(serialization.Encoding.PEM)),
        server_cert=write("server", server_cert), server_key=write("server-key", server_key),
        client_cert=write("client", client_cert), client_key=write("client-key", client_key))


def _leaf(issuer: _Issuer, common_name: str, usage: x509.ObjectIdentifier,
          sans: list[x509.GeneralName]) -> tuple[bytes, bytes]:
    key = ec.generate_private_key(ec.SECP256R1())
    builder = _builder(_name(common_name), issuer.name, key.public_key()).add_extension(
        x509.BasicConstraints(ca=False, path_length=None), critical=True).add_extension(
        x509.ExtendedKeyUsage([usage]), critical=False)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(issuer.key, hashes.SHA256())
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def _builder(subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1)))


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
