"""Test certificates, generated in the test with `cryptography` (nothing checked in): a CA, a leaf
it signs for loopback (SAN localhost, 127.0.0.1, ::1) and a rogue CA with its own leaf."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass(frozen=True)
class Pem:
    cert: Path
    key: Path


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(directory: Path, stem: str, cert: x509.Certificate, key) -> Pem:
    c, k = directory / f"{stem}.crt", directory / f"{stem}.key"
    c.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    k.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()))
    k.chmod(0o600)
    return Pem(c, k)


def make_ca(directory: Path, cn: str) -> tuple[Pem, x509.Certificate, object]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn)).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    return _write(directory, cn, cert, key), cert, key


def make_leaf(directory: Path, stem: str, ca_cert: x509.Certificate, ca_key, cn: str = "aerie") -> Pem:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    san = x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.DNSName("aerie-internal"),
                                       x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                       x509.IPAddress(ipaddress.ip_address("::1"))])
    cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(san, critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(ca_key, hashes.SHA256()))
    return _write(directory, stem, cert, key)


@dataclass(frozen=True)
class Pki:
    ca: Pem
    leaf: Pem  # the services' certificate (server and client), signed by `ca`
    rogue_ca: Pem
    rogue_leaf: Pem  # signed by another CA: must be refused


def make_pki(directory: Path) -> Pki:
    directory.mkdir(parents=True, exist_ok=True)
    ca, ca_cert, ca_key = make_ca(directory, "aerie-test-ca")
    rogue, rogue_cert, rogue_key = make_ca(directory, "rogue-ca")
    return Pki(ca, make_leaf(directory, "aerie", ca_cert, ca_key),
                   rogue, make_leaf(directory, "rogue", rogue_cert, rogue_key, cn="rogue"))
