"""The mesh's certificates (the `cryptography` package): a CA and one certificate per role or per process.

    kvmesh certs init DIR     ca.pem, and <role>/ with ca.pem, <role>.pem and <role>-key.pem for every role
                              (KVMESH_TLS_DIR=DIR serves every role on one host; compose mounts <role>/ alone),
                              <role>/nats.creds (the role's NATS user and password, 0600), and nats/ with the
                              NATS server's certificate and nats-server.conf (users bcrypt-hashed, permissions)
      [--worker ROLE/NAME]    and NAME/ the same for one worker of ROLE: its certificate names it
                              (spiffe://kvmesh/ROLE/NAME) and its NATS user may speak only as NAME

Keys are ECDSA P-256, certificates valid for a year. The CA's key is never written: a new CA means running init
again (--force), which re-issues every certificate. `kvmesh up` keeps a throwaway CA in memory and issues one
certificate per child (`ProcessCertificates`), so each worker's name is in its own certificate.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kvmesh.nats_config import Grant, ServerTLS, new_password, role_grants, role_user_name, server_config
from mesh.access import ROLES
from mesh.bus_auth import CREDS_FILE, NatsUser, permissions
from mesh.config import TLSSettings, load_settings
from mesh.tls import CA_FILE, SERVER_NAME, MeshCredentials, PeerIdentity, load_credentials

VALID_FOR = datetime.timedelta(days=365)
CLOCK_SKEW = datetime.timedelta(minutes=5)  # valid from a little before now: peers' clocks differ
NATS_DIR = "nats"  # the NATS server's directory (and the role its certificate names)
NATS_CONFIG = "nats-server.conf"
WORKER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,62}")  # one NATS subject token, a DNS label


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    encoding, unencrypted = serialization.Encoding.PEM, serialization.NoEncryption()
    return key.private_bytes(encoding, serialization.PrivateFormat.PKCS8, unencrypted)


def _builder(subject: str, issuer: x509.Name, public_key: Any) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + VALID_FOR)
    )


@dataclass(frozen=True)
class CertificateAuthority:
    """The mesh's CA; its key stays in this object."""

    key: ec.EllipticCurvePrivateKey
    certificate: x509.Certificate

    @classmethod
    def create(cls, common_name: str = "kvmesh CA") -> CertificateAuthority:
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        usage = x509.KeyUsage(
            digital_signature=True,
            content_commitment=False,
            key_encipherment=False,
            data_encipherment=False,
            key_agreement=False,
            key_cert_sign=True,
            crl_sign=True,
            encipher_only=False,
            decipher_only=False,
        )
        certificate = (
            _builder(common_name, name, key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(usage, critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256())
        )
        return cls(key, certificate)

    @property
    def pem(self) -> bytes:
        return self.certificate.public_bytes(serialization.Encoding.PEM)

    def issue(self, identity: PeerIdentity) -> tuple[bytes, bytes]:
        """(certificate PEM, key PEM) for one identity: its URI SAN, and the DNS SAN every peer verifies."""
        key = ec.generate_private_key(ec.SECP256R1())
        names = x509.SubjectAlternativeName([x509.UniformResourceIdentifier(identity.uri), x509.DNSName(SERVER_NAME)])
        usages = x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH])
        certificate = (
            _builder(f"{identity.role}/{identity.name}", self.certificate.subject, key.public_key())
            .add_extension(names, critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(usages, critical=False)
            .sign(self.key, hashes.SHA256())
        )
        return certificate.public_bytes(serialization.Encoding.PEM), _pem_key(key)

    def write(self, directory: Path, identity: PeerIdentity) -> Path:
        """ca.pem, <role>.pem and <role>-key.pem (owner-only) in `directory`; returns the directory."""
        directory.mkdir(parents=True, exist_ok=True)
        certificate, key = self.issue(identity)
        (directory / CA_FILE).write_bytes(self.pem)
        (directory / f"{identity.role}.pem").write_bytes(certificate)
        key_path = directory / f"{identity.role}-key.pem"
        key_path.touch(mode=0o600)
        os.chmod(key_path, 0o600)  # before the key is in it, whatever the umask
        key_path.write_bytes(key)
        return directory


def parse_worker(text: str) -> tuple[str, str]:
    """ROLE/NAME (a `--worker`) as (role, name); ValueError naming what is wrong."""
    role, _, name = text.partition("/")
    if role not in ROLES:
        raise ValueError(f"--worker {text}: the role must be one of {', '.join(ROLES)}")
    if not WORKER_NAME.fullmatch(name) or name in ROLES or name == NATS_DIR:
        raise ValueError(
            f"--worker {text}: NAME must be letters, digits, '-' and '_' (63 at most), not a role's name; it becomes "
            "the worker's KVMESH_WORKER_ID and its directory"
        )
    return role, name


def init_directory(
    directory: Path, roles: tuple[str, ...] = ROLES, workers: tuple[tuple[str, str], ...] = ()
) -> CertificateAuthority:
    """A new CA and one certificate per role, `spiffe://kvmesh/<role>/<role>`, each role's under <role>/, one per
    named worker, `spiffe://kvmesh/<role>/<name>` under <name>/, and what NATS needs (`write_nats`)."""
    authority = CertificateAuthority.create()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CA_FILE).write_bytes(authority.pem)
    for role in roles:
        authority.write(directory / role, PeerIdentity(role, role))
    for role, name in workers:
        authority.write(directory / name, PeerIdentity(role, name))
    write_nats(directory, authority, roles, workers)
    return authority


