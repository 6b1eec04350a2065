"""Who a process is inside the mesh, and the certificates that prove it.

Every process holds a certificate of the mesh's CA whose URI SAN names its role and instance,
`spiffe://kvmesh/<role>/<name>` (SPIFFE-style, as Istio names its workloads), and the DNS SAN `kvmesh`: workers
announce their addresses at run time, so a client cannot check a server's address against its certificate and
checks instead that it is a member of the mesh (`SERVER_NAME`, gRPC's `ssl_target_name_override`). Servers
demand a client certificate and authorize each call by the caller's role (mesh.access, enforced in mesh.rpc).

    credentials = load_credentials("decode")          # from KVMESH_TLS_DIR / KVMESH_TLS_CERT,KEY,CA
    server_ssl_context(credentials)                    # stdlib contexts over the same CA, for the bulk lanes
    peer_identity_of_ssl(writer.get_extra_info("ssl_object"))

KVMESH_INSECURE=1 turns all of it off (`load_credentials` returns None and logs a warning); without it a process
that has no certificates refuses to start, saying how to make them.
"""

from __future__ import annotations

import datetime
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography import x509

from mesh.config import SettingError, TLSSettings, load_settings
from mesh.logging import get_logger

log = get_logger(__name__)

TRUST_DOMAIN = "kvmesh"
SERVER_NAME = "kvmesh"  # the DNS SAN of every certificate: what clients verify servers against
CA_FILE = "ca.pem"
HOW_TO_GET_CERTIFICATES = (
    "make them with `kvmesh certs init DIR` and set KVMESH_TLS_DIR=DIR (or KVMESH_TLS_CERT, KVMESH_TLS_KEY and "
    "KVMESH_TLS_CA), or set KVMESH_INSECURE=1 for plaintext without identities (development only)"
)


class CertificateError(SettingError):
    """Certificates that are missing, unreadable, expired or name another role; the message says how to fix it."""


@dataclass(frozen=True)
class PeerIdentity:
    """A process of the mesh as its certificate names it."""

    role: str  # gateway, prefill, decode, kvcache, balancer, expert_lb, encoder
    name: str  # the instance: a worker id under `kvmesh up`, the role's name in a shared per-role certificate

    @property
    def uri(self) -> str:
        return f"spiffe://{TRUST_DOMAIN}/{self.role}/{self.name}"

    @classmethod
    def parse(cls, uri: str) -> PeerIdentity | None:
        """The identity in a URI SAN; None for anything but `spiffe://kvmesh/<role>/<name>`."""
        prefix = f"spiffe://{TRUST_DOMAIN}/"
        if not uri.startswith(prefix):
            return None
        role, _, name = uri[len(prefix) :].partition("/")
        return cls(role, name) if role and name and "/" not in name else None


@dataclass(frozen=True)
class MeshCredentials:
    """This process's certificate, key and the mesh's CA, read once at start."""

    identity: PeerIdentity
    ca_path: Path
    cert_path: Path
    key_path: Path
    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes = field(repr=False)


def certificate_paths(directory: Path, role: str) -> tuple[Path, Path, Path]:
    """(ca, cert, key) of `role` in a directory `kvmesh certs init` wrote: flat (<role>.pem) or per role (<role>/)."""
    for base in (directory, directory / role):
        if (base / f"{role}.pem").exists():
            return base / CA_FILE, base / f"{role}.pem", base / f"{role}-key.pem"
    return directory / CA_FILE, directory / f"{role}.pem", directory / f"{role}-key.pem"


