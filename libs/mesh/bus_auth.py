"""Who may publish and subscribe what on NATS: one table, role -> subjects, and the credentials that name a role.

NATS checks every publish and subscription against the user's permissions (nats-server `authorization` with
per-user `publish`/`subscribe` allow lists); the server configuration is derived from this table
(`kvmesh.nats_config`), for `kvmesh up`'s embedded server and for the one `kvmesh certs init` writes for compose.
A role's subjects follow `mesh.subjects`; `{worker}` stands for the worker's own id: a user made for one worker
(`kvmesh up` knows every id) gets exactly its own subjects, a user shared by a role's replicas (compose) gets `*`
(`>`) there, so one decode worker may then speak for another decode worker, never for another role.

JetStream is for the roles that use it, and each only on its own streams: the API subjects that name them
(`jetstream_api`), acks and flow control, and the inboxes replies arrive on (`_INBOX.>`); a bucket's own subjects
(`$KV.<bucket>.>`, `$O.<bucket>.>`) only for the role that writes it. So prefill, which reads the KV index's
stream, cannot touch the gateway's usage stream; a role may still purge or delete a stream it uses itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mesh import subjects
from mesh.access import BALANCER, DECODE, ENCODER, EXPERT_LB, GATEWAY, KVCACHE, PREFILL, ROLES

WORKER = "{worker}"  # a worker's own id in a subject of the table
INBOXES = "_INBOX.>"
KV_STREAMS = ("KVMESH_KV", "KV_KVMESH_KV_SNAPSHOT", "OBJ_KVMESH_KV_SNAPSHOTS")  # the KV index and its snapshots
GATEWAY_STREAMS = ("KVMESH_USAGE", "KVMESH_FINISHED", "KV_KVMESH_LIMITS", "KV_kvmesh_responses")


def jetstream_api(*streams: str) -> tuple[str, ...]:
    """The JetStream API on `streams` only (a KV bucket's stream is KV_<bucket>, an object store's OBJ_<bucket>):
    stream info, create, update, purge and message get; consumers on them; direct gets; plus the read-only
    `$JS.API.INFO` and `$JS.API.STREAM.NAMES`, and acks and flow-control replies of consumers."""
    per_stream = [
        (
            f"$JS.API.STREAM.*.{stream}",
            f"$JS.API.STREAM.MSG.*.{stream}",
            f"$JS.API.CONSUMER.*.{stream}",
            f"$JS.API.CONSUMER.*.{stream}.>",
            f"$JS.API.CONSUMER.*.*.{stream}.>",  # DURABLE.CREATE, MSG.NEXT
            f"$JS.API.DIRECT.GET.{stream}",
            f"$JS.API.DIRECT.GET.{stream}.>",
        )
        for stream in streams
    ]
    return (
        "$JS.API.INFO",
        "$JS.API.STREAM.NAMES",
        *(s for group in per_stream for s in group),
        "$JS.ACK.>",
        "$JS.FC.>",
    )


ALL_HEARTBEATS = f"{subjects.HEARTBEAT_PREFIX}.>"
CREDS_FILE = "nats.creds"  # beside a role's certificate in its directory (`kvmesh certs init`)

_GATEWAY_BUCKETS = ("$KV.KVMESH_LIMITS.>", "$KV.kvmesh_responses.>")  # tenancy limits, the Responses API's store
_BALANCER_BUCKETS = ("$KV.KVMESH_KV_SNAPSHOT.>", "$O.KVMESH_KV_SNAPSHOTS.>")  # the KV index's snapshots


@dataclass(frozen=True)
class SubjectPermissions:
    publish: tuple[str, ...]  # never empty: every role announces itself
    subscribe: tuple[str, ...] = ()  # empty: may subscribe to nothing

    def for_worker(self, worker_id: str | None) -> SubjectPermissions:
        """The subjects with `{worker}` filled in: one worker's id, or (None) any worker of the role (`{worker}`
        always ends a subject, so `>` also covers ids with dots)."""
        token = worker_id if worker_id is not None else ">"
        return SubjectPermissions(
            tuple(s.replace(WORKER, token) for s in self.publish),
            tuple(s.replace(WORKER, token) for s in self.subscribe),
        )


def _heartbeat(role: str) -> str:
    return subjects.worker_heartbeat(role, WORKER)


PERMISSIONS: dict[str, SubjectPermissions] = {
    # announces itself; follows the pools; writes usage, tenancy changes and its buckets; reads finished requests
    GATEWAY: SubjectPermissions(
        publish=(
            _heartbeat(GATEWAY),
            subjects.ALL_USAGE,
            "kvmesh.tenancy.changed",
            *jetstream_api(*GATEWAY_STREAMS),
            *_GATEWAY_BUCKETS,
        ),
        subscribe=(ALL_HEARTBEATS, "kvmesh.tenancy.changed", INBOXES),
    ),
    ENCODER: SubjectPermissions(publish=(_heartbeat(ENCODER),)),
    # its cache's events, its expert loads; follows the store nodes, expert plans and the KV stream (JetStream)
    PREFILL: SubjectPermissions(
        publish=(
            _heartbeat(PREFILL),
            subjects.kv_events(WORKER),
            subjects.ALL_EXPERT_LOADS,
            *jetstream_api(*KV_STREAMS),
        ),
        subscribe=(subjects.heartbeat(KVCACHE), f"{subjects.EXPERT_PLAN_PREFIX}.>", INBOXES),
    ),
    # no balancer assignments, no expert plans, no other role's heartbeats
    DECODE: SubjectPermissions(
        publish=(
            _heartbeat(DECODE),
            subjects.kv_events(WORKER),
            subjects.REQUESTS_FINISHED,
            subjects.ALL_EXPERT_LOADS,
        ),
        subscribe=(f"{subjects.EXPERT_PLAN_PREFIX}.>",),
    ),
    # its tiers' events (acknowledged JetStream publishes); follows its peers and the KV stream (repair)
    KVCACHE: SubjectPermissions(
        publish=(_heartbeat(KVCACHE), subjects.kv_events(WORKER), *jetstream_api(*KV_STREAMS)),
        subscribe=(subjects.heartbeat(KVCACHE), INBOXES),
    ),
    # the only publisher of assignments and pool sizes; keeps the KV index (stream, snapshots)
    BALANCER: SubjectPermissions(
        publish=(
            _heartbeat(BALANCER),
            subjects.BALANCER_ASSIGN,
            subjects.BALANCER_REPLICAS,
            *jetstream_api(*KV_STREAMS),
            *_BALANCER_BUCKETS,
        ),
        subscribe=(
            ALL_HEARTBEATS,
            subjects.ALL_KV_EVENTS,
            subjects.BALANCER_ASSIGN,
            subjects.REQUESTS_FINISHED,
            INBOXES,
        ),
    ),
    # the only publisher of expert plans
    EXPERT_LB: SubjectPermissions(
        publish=(_heartbeat(EXPERT_LB), f"{subjects.EXPERT_PLAN_PREFIX}.>"),
        subscribe=(subjects.ALL_EXPERT_LOADS,),
    ),
}
assert set(PERMISSIONS) == set(ROLES), "every role needs its row"


def permissions(role: str, worker_id: str | None = None) -> SubjectPermissions:
    """What a user of `role` may do: as the worker `worker_id`, or (None) as any worker of the role."""
    return PERMISSIONS[role].for_worker(worker_id)


@dataclass(frozen=True)
class NatsUser:
    """A NATS user and its password (random; plain only in the owner's credential file and in memory)."""

    user: str
    password: str = field(repr=False)

    def text(self) -> str:
        return f"# kvmesh NATS credentials: keep private (mode 0600)\nuser: {self.user}\npassword: {self.password}\n"

    @classmethod
    def parse(cls, text: str, source: str) -> NatsUser:
        values = dict(
            (key.strip(), value.strip())
            for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")
            for key, _, value in [line.partition(":")]
        )
        if not values.get("user") or not values.get("password"):
            raise ValueError(f"{source}: not a NATS credential file (lines `user: ...` and `password: ...`)")
        return cls(values["user"], values["password"])

    def write(self, path: Path) -> Path:
        """Owner-only before the password is in it, whatever the umask."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(mode=0o600)
        path.chmod(0o600)
        path.write_text(self.text())
        return path


def read_user(path: Path) -> NatsUser:
    return NatsUser.parse(path.read_text(), str(path))
