"""Every Prometheus metric of the mesh, in one place (the README's table lists them).

Core objects return stats; services set these from them. Histograms use latency buckets suited to both a
CPU laptop and a GPU cluster.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)

# gateway
GATEWAY_REQUESTS = Counter(
    "kvmesh_gateway_requests_total", "Requests answered, by API, model and status code", ["api", "model", "code"]
)
GATEWAY_TTFT = Histogram(
    "kvmesh_gateway_time_to_first_token_seconds", "Arrival to first token", ["model"], buckets=_LATENCY
)
GATEWAY_ITL = Histogram(
    "kvmesh_gateway_inter_token_latency_seconds", "Time between streamed tokens", ["model"], buckets=_TOKEN_LATENCY
)
GATEWAY_E2E = Histogram(
    "kvmesh_gateway_e2e_request_latency_seconds", "Arrival to last token", ["model"], buckets=_LATENCY
)
GATEWAY_IN_FLIGHT = Gauge("kvmesh_gateway_requests_in_flight", "Requests being served", ["model"])

# prefill
PREFILL_PROMPT_TOKENS = Counter("kvmesh_prefill_prompt_tokens_total", "Prompt tokens received", ["model"])
PREFILL_CACHED_TOKENS = Counter(
    "kvmesh_prefill_cached_tokens_total", "Prompt tokens not computed, by where their KV was found", ["model", "tier"]
)
PREFILL_SECONDS = Histogram(
    "kvmesh_prefill_seconds", "Engine time from admission to first token", ["model"], buckets=_LATENCY
)
PREFILL_STORE_ERRORS = Counter(
    "kvmesh_prefill_store_errors_total",
    "KV store calls from prefill that failed or timed out (a miss, never a failed request)",
    ["op"],
)  # lookup | get | put
PREFILL_STORE_READS = Counter(
    "kvmesh_prefill_store_reads_total",
    "Prefix reads from the KV store, by how: stream (layer-major into the engine while it "
    "computes), fetch (whole blocks first), skipped (the global index says none is stored)",
    ["mode"],
)
PREFILL_STORE_DROPPED_BLOCKS = Counter(
    "kvmesh_prefill_store_dropped_blocks_total", "Blocks not written to the KV store: the write queue was full"
)

# decode
DECODE_RUNNING = Gauge("kvmesh_decode_running_requests", "Requests in the decode batch", ["model"])
DECODE_KV_TOKENS = Gauge("kvmesh_decode_kv_tokens", "Tokens of KV held by running requests", ["model"])
DECODE_PROMPT_TOKENS_COMPUTED = Gauge(
    "kvmesh_decode_prompt_tokens_computed",
    "Prompt tokens decode computed itself (0 when every prompt came by KV transfer)",
    ["model"],
)

# KV movement and the store
KV_TRANSFER_BYTES = Counter(
    "kvmesh_kv_transfer_bytes_total", "KV bytes moved over gRPC, by direction", ["direction"]
)  # prefill_to_decode | store_put | store_get (prefill); store_in | store_out
KVCACHE_BLOCKS = Gauge("kvmesh_kvcache_blocks", "Blocks held by this KV store node", ["tier"])
KVCACHE_BYTES = Gauge("kvmesh_kvcache_bytes", "Bytes held by this KV store node", ["tier"])
KVCACHE_LOOKUPS = Counter("kvmesh_kvcache_lookup_blocks_total", "Blocks asked for, by outcome", ["outcome"])
KVCACHE_EVICTIONS = Counter(
    "kvmesh_kvcache_evictions_total", "Blocks removed from a tier, by reason", ["reason"]
)  # capacity | ttl | corrupt
KVCACHE_HIT_TOKENS = Counter(
    "kvmesh_kvcache_hit_tokens_total", "Tokens of KV served by this store node, by tier", ["tier"]
)  # host | ssd
KVCACHE_PINNED_BLOCKS = Gauge("kvmesh_kvcache_pinned_blocks", "Blocks pinned on this store node")
KVCACHE_UNDER_PROTECTED = Gauge(
    "kvmesh_kvcache_under_protected_blocks",
    "Erasure-coded blocks this node leads with a fragment lost with a node (not yet rebuilt)",
)
KVCACHE_REPAIRED_FRAGMENTS = Counter(
    "kvmesh_kvcache_repaired_fragments_total", "Fragments rebuilt and placed on another node by repair"
)
KV_INDEX_LAG_SECONDS = Gauge(
    "kvmesh_kv_index_lag_seconds",
    "Age of the last KV event batch applied to this process's global index (publish to apply)",
)
KV_INDEX_SNAPSHOTS = Counter(
    "kvmesh_kv_index_snapshots_total",
    "Snapshots of the global KV index this process wrote (the stream purged below each)",
)
KV_INDEX_BLOCKS = Gauge("kvmesh_kv_index_blocks", "Blocks the global KV index knows of, in any tier of any worker")

# balancer
BALANCER_ROUTES = Counter("kvmesh_balancer_routes_total", "Requests routed, by pool and worker", ["pool", "worker"])
BALANCER_WORKERS = Gauge("kvmesh_balancer_workers", "Live workers per pool", ["pool"])
BALANCER_RECOMMENDED_WORKERS = Gauge(
    "kvmesh_balancer_recommended_workers", "Workers each pool would need at the target utilization", ["pool"]
)
BALANCER_PEER_ASSIGNMENTS = Counter(
    "kvmesh_balancer_peer_assignments_total", "Decisions of peer balancer replicas counted in this one's load view"
)
BALANCER_FINISHED_HEARD = Counter(
    "kvmesh_balancer_finished_requests_total", "Requests that left decode workers, heard on the finished-request feed"
)

# expert rebalancer
EXPERT_BALANCEDNESS = Gauge(
    "kvmesh_expert_balancedness",
    "Mean / max GPU load of the current expert placement on its smoothed window, per MoE layer",
    ["model", "layer"],
)
EXPERT_MOVES = Counter(
    "kvmesh_expert_moves_total", "Expert slots given a different expert by published plans", ["model"]
)

# vision encoder
ENCODER_IMAGES = Counter(
    "kvmesh_encoder_images_total", "Images encoded, by model and whether the cache served them", ["model", "cached"]
)  # cached: true | false
ENCODER_SECONDS = Histogram(
    "kvmesh_encoder_seconds", "Time to decode and encode one image (cache misses)", ["model"], buckets=_LATENCY
)
ENCODER_CACHE_BYTES = Gauge("kvmesh_encoder_cache_bytes", "Embedding bytes held by this encoder's cache")