def load_credentials(role: str, settings: TLSSettings | None = None) -> MeshCredentials | None:
    """This process's credentials as `role`, from KVMESH_TLS_* (None under KVMESH_INSECURE=1, with a warning).

    Raises CertificateError when there are none, or they cannot be read, have expired or name another role."""
    settings = settings or load_settings(TLSSettings)
    if settings.insecure:
        log.warning(
            "KVMESH_INSECURE is set: internal gRPC is plaintext and any peer may call any method",
            role=role,
        )
        return None
    if settings.tls_cert:
        paths = (Path(settings.tls_ca), Path(settings.tls_cert), Path(settings.tls_key))
    elif settings.tls_dir:
        paths = certificate_paths(Path(settings.tls_dir).expanduser(), role)
    else:
        raise CertificateError(f"{role}: no certificates for the mesh's internal gRPC: {HOW_TO_GET_CERTIFICATES}")
    ca_path, cert_path, key_path = paths
    missing = [str(path) for path in paths if not path.is_file()]
    if missing:
        raise CertificateError(f"{role}: missing {', '.join(missing)}: {HOW_TO_GET_CERTIFICATES}")
    ca_pem, cert_pem, key_pem = (path.read_bytes() for path in paths)
    identity = _check_certificate(cert_pem, cert_path, role)
    return MeshCredentials(identity, ca_path, cert_path, key_path, ca_pem, cert_pem, key_pem)


def _check_certificate(cert_pem: bytes, path: Path, role: str) -> PeerIdentity:
    try:
        certificate = x509.load_pem_x509_certificate(cert_pem)
    except ValueError as exc:
        raise CertificateError(f"{path}: not a PEM certificate ({exc})") from None
    now = datetime.datetime.now(datetime.timezone.utc)
    if not certificate.not_valid_before_utc <= now <= certificate.not_valid_after_utc:
        raise CertificateError(
            f"{path}: valid from {certificate.not_valid_before_utc:%Y-%m-%d} to "
            f"{certificate.not_valid_after_utc:%Y-%m-%d}, not now: {HOW_TO_GET_CERTIFICATES}"
        )
    identities = [identity for uri in _uri_sans(certificate) if (identity := PeerIdentity.parse(uri))]
    if not identities:
        raise CertificateError(f"{path}: no spiffe://{TRUST_DOMAIN}/<role>/<name> URI in its SAN")
    if identities[0].role != role:
        raise CertificateError(f"{path}: names {identities[0].uri}, but this process is a {role}")
    return identities[0]


def _uri_sans(certificate: x509.Certificate) -> list[str]:
    try:
        names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [str(uri) for uri in names.get_values_for_type(x509.UniformResourceIdentifier)]


def peer_identity(auth_context: Mapping[str, Sequence[bytes]]) -> PeerIdentity | None:
    """The caller's identity from a gRPC auth context (`context.auth_context()`); None without one."""
    uris = [*auth_context.get("peer_spiffe_id", ()), *auth_context.get("x509_subject_alternative_name", ())]
    for uri in uris:
        identity = PeerIdentity.parse(uri.decode("utf-8", "replace"))
        if identity is not None:
            return identity
    return None


def server_ssl_context(credentials: MeshCredentials) -> ssl.SSLContext:
    """A stdlib server context (the bulk lanes): TLS 1.3, and a client certificate of the mesh's CA required."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    _load(context, credentials)
    context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_ssl_context(credentials: MeshCredentials) -> ssl.SSLContext:
    """A stdlib client context: the server must hold a certificate of the mesh's CA; its address is not checked
    (workers announce addresses at run time), so read its role with `peer_identity_of_ssl` where it matters."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    _load(context, credentials)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_REQUIRED
    return context


def _load(context: ssl.SSLContext, credentials: MeshCredentials) -> None:
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.load_verify_locations(cadata=credentials.ca_pem.decode())
    context.load_cert_chain(credentials.cert_path, credentials.key_path)


def peer_identity_of_ssl(ssl_object: ssl.SSLObject | ssl.SSLSocket | None) -> PeerIdentity | None:
    """The peer's identity on a stdlib TLS connection (`writer.get_extra_info("ssl_object")`)."""
    certificate: dict[str, Any] = (ssl_object.getpeercert() if ssl_object is not None else None) or {}
    for kind, value in certificate.get("subjectAltName", ()):
        identity = PeerIdentity.parse(str(value)) if kind == "URI" else None
        if identity is not None:
            return identity
    return None
