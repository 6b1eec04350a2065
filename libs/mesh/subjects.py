"""NATS subjects, in one place. Payloads are the messages of proto/kvmesh/v1/events.proto."""

from __future__ import annotations

HEARTBEAT_PREFIX = "kvmesh.workers"
KV_EVENTS_PREFIX = "kvmesh.kv"


def heartbeat(role: str) -> str:
    """WorkerHeartbeat of every worker of `role` (gateway, prefill, decode, kvcache, balancer, ...)."""
    return f"{HEARTBEAT_PREFIX}.{role}"


def kv_events(worker_id: str) -> str:
    """KVEventBatch of one worker's cache."""
    return f"{KV_EVENTS_PREFIX}.{worker_id}"


ALL_KV_EVENTS = f"{KV_EVENTS_PREFIX}.>"

REQUESTS_FINISHED = "kvmesh.requests.finished"  # events_pb2.RequestFinished: requests leaving decode workers

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
