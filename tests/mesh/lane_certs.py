"""Throwaway certificates for the lane tests: a CA (ECDSA P-256) and certificates of the mesh's form, the URI SAN
`spiffe://kvmesh/<role>/<name>` and the DNS SAN `kvmesh`, written to a directory, and stdlib contexts over them
(server: a client certificate required; client: the CA checked, the address not, as mesh.tls does)."""

from __future__ import annotations

import datetime
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass(frozen=True)
class Authority:
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate
    ca_path: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _validity(builder: x509.CertificateBuilder) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return builder.not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(
        now + datetime.timedelta(days=1)
    )


def make_authority(directory: Path, name: str = "kvmesh test CA") -> Authority:
    key = ec.generate_private_key(ec.SECP256R1())
    builder = x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
    builder = _validity(builder.public_key(key.public_key()).serial_number(x509.random_serial_number()))
    cert = builder.add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True).sign(
        key, hashes.SHA256()
    )
    directory.mkdir(parents=True, exist_ok=True)
    ca_path = directory / f"{name.replace(' ', '-')}.pem"
    ca_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return Authority(key, cert, ca_path)


def issue(authority: Authority, directory: Path, role: str, name: str = "test") -> tuple[Path, Path]:
    """(certificate, key) files of `role`, signed by `authority`."""
    key = ec.generate_private_key(ec.SECP256R1())
    sans = [x509.UniformResourceIdentifier(f"spiffe://kvmesh/{role}/{name}"), x509.DNSName("kvmesh")]
    builder = x509.CertificateBuilder().subject_name(_name(f"{role}/{name}")).issuer_name(authority.cert.subject)
    builder = _validity(builder.public_key(key.public_key()).serial_number(x509.random_serial_number()))
    cert = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False).sign(authority.key, hashes.SHA256())
    cert_path = directory / f"{role}-{name}.pem"
    key_path = directory / f"{role}-{name}-key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


def server_context(authority: Authority, identity: tuple[Path, Path]) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.load_verify_locations(authority.ca_path)
    context.load_cert_chain(*identity)
    context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_context(authority: Authority, identity: tuple[Path, Path] | None) -> ssl.SSLContext:
    """A client of the mesh's CA; `identity` None: one that presents no certificate."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.load_verify_locations(authority.ca_path)
    if identity is not None:
        context.load_cert_chain(*identity)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_REQUIRED
    return context
