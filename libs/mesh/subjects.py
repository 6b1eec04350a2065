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
