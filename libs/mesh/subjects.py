"""NATS subjects, in one place. Payloads are the messages of proto/kvmesh/v1/events.proto."""

from __future__ import annotations

HEARTBEAT_PREFIX = "kvmesh.workers"
KV_EVENTS_PREFIX = "kvmesh.kv"


def worker_heartbeat(role: str, worker_id: str) -> str:
    """WorkerHeartbeat of one worker: its role and id are in the subject, so NATS permissions can hold a worker to
    its own (mesh.bus_auth) and a registry drops a heartbeat whose WorkerInfo names anyone else (mesh.discovery)."""
    return f"{HEARTBEAT_PREFIX}.{role}.{worker_id}"


def heartbeat(role: str) -> str:
    """WorkerHeartbeat of every worker of `role` (gateway, prefill, decode, kvcache, balancer, ...): a wildcard."""
    return f"{HEARTBEAT_PREFIX}.{role}.>"


def heartbeat_names(subject: str, role: str, worker_id: str) -> bool:
    """Whether a heartbeat heard on `subject` was published on the subject of the worker it names."""
    return subject == worker_heartbeat(role, worker_id)


def kv_events(worker_id: str) -> str:
    """KVEventBatch of one worker's cache."""
    return f"{KV_EVENTS_PREFIX}.{worker_id}"


ALL_KV_EVENTS = f"{KV_EVENTS_PREFIX}.>"


def kv_events_worker(subject: str, claimed: str) -> str | None:
    """The worker a KVEventBatch heard on `subject` is about: the subject's, which permissions tie to its
    publisher; None when the batch claims (`claimed`, its worker_id; empty: none) another worker."""
    worker_id = subject.removeprefix(KV_EVENTS_PREFIX + ".")
    return worker_id if claimed in ("", worker_id) else None


REQUESTS_FINISHED = "kvmesh.requests.finished"  # events_pb2.RequestFinished: requests leaving decode workers
FINISHED_STREAM = "KVMESH_FINISHED"  # the JetStream stream gateways keep them in (an abandoned request's tokens)

BALANCER_ASSIGN = "kvmesh.balancer.assign"  # balancer_pb2.Assignment: every replica's decisions, for its peers
BALANCER_REPLICAS = "kvmesh.balancer.replicas"  # balancer_pb2.ReplicaRecommendation: pool sizes for autoscalers

EXPERT_LOAD_PREFIX = "kvmesh.experts.load"
EXPERT_PLAN_PREFIX = "kvmesh.experts.plan"


def _model_token(model: str) -> str:
    """A model name as one subject token (names may hold dots or be paths; the payload carries the real name)."""
    return "".join("_" if c in ". *>\t\r\n" else c for c in model) or "_"


def expert_load(model: str) -> str:
    """ExpertLoad reports of every worker serving `model`."""
    return f"{EXPERT_LOAD_PREFIX}.{_model_token(model)}"


def expert_plan(model: str) -> str:
    """ExpertPlan placements for every worker serving `model`."""
    return f"{EXPERT_PLAN_PREFIX}.{_model_token(model)}"


ALL_EXPERT_LOADS = f"{EXPERT_LOAD_PREFIX}.>"

USAGE_PREFIX = "kvmesh.usage"


def usage(tenant_id: str) -> str:
    """UsageRecord of every request of one tenant (kept in the JetStream stream KVMESH_USAGE)."""
    return f"{USAGE_PREFIX}.{_model_token(tenant_id)}"


ALL_USAGE = f"{USAGE_PREFIX}.>"
