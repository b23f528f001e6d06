"""Throwaway PKI for TLS tests: a CA plus server and client certificates it signed, as PEM files.

    pki = make_pki(tmp_path)
    server_credentials(pki.server_cert, pki.server_key, client_ca_file=pki.ca_cert)
    channel_credentials(pki.ca_cert, pki.client_cert, pki.client_key)

The server certificate is valid for localhost, 127.0.0.1 and ::1.

`SecretVolume` lays certificates (or tokens) out as the kubelet mounts a Secret, and updates them as it
does, for the tests of rotation without a restart.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import shutil
from collections.abc import Mapping
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
    service_cert: Path  # server and client auth, for localhost: a service's own, for its clients and its calls
    service_key: Path


class SecretVolume:
    """A folder as the kubelet mounts a Secret: each file a link through `..data` to a versioned folder.
    `update` writes the new version beside it and swaps `..data` to it in one rename, then removes the old
    version, so a reader sees every file of one version or of the other."""

    def __init__(self, root: Path, files: Mapping[str, bytes]) -> None:
        root.mkdir(parents=True)
        self.root = root
        self._version = 0
        self.update(files)

    def __truediv__(self, name: str) -> Path:
        return self.root / name

    def update(self, files: Mapping[str, bytes]) -> None:
        self._version += 1
        version = self.root / f"..version-{self._version}"
        version.mkdir()
        for name, data in files.items():
            (version / name).write_bytes(data)
        swap = self.root / "..data_tmp"
        swap.symlink_to(version.name)
        os.replace(swap, self.root / "..data")
        for name in files:
            if not (self.root / name).is_symlink():
                (self.root / name).symlink_to(f"..data/{name}")
        if self._version > 1:
            shutil.rmtree(self.root / f"..version-{self._version - 1}")


def tls_files(pki: Pki, holder: str = "server") -> dict[str, bytes]:
    """The files of `pki`'s server, client or service (both usages) certificate, as cert-manager puts them in its
    Secret: tls.crt, tls.key, and the CA as ca.crt."""
    cert, key = {"server": (pki.server_cert, pki.server_key), "client": (pki.client_cert, pki.client_key),
                 "service": (pki.service_cert, pki.service_key)}[holder]
    return {"tls.crt": cert.read_bytes(), "tls.key": key.read_bytes(), "ca.crt": pki.ca_cert.read_bytes()}


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
    server_cert, server_key = _leaf(issuer, "localhost", [ExtendedKeyUsageOID.SERVER_AUTH], sans)
    client_cert, client_key = _leaf(issuer, "splitspec test client", [ExtendedKeyUsageOID.CLIENT_AUTH], [])
    service_cert, service_key = _leaf(issuer, "localhost", [ExtendedKeyUsageOID.SERVER_AUTH,
                                                            ExtendedKeyUsageOID.CLIENT_AUTH], sans)

    def write(name: str, pem: bytes) -> Path:
        path = directory / f"{prefix}{name}.pem"
        path.write_bytes(pem)
        return path

    return Pki(
        ca_cert=write("ca", ca.public_bytes(serialization.Encoding.PEM)),
        server_cert=write("server", server_cert), server_key=write("server-key", server_key),
        client_cert=write("client", client_cert), client_key=write("client-key", client_key),
        service_cert=write("service", service_cert), service_key=write("service-key", service_key))


def _leaf(issuer: _Issuer, common_name: str, usages: list[x509.ObjectIdentifier],
          sans: list[x509.GeneralName]) -> tuple[bytes, bytes]:
    key = ec.generate_private_key(ec.SECP256R1())
    builder = _builder(_name(common_name), issuer.name, key.public_key()).add_extension(
        x509.BasicConstraints(ca=False, path_length=None), critical=True).add_extension(
        x509.ExtendedKeyUsage(usages), critical=False)
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