def write_nats(
    directory: Path,
    authority: CertificateAuthority,
    roles: tuple[str, ...] = ROLES,
    workers: tuple[tuple[str, str], ...] = (),
) -> Path:
    """NATS's side: one user per role with a new random password, plain only in <role>/nats.creds (0600), and
    one per named worker in <name>/nats.creds, allowed only its own `{worker}` subjects; hashed in
    nats/nats-server.conf beside the server's certificate (`spiffe://kvmesh/nats/nats`, DNS SAN `kvmesh`),
    which demands TLS with a client certificate of this CA. The paths in the file are absolute, as `directory`
    is here: compose runs init at /certs and mounts the volume at /certs in the nats container too."""
    server_dir = authority.write(directory / NATS_DIR, PeerIdentity(NATS_DIR, NATS_DIR))
    grants = role_grants(roles)
    for grant, role in zip(grants, roles, strict=True):
        grant.user.write(directory / role / CREDS_FILE)
    for role, name in workers:
        grant = Grant(NatsUser(role_user_name(role, name), new_password()), permissions(role, name))
        grant.user.write(directory / name / CREDS_FILE)
        grants.append(grant)
    base = server_dir.absolute()
    tls = ServerTLS(base / f"{NATS_DIR}.pem", base / f"{NATS_DIR}-key.pem", base / CA_FILE)
    config = server_dir / NATS_CONFIG
    config.write_text(server_config(grants, tls))
    return config


class ProcessCertificates:
    """A throwaway CA (`kvmesh up`, the benchmarks that start roles): one directory per process under `directory`,
    which becomes that process's KVMESH_TLS_DIR. Under KVMESH_INSECURE=1 it issues nothing and passes that on."""

    def __init__(self, directory: Path, env: Mapping[str, str] | None = None) -> None:
        self.directory = directory
        self.insecure = load_settings(TLSSettings, env).insecure
        self.authority = CertificateAuthority.create("kvmesh throwaway CA")

    def issue(self, role: str, name: str) -> Path:
        return self.authority.write(self.directory / name, PeerIdentity(role, name))

    def env(self, role: str, name: str) -> dict[str, str]:
        """The KVMESH_TLS_* variables of a child process `name` playing `role` (explicit paths cleared)."""
        if self.insecure:
            return {"KVMESH_INSECURE": "1"}
        tls_dir = str(self.issue(role, name))
        return {"KVMESH_TLS_DIR": tls_dir, "KVMESH_TLS_CERT": "", "KVMESH_TLS_KEY": "", "KVMESH_TLS_CA": ""}

    def credentials(self, role: str, name: str) -> MeshCredentials | None:
        """Credentials for this process to call the children as `role` (None under KVMESH_INSECURE=1)."""
        if self.insecure:
            return load_credentials(role, TLSSettings(insecure=True))
        return load_credentials(role, TLSSettings(tls_dir=str(self.issue(role, name))))


def add_parser(commands: Any) -> None:
    """`kvmesh certs`: the subparser, registered by kvmesh.cli."""
    certs = commands.add_parser("certs", help="make the mesh's CA and certificates (mutual TLS between roles)")
    certs_commands = certs.add_subparsers(dest="certs_command", required=True)
    init = certs_commands.add_parser("init", help="a CA and one certificate per role in DIR (KVMESH_TLS_DIR=DIR)")
    init.add_argument("directory", metavar="DIR")
    init.add_argument("--force", action="store_true", help="replace the certificates already in DIR (a new CA)")
    init.add_argument(
        "--worker",
        action="append",
        default=[],
        metavar="ROLE/NAME",
        help="also a certificate and NATS user for one worker (repeat it): run it with KVMESH_TLS_DIR=DIR/NAME "
        "and KVMESH_WORKER_ID=NAME; its NATS user may announce and publish only as NAME",
    )


def run(args: argparse.Namespace) -> int:
    directory = Path(args.directory).expanduser()
    try:
        workers = tuple(parse_worker(text) for text in args.worker)
    except ValueError as exc:
        print(f"kvmesh certs: {exc}", file=sys.stderr)
        return 2
    if (directory / CA_FILE).exists() and not args.force:
        print(f"kvmesh certs: {directory} already holds a CA (--force makes a new one)", file=sys.stderr)
        if workers:  # the CA's key is not kept: nothing can be added to what it signed
            print("  --worker makes certificates of a new CA: run init again with --force", file=sys.stderr)
            return 1
        if not (directory / NATS_DIR / NATS_CONFIG).exists():  # made before NATS had users: no CA key to add them
            print(f"  but no {NATS_DIR}/{NATS_CONFIG}: run init again with --force for NATS's users", file=sys.stderr)
            return 1
        return 0
    init_directory(directory, workers=workers)
    print(f"kvmesh certs: a CA and certificates for {', '.join(ROLES)} in {directory}", file=sys.stderr)
    for role, name in workers:
        print(f"  worker {name} ({role}): KVMESH_TLS_DIR={directory / name} KVMESH_WORKER_ID={name}", file=sys.stderr)
    print(f"  NATS: {directory / NATS_DIR / NATS_CONFIG} and <role>/{CREDS_FILE} (one user per role)", file=sys.stderr)
    print(f"  every role on this host: KVMESH_TLS_DIR={directory}", file=sys.stderr)
    return 0
