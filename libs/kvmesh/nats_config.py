"""nats-server configuration derived from mesh.bus_auth's table: one user per role (and, under `kvmesh up`, per
worker) with a random password stored bcrypt-hashed, its subject permissions, bounded resources, and TLS with
the mesh's CA when a server certificate is given.

    grants = role_grants()                                        # one user per role, new random passwords
    text = server_config(grants, tls=ServerTLS(cert, key, ca))    # nats-server -c FILE

Limits (nats-server's own settings):
- `max_payload` 1 MiB: NATS carries events only; bulk bytes (KV blocks, embeddings) go over gRPC and the lanes.
  The largest messages are KV event batches and expert plans (kilobytes) and object-store chunks of the KV index's
  snapshots (128 KiB); anything bigger is a mistake or an attack, refused before the server buffers it.
- `max_pending` 32 MiB: what the server holds for one slow subscriber before it cuts it off (the client
  reconnects; a registry misses at most a few heartbeats). Half of nats-server's 64 MiB default: every role reads
  kilobytes per second, and JetStream replays are paced by flow control, so only a stuck or hostile client
  reaches it, and then it cannot make the server hold more than this per connection.
- `max_connections` 4096 and `max_subscriptions` 1024 per connection: a role holds one connection and a dozen
  subscriptions; the caps bound what one leaked credential can make the server keep.

A node of a cluster (`ClusterRoutes`, kvmesh.nats_cluster) also gets a `server_name` (JetStream's Raft groups know
their peers by it) and a `cluster` block: where it listens for routes, its peers' route addresses, and the route
user every node shares (routes are refused to anyone else, so a client port scan cannot join the cluster).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import bcrypt

from mesh.access import ROLES
from mesh.bus_auth import NatsUser, SubjectPermissions, permissions

MAX_PAYLOAD = 1 << 20
MAX_PENDING = 32 << 20
MAX_CONNECTIONS = 4096
MAX_SUBSCRIPTIONS = 1024
AUTH_TIMEOUT_S = 2  # a client that has not authenticated by then is dropped
ADMIN = "kvmesh-admin"
# The passwords are 256 random bits: bcrypt's work factor guards guessable passwords, which these are not, and the
# server pays it on every connect. 10 (about 60 ms a connect) for deployments; the embedded server, which test
# suites connect to thousands of times, uses bcrypt's minimum.
BCRYPT_ROUNDS = 10
EMBEDDED_BCRYPT_ROUNDS = 4


@dataclass(frozen=True)
class Grant:
    """A user and what it may do (None: everything, the embedded server's administrator)."""

    user: NatsUser
    permissions: SubjectPermissions | None


@dataclass(frozen=True)
class ClusterRoutes:
    """One node's place in a NATS cluster."""

    server_name: str  # unique in the cluster: JetStream's Raft groups name their peers by it
    host: str  # where this node listens for routes from its peers
    port: int
    peers: tuple[tuple[str, int], ...]  # the other nodes' (host, route port)
    user: NatsUser  # the route user every node of the cluster shares
    cluster_name: str = "kvmesh"

    def peer_urls(self) -> list[str]:
        return [f"nats-route://{self.user.user}:{self.user.password}@{host}:{port}" for host, port in self.peers]


@dataclass(frozen=True)
class ServerTLS:
    cert_file: Path
    key_file: Path
    ca_file: Path  # client certificates must chain to it (`verify: true`)


def new_password() -> str:
    return secrets.token_urlsafe(32)  # URL-safe: it may stand in a nats://user:password@ URL


def role_user_name(role: str, worker_id: str | None = None) -> str:
    return role if worker_id is None else f"{role}.{worker_id}"


def role_grants(roles: Iterable[str] = ROLES) -> list[Grant]:
    """One user per role, shared by its replicas (compose): `{worker}` subjects open to any worker of the role."""
    return [Grant(NatsUser(role_user_name(role), new_password()), permissions(role)) for role in roles]


def hash_password(password: str, rounds: int = BCRYPT_ROUNDS) -> str:
    """The bcrypt hash nats-server checks a password against (`$2a$`, as the nats CLI writes them)."""
    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds, prefix=b"2a")).decode()


def _quoted(value: str) -> str:
    return json.dumps(value)  # nats-server's format reads JSON strings; quoted, `$2a$...` is not a variable


def _subjects(allowed: tuple[str, ...]) -> str:
    if not allowed:
        return '{deny: [">"]}'
    return "{allow: [" + ", ".join(_quoted(s) for s in allowed) + "]}"


def _user_line(grant: Grant, rounds: int) -> str:
    fields = f"user: {_quoted(grant.user.user)}, password: {_quoted(hash_password(grant.user.password, rounds))}"
    if grant.permissions is not None:
        publish, subscribe = _subjects(grant.permissions.publish), _subjects(grant.permissions.subscribe)
        fields += f", permissions: {{publish: {publish}, subscribe: {subscribe}}}"
    return "    {" + fields + "}"


def cluster_block(routes: ClusterRoutes, rounds: int = BCRYPT_ROUNDS) -> list[str]:
    """The `server_name` and `cluster` lines of one node of a cluster."""
    password = _quoted(hash_password(routes.user.password, rounds))
    return [
        f"server_name: {_quoted(routes.server_name)}",
        "cluster {",
        f"  name: {_quoted(routes.cluster_name)}",
        f"  listen: {_quoted(f'{routes.host}:{routes.port}')}",
        f"  authorization {{ user: {_quoted(routes.user.user)}, password: {password}, timeout: {AUTH_TIMEOUT_S} }}",
        "  routes: [" + ", ".join(_quoted(url) for url in routes.peer_urls()) + "]",
        "}",
    ]


def server_config(
    grants: Iterable[Grant],
    tls: ServerTLS | None = None,
    rounds: int = BCRYPT_ROUNDS,
    cluster: ClusterRoutes | None = None,
) -> str:
    """The text of a nats-server configuration file (listen address and JetStream come from its command line).
    No grants: no authorization (KVMESH_INSECURE=1); `cluster`: a node of a cluster."""
    grants = list(grants)
    lines = [
        "# Written by kvmesh (kvmesh.nats_config) from mesh/bus_auth.py: regenerate it, do not edit it.",
        f"max_payload: {MAX_PAYLOAD}",
        f"max_pending: {MAX_PENDING}",
        f"max_connections: {MAX_CONNECTIONS}",
        f"max_subscriptions: {MAX_SUBSCRIPTIONS}",
    ]
    if grants:
        lines += [
            "authorization {",
            f"  timeout: {AUTH_TIMEOUT_S}",
            "  users: [",
            *(_user_line(grant, rounds) for grant in grants),
            "  ]",
            "}",
        ]
    if cluster is not None:
        lines += cluster_block(cluster, rounds)
    if tls is not None:
        lines += [
            "tls {",
            f"  cert_file: {_quoted(str(tls.cert_file))}",
            f"  key_file: {_quoted(str(tls.key_file))}",
            f"  ca_file: {_quoted(str(tls.ca_file))}",
            "  verify: true",
            "  handshake_first: true",  # TLS before anything else: no plaintext INFO to strip TLS from
            f"  timeout: {AUTH_TIMEOUT_S}",
            "}",
        ]
    return "\n".join(lines) + "\n"
