"""Who may call what on the mesh's internal gRPC: one table, method -> the roles allowed to call it.

The caller's role is the one its client certificate names (mesh.tls); mesh.rpc's server interceptor looks the
method up here for every call and answers PERMISSION_DENIED, naming the method and the role, to anyone else. A
method missing from the table is refused to everyone (tests/mesh/test_tls_access.py checks that every internal
method of proto/ is listed). The gateway's public Gateway service is not here: API keys guard it, not roles.
"""

from __future__ import annotations

GATEWAY = "gateway"
ENCODER = "encoder"
PREFILL = "prefill"
DECODE = "decode"
KVCACHE = "kvcache"
BALANCER = "balancer"
EXPERT_LB = "expert_lb"
ROLES = (GATEWAY, ENCODER, PREFILL, DECODE, KVCACHE, BALANCER, EXPERT_LB)

ALLOWED_CALLERS: dict[str, frozenset[str]] = {
    # the balancer picks workers for the gateway's requests and shows it the pools
    "/kvmesh.v1.Balancer/Route": frozenset({GATEWAY}),
    "/kvmesh.v1.Balancer/RouteEncoder": frozenset({GATEWAY}),
    "/kvmesh.v1.Balancer/ListWorkers": frozenset({GATEWAY}),
    # late binding: the prefill worker holding a request's KV asks where to push it
    "/kvmesh.v1.Balancer/BindDecode": frozenset({PREFILL}),
    # generations start at the gateway only
    "/kvmesh.v1.Prefill/Prefill": frozenset({GATEWAY}),
    "/kvmesh.v1.Prefill/PrefillStream": frozenset({GATEWAY}),
    "/kvmesh.v1.Encoder/Encode": frozenset({GATEWAY}),
    # only prefill hands KV to decode; only the gateway attaches to a request's tokens or aborts it
    "/kvmesh.v1.Decode/PushKV": frozenset({PREFILL}),
    "/kvmesh.v1.Decode/Stream": frozenset({GATEWAY}),
    "/kvmesh.v1.Decode/Abort": frozenset({GATEWAY}),
    # a store node takes writes from prefill and from its store peers (replicas, repair); the same read
    "/kvmesh.v1.KVCache/Put": frozenset({PREFILL, KVCACHE}),
    "/kvmesh.v1.KVCache/Get": frozenset({PREFILL, KVCACHE}),
    "/kvmesh.v1.KVCache/Lookup": frozenset({PREFILL, KVCACHE}),
    "/kvmesh.v1.KVCache/Pin": frozenset({PREFILL}),
    # plans are published on NATS by expert_lb; over gRPC they are only read, by the roles that apply them
    "/kvmesh.v1.ExpertBalancer/GetPlan": frozenset({PREFILL, DECODE, BALANCER, EXPERT_LB}),
    # liveness without NATS (mesh.health): the roles that keep pools check every worker they know
    "/grpc.health.v1.Health/Check": frozenset({GATEWAY, BALANCER}),
}


def allowed_callers(method: str) -> frozenset[str]:
    """The roles that may call `method` (its full gRPC name, `/package.Service/Method`); empty: nobody."""
    return ALLOWED_CALLERS.get(method, frozenset())
