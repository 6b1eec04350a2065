"""Who may publish and subscribe what on NATS: one table, role -> subjects, and the credentials that name a role.

NATS checks every publish and subscription against the user's permissions (nats-server `authorization` with
per-user `publish`/`subscribe` allow lists); the server configuration is derived from this table
(`kvmesh.nats_config`), for `kvmesh up`'s embedded server and for the one `kvmesh certs init` writes for compose.
A role's subjects follow `mesh.subjects`; `{worker}` stands for the worker's own id: a user made for one worker
(`kvmesh up` knows every id) gets exactly its own subjects, a user shared by a role's replicas (compose) gets `*`
(`>`) there, so one decode worker may then speak for another decode worker, never for another role.

JetStream is for the roles that use it, each only on its own streams and only for what it does there
(`jetstream_api`): read a stream's info and messages, create it if missing when the role owns it (creating never
changes a stream that exists; prefill, a reader, cannot create the KV index's streams, nor store nodes its
snapshots' stores, or they could make them first with a configuration of their own), and make, read, delete and
pull its consumers, ack and answer flow control on them; a bucket's own subjects (`$KV.<bucket>.>`,
`$O.<bucket>.>`) only for the role that writes it. Only the balancer may purge, and only the KV index's stream and
its snapshots' object store (compaction; an object store purges the chunks of an object it replaces or deletes). No
role may delete or update a stream, delete a message, or snapshot or restore one: prefill can read KVMESH_KV but
not purge it, and nobody can delete the gateway's usage (billing) stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mesh import subjects
from mesh.access import BALANCER, DECODE, ENCODER, EXPERT_LB, GATEWAY, KVCACHE, PREFILL, ROLES

WORKER = "{worker}"  # a worker's own id in a subject of the table
INBOXES = "_INBOX.>"
KV_STREAMS = ("KVMESH_KV", "KV_KVMESH_KV_SNAPSHOT", "OBJ_KVMESH_KV_SNAPSHOTS")  # the KV index and its snapshots
GATEWAY_STREAMS = ("KVMESH_USAGE", subjects.FINISHED_STREAM, "KV_KVMESH_LIMITS", "KV_kvmesh_responses")
ROLLOUT_STREAM = "KV_KVMESH_ROLLOUTS"  # canary rollouts (mesh.rollouts): the admin API and the balancers write it


def jetstream_api(*streams: str, purge: tuple[str, ...] = (), create: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """The JetStream API a role uses on `streams` (a KV bucket's stream is KV_<bucket>, an object store's
    OBJ_<bucket>): stream info, message gets and direct gets; consumers made, read, deleted and pulled; acks and
    flow-control replies; and the names of streams (read-only: an object store's reader finds its stream by
    subject). `create`: the streams (of `streams`; None: all) it may create, those it owns: a role that could
    create a stream it only reads could create it first with a configuration of its own. `purge`: streams (of
    `streams`) it may also purge."""
    creates = streams if create is None else create
    assert set(purge) <= set(streams) and set(creates) <= set(streams)
    per_stream = [
        (
            f"$JS.API.STREAM.INFO.{stream}",
            *((f"$JS.API.STREAM.CREATE.{stream}",) if stream in creates else ()),
            f"$JS.API.STREAM.MSG.GET.{stream}",
            f"$JS.API.DIRECT.GET.{stream}",
            f"$JS.API.DIRECT.GET.{stream}.>",
            f"$JS.API.CONSUMER.CREATE.{stream}",  # an ephemeral consumer (older servers' form)
            f"$JS.API.CONSUMER.CREATE.{stream}.>",  # <name>[.<filter>]
            f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.>",
            f"$JS.API.CONSUMER.INFO.{stream}.>",
            f"$JS.API.CONSUMER.DELETE.{stream}.>",
            f"$JS.API.CONSUMER.MSG.NEXT.{stream}.>",
            f"$JS.ACK.{stream}.>",
            f"$JS.FC.{stream}.>",
        )
        for stream in streams
    ]
    purges = tuple(f"$JS.API.STREAM.PURGE.{stream}" for stream in purge)
    return ("$JS.API.STREAM.NAMES", *(s for group in per_stream for s in group), *purges)


ALL_HEARTBEATS = f"{subjects.HEARTBEAT_PREFIX}.>"
CREDS_FILE = "nats.creds"  # beside a role's certificate in its directory (`kvmesh certs init`)

_ROLLOUTS_BUCKET = "$KV.KVMESH_ROLLOUTS.>"
# the gateway's: tenancy limits, the Responses API's store; the balancer's: the KV index's snapshots; both: rollouts
_GATEWAY_BUCKETS = ("$KV.KVMESH_LIMITS.>", "$KV.kvmesh_responses.>", _ROLLOUTS_BUCKET)
_BALANCER_BUCKETS = ("$KV.KVMESH_KV_SNAPSHOT.>", "$O.KVMESH_KV_SNAPSHOTS.>", _ROLLOUTS_BUCKET)


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
            *jetstream_api(*GATEWAY_STREAMS, ROLLOUT_STREAM),
            *_GATEWAY_BUCKETS,
        ),
        subscribe=(ALL_HEARTBEATS, "kvmesh.tenancy.changed", INBOXES),
    ),
    ENCODER: SubjectPermissions(publish=(_heartbeat(ENCODER),)),
    # its cache's events, its expert loads; follows the store nodes, the balancers (late binding asks them where to
    # push), expert plans and the KV stream (JetStream)
    PREFILL: SubjectPermissions(
        publish=(
            _heartbeat(PREFILL),
            subjects.kv_events(WORKER),
            subjects.ALL_EXPERT_LOADS,
            *jetstream_api(*KV_STREAMS, create=()),  # reads the KV index's stream and snapshots, never makes them
        ),
        subscribe=(
            subjects.heartbeat(KVCACHE),
            subjects.heartbeat(BALANCER),
            f"{subjects.EXPERT_PLAN_PREFIX}.>",
            INBOXES,
        ),
    ),
    # no balancer assignments, no other role's heartbeats; of JetStream only the acks of its finished requests
    # (publishes the gateways' KVMESH_FINISHED keeps) and whether that stream exists yet (mesh.outbox)
    DECODE: SubjectPermissions(
        publish=(
            _heartbeat(DECODE),
            subjects.kv_events(WORKER),
            subjects.REQUESTS_FINISHED,
            subjects.ALL_EXPERT_LOADS,
            f"$JS.API.STREAM.INFO.{subjects.FINISHED_STREAM}",
        ),
        subscribe=(f"{subjects.EXPERT_PLAN_PREFIX}.>", INBOXES),
    ),
    # its tiers' events (acknowledged JetStream publishes); follows its peers and the KV stream (repair)
    KVCACHE: SubjectPermissions(
        publish=(_heartbeat(KVCACHE), subjects.kv_events(WORKER), *jetstream_api(*KV_STREAMS, create=("KVMESH_KV",))),
        subscribe=(subjects.heartbeat(KVCACHE), INBOXES),
    ),
    # the only publisher of assignments and pool sizes; keeps the KV index (stream, snapshots)
    BALANCER: SubjectPermissions(
        publish=(
            _heartbeat(BALANCER),
            subjects.BALANCER_ASSIGN,
            subjects.BALANCER_REPLICAS,
            *jetstream_api(*KV_STREAMS, ROLLOUT_STREAM, purge=("KVMESH_KV", "OBJ_KVMESH_KV_SNAPSHOTS")),
            *_BALANCER_BUCKETS,
        ),
        subscribe=(
            ALL_HEARTBEATS,
            subjects.ALL_KV_EVENTS,
            subjects.BALANCER_ASSIGN,
            subjects.REQUESTS_FINISHED,
            subjects.ALL_USAGE,  # requests' outcomes: a canary rollout's samples
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
