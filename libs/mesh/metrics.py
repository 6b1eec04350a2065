"""Every Prometheus metric of the mesh, in one place; `kvmesh config --metrics-markdown` writes docs/metrics.md
from these definitions (name, type, labels, help, and the roles that export each).

Core objects return stats; services set these from them. Histograms use latency buckets suited to both a
CPU laptop and a GPU cluster.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from prometheus_client import Counter, Gauge, Histogram


@dataclass(frozen=True)
class MetricDoc:
    """What docs/metrics.md says of one metric."""

    name: str  # as exported (a counter's with _total)
    kind: str  # counter | gauge | histogram
    labels: tuple[str, ...]
    help: str
    roles: tuple[str, ...]  # the roles that export it
    note: str  # the label's values and the like, for the docs only


METRICS: list[MetricDoc] = []  # in definition order


def _doc(kind: str, name: str, doc: str, labels: Sequence[str], roles: str, note: str) -> None:
    METRICS.append(MetricDoc(name, kind, tuple(labels), doc, tuple(roles.split(", ")), note))


def _counter(name: str, doc: str, labels: Sequence[str] = (), *, roles: str, note: str = "") -> Counter:
    _doc("counter", name, doc, labels, roles, note)
    return Counter(name, doc, labels)


def _gauge(name: str, doc: str, labels: Sequence[str] = (), *, roles: str, note: str = "") -> Gauge:
    _doc("gauge", name, doc, labels, roles, note)
    return Gauge(name, doc, labels)


def _histogram(
    name: str, doc: str, labels: Sequence[str], *, buckets: Sequence[float], roles: str, note: str = ""
) -> Histogram:
    _doc("histogram", name, doc, labels, roles, note)
    return Histogram(name, doc, labels, buckets=buckets)


_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)

# gateway
GATEWAY_CONNECTIONS_REFUSED = _counter(
    "kvmesh_gateway_connections_refused_total",
    "Connections the public listener closed: over a cap, or no whole request head in time",
    ["reason"],
    roles="gateway",
    note="reason: max_connections, max_connections_per_client, head_timeout (services/gateway/listener.py)",
)
_TENANT_NOTE = "tenant: the busiest tenants' names (gateway setting metrics_named_tenants), other, unknown"
GATEWAY_REQUESTS = _counter(
    "kvmesh_gateway_requests_total",
    "Requests answered, by API, model, status code and tenant",
    ["api", "model", "code", "tenant"],
    roles="gateway",
    note=_TENANT_NOTE,
)
GATEWAY_TOKENS = _counter(
    "kvmesh_gateway_tokens_total",
    "Tokens of finished and failed requests, by model, tenant and kind (cached tokens are also prompt tokens)",
    ["model", "tenant", "kind"],
    roles="gateway",
    note=f"kind: prompt, cached, completion; {_TENANT_NOTE}",
)
GATEWAY_TTFT = _histogram(
    "kvmesh_gateway_time_to_first_token_seconds", "Arrival to first token", ["model"], buckets=_LATENCY, roles="gateway"
)
GATEWAY_ITL = _histogram(
    "kvmesh_gateway_inter_token_latency_seconds",
    "Time between streamed tokens",
    ["model"],
    buckets=_TOKEN_LATENCY,
    roles="gateway",
)
GATEWAY_E2E = _histogram(
    "kvmesh_gateway_e2e_request_latency_seconds", "Arrival to last token", ["model"], buckets=_LATENCY, roles="gateway"
)
# The request-level series under the names vLLM's dashboards chart (vllm:X is kvmesh:X here, labelled model_name
# as vLLM's are, and tenant), bucketed as the OpenTelemetry GenAI semantic conventions recommend for
# gen_ai.server.time_to_first_token, .time_per_output_token, .request.duration and gen_ai.client.token.usage.
OTEL_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
OTEL_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
OTEL_DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
OTEL_TOKEN_BUCKETS = tuple(4.0**n for n in range(14))  # 1, 4, 16, ... 67108864
_VLLM_NOTE = f"vLLM's vllm:{{}}; {_TENANT_NOTE}"
REQUEST_TTFT = _histogram(
    "kvmesh:time_to_first_token_seconds",
    "Arrival at the gateway to the first token, per request",
    ["model_name", "tenant"],
    buckets=OTEL_TTFT_BUCKETS,
    roles="gateway",
    note=_VLLM_NOTE.format("time_to_first_token_seconds"),
)
REQUEST_ITL = _histogram(
    "kvmesh:inter_token_latency_seconds",
    "Time between output tokens after the first (a batch of n tokens: n equal gaps)",
    ["model_name", "tenant"],
    buckets=OTEL_TPOT_BUCKETS,
    roles="gateway",
    note=_VLLM_NOTE.format("inter_token_latency_seconds"),
)
REQUEST_E2E = _histogram(
    "kvmesh:e2e_request_latency_seconds",
    "Arrival to the last token of requests that finished",
    ["model_name", "tenant"],
    buckets=OTEL_DURATION_BUCKETS,
    roles="gateway",
    note=_VLLM_NOTE.format("e2e_request_latency_seconds"),
)
REQUEST_PROMPT_TOKENS = _histogram(
    "kvmesh:request_prompt_tokens",
    "Prompt tokens of each request that finished",
    ["model_name", "tenant"],
    buckets=OTEL_TOKEN_BUCKETS,
    roles="gateway",
    note=_VLLM_NOTE.format("request_prompt_tokens"),
)
REQUEST_GENERATION_TOKENS = _histogram(
    "kvmesh:request_generation_tokens",
    "Output tokens of each request that finished (every choice's)",
    ["model_name", "tenant"],
    buckets=OTEL_TOKEN_BUCKETS,
    roles="gateway",
    note=_VLLM_NOTE.format("request_generation_tokens"),
)
REQUEST_QUEUE_TIME = _histogram(
    "kvmesh:request_queue_time_seconds",
    "Time a request waited for the prefill engine: from its hand-over to the engine (after any KV store fetch) to "
    "the engine's first step that computes it (waiting behind a running step, a full batch or the token budget)",
    ["model_name"],
    buckets=OTEL_TTFT_BUCKETS,
    roles="prefill",
    note="vLLM's vllm:request_queue_time_seconds. The mesh's one queue: the gateway admits or refuses (429) at once, "
    "and decode takes pushed KV straight into its batch (or refuses it: the gateway re-routes)",
)
GATEWAY_DECODE_EJECTIONS = _counter(
    "kvmesh_gateway_decode_ejections_total",
    "Decode workers this gateway took out of routing though their calls succeed",
    ["reason"],
    roles="gateway",
    note="reason: latency (inter-token latency over slow_decode_factor x the pool's others'; mesh/latency_outliers.py)",
)
GATEWAY_MIGRATIONS = _counter(
    "kvmesh_gateway_migrations_total",
    "Generations moved mid-stream to another (prefill, decode) pair, their output so far prefilled there",
    ["reason"],
    roles="gateway",
    note="reason: failed (the decode side failed), slow (on an ejected decode worker, the next token overdue)",
)
GATEWAY_IN_FLIGHT = _gauge("kvmesh_gateway_requests_in_flight", "Requests being served", ["model"], roles="gateway")
USAGE_PUBLISHED = _counter(
    "kvmesh_gateway_usage_records_published_total",
    "Usage records acknowledged by the JetStream stream KVMESH_USAGE",
    roles="gateway",
)
USAGE_DROPPED = _counter(
    "kvmesh_gateway_usage_records_dropped_total",
    "Usage records dropped unpublished: the queue was full while NATS was away, or the gateway stopped first",
    roles="gateway",
)
USAGE_QUEUED = _gauge("kvmesh_gateway_usage_records_queued", "Usage records waiting to be published", roles="gateway")
USAGE_WRITTEN = _counter(
    "kvmesh_gateway_usage_records_written_total",
    "Usage records the ledger consumer wrote to the database, and those it found already there",
    ["outcome"],
    roles="gateway",
    note="written, duplicate",
)

# prefill
PREFILL_PROMPT_TOKENS = _counter(
    "kvmesh_prefill_prompt_tokens_total", "Prompt tokens received", ["model"], roles="prefill"
)
PREFILL_CACHED_TOKENS = _counter(
    "kvmesh_prefill_cached_tokens_total",
    "Prompt tokens not computed, by where their KV was found",
    ["model", "tier"],
    roles="prefill",
    note="device, store",
)
PREFILL_SECONDS = _histogram(
    "kvmesh_prefill_seconds", "Engine time from admission to first token", ["model"], buckets=_LATENCY, roles="prefill"
)
PREFILL_STORE_ERRORS = _counter(
    "kvmesh_prefill_store_errors_total",
    "KV store calls from prefill that failed or timed out (a miss, never a failed request)",
    ["op"],
    roles="prefill",
    note="lookup, get, put",
)
PREFILL_STORE_READS = _counter(
    "kvmesh_prefill_store_reads_total",
    "Prefix reads from the KV store, by how: stream (layer-major into the engine while it "
    "computes), fetch (whole blocks first), skipped (the global index says none is stored)",
    ["mode"],
    roles="prefill",
    note="stream, fetch, skipped",
)
PREFILL_KV_FETCH_DECISIONS = _counter(
    "kvmesh_prefill_kv_fetch_decisions_total",
    "Requests whose prefix the KV store held past the engine's own, by what prefill did: read it all (fetch), read "
    "its head and computed the rest (partial), computed it (recompute), read it to measure the store (probe), or "
    "what KVMESH_KV_FETCH forced",
    ["choice"],
    roles="prefill",
    note="fetch, partial, recompute, probe, forced",
)
PREFILL_KV_FETCH_SAVED_SECONDS = _counter(
    "kvmesh_prefill_kv_fetch_saved_seconds_total",
    "Predicted time to first token saved by the fetch-or-recompute choices against computing every prefix",
    roles="prefill",
)
PREFILL_STORE_READ_BYTES_PER_SECOND = _gauge(
    "kvmesh_prefill_store_read_bytes_per_second",
    "KV store read bandwidth, fitted from this worker's recent reads (with their latency apart)",
    roles="prefill",
)
PREFILL_COMPUTE_TOKENS_PER_SECOND = _gauge(
    "kvmesh_prefill_compute_tokens_per_second",
    "Prompt tokens computed per second, fitted from this worker's recent requests (with a fixed cost apart)",
    roles="prefill",
)
PREFILL_STORE_DROPPED_BLOCKS = _counter(
    "kvmesh_prefill_store_dropped_blocks_total",
    "Blocks not written to the KV store: the write queue was full",
    roles="prefill",
)

# decode
DECODE_RUNNING = _gauge("kvmesh_decode_running_requests", "Requests in the decode batch", ["model"], roles="decode")
KV_CACHE_USAGE = _gauge(
    "kvmesh:kv_cache_usage_perc",
    "Share of the decode engine's KV blocks held by requests (0 to 1)",
    ["model_name"],
    roles="decode",
    note="vLLM's vllm:kv_cache_usage_perc",
)
NUM_REQUESTS_RUNNING = _gauge(
    "kvmesh:num_requests_running",
    "Requests in the decode engine's batch",
    ["model_name"],
    roles="decode",
    note="vLLM's vllm:num_requests_running",
)
NUM_REQUESTS_WAITING = _gauge(
    "kvmesh:num_requests_waiting",
    "Requests the decode engine holds but has not yet scheduled",
    ["model_name"],
    roles="decode",
    note="vLLM's vllm:num_requests_waiting",
)
DECODE_KV_TOKENS = _gauge("kvmesh_decode_kv_tokens", "Tokens of KV held by running requests", ["model"], roles="decode")
DECODE_PROMPT_TOKENS_COMPUTED = _gauge(
    "kvmesh_decode_prompt_tokens_computed",
    "Prompt tokens decode computed itself (0 when every prompt came by KV transfer)",
    ["model"],
    roles="decode",
)

# KV movement and the store
KV_TRANSFER_BYTES = _counter(
    "kvmesh_kv_transfer_bytes_total",
    "KV bytes moved over gRPC, by direction",
    ["direction"],
    roles="prefill, decode, kvcache",
    note="prefill_to_decode, store_put, store_get (prefill); prefill_to_decode (decode); store_in, "
    "store_out (kvcache); bulk lanes included",
)
KVCACHE_BLOCKS = _gauge("kvmesh_kvcache_blocks", "Blocks held by this KV store node", ["tier"], roles="kvcache")
KVCACHE_BYTES = _gauge("kvmesh_kvcache_bytes", "Bytes held by this KV store node", ["tier"], roles="kvcache")
KVCACHE_LOOKUPS = _counter(
    "kvmesh_kvcache_lookup_blocks_total", "Blocks asked for, by outcome", ["outcome"], roles="kvcache"
)
KVCACHE_EVICTIONS = _counter(
    "kvmesh_kvcache_evictions_total",
    "Blocks removed from a tier, by reason",
    ["reason"],
    roles="kvcache",
    note="capacity, ttl, corrupt",
)
KVCACHE_HIT_TOKENS = _counter(
    "kvmesh_kvcache_hit_tokens_total",
    "Tokens of KV served by this store node, by tier",
    ["tier"],
    roles="kvcache",
    note="host, ssd",
)
KVCACHE_PINNED_BLOCKS = _gauge("kvmesh_kvcache_pinned_blocks", "Blocks pinned on this store node", roles="kvcache")
KVCACHE_UNDER_PROTECTED = _gauge(
    "kvmesh_kvcache_under_protected_blocks",
    "Erasure-coded blocks this node leads with a fragment lost with a node (not yet rebuilt)",
    roles="kvcache",
)
KVCACHE_REPAIRED_FRAGMENTS = _counter(
    "kvmesh_kvcache_repaired_fragments_total",
    "Fragments rebuilt and placed on another node by repair",
    roles="kvcache",
)
KV_INDEX_LAG_SECONDS = _gauge(
    "kvmesh_kv_index_lag_seconds",
    "Age of the last KV event batch applied to this process's global index (publish to apply)",
    roles="prefill, kvcache, balancer",
)
KV_INDEX_SNAPSHOTS = _counter(
    "kvmesh_kv_index_snapshots_total",
    "Snapshots of the global KV index this process wrote (the stream purged below each)",
    roles="balancer",
)
KV_INDEX_BLOCKS = _gauge(
    "kvmesh_kv_index_blocks",
    "Blocks the global KV index knows of, in any tier of any worker",
    roles="prefill, kvcache, balancer",
)

# liveness and the bus going away (mesh.discovery, mesh.health, mesh.outbox)
POOL_STALE_WORKERS = _gauge(
    "kvmesh_pool_stale_workers",
    "Workers kept in the pools at their last known state: no heartbeat for 3 intervals (NATS away, or theirs)",
    roles="gateway, balancer",
)
POOL_EJECTED_WORKERS = _gauge(
    "kvmesh_pool_ejected_workers",
    "Workers out of the pools for consecutive failed health checks or calls, until one passes",
    roles="gateway, balancer",
)
_OUTBOXES = "kv_events (prefill, kvcache), finished_requests (decode)"
OUTBOX_MESSAGES = _gauge(
    "kvmesh_outbox_messages",
    "Events waiting in this process's outbox for NATS",
    ["outbox"],
    roles="prefill, decode, kvcache",
    note=_OUTBOXES,
)
OUTBOX_MESSAGES_PEAK = _gauge(
    "kvmesh_outbox_messages_peak",
    "The most events this process's outbox has held at once since it started",
    ["outbox"],
    roles="prefill, decode, kvcache",
    note=_OUTBOXES,
)
OUTBOX_MESSAGES_SENT = _gauge(
    "kvmesh_outbox_messages_sent",
    "Events this process's outbox has sent since it started (acknowledged, where a stream keeps them)",
    ["outbox"],
    roles="prefill, decode, kvcache",
    note=_OUTBOXES,
)
OUTBOX_MESSAGES_DROPPED = _gauge(
    "kvmesh_outbox_messages_dropped",
    "Events this process's outbox dropped since it started: it overflowed (a resync covers a store node's)",
    ["outbox"],
    roles="prefill, decode, kvcache",
    note=_OUTBOXES,
)

# balancer
BALANCER_ROUTES = _counter(
    "kvmesh_balancer_routes_total", "Requests routed, by pool and worker", ["pool", "worker"], roles="balancer"
)
BALANCER_DECODE_BINDINGS = _counter(
    "kvmesh_balancer_decode_bindings_total",
    "Decode workers chosen, by when: early (with prefill, at Route) or late (at BindDecode, the request's KV ready)",
    ["binding"],
    roles="balancer",
)
BALANCER_WORKERS = _gauge("kvmesh_balancer_workers", "Live workers per pool", ["pool"], roles="balancer")
BALANCER_RECOMMENDED_WORKERS = _gauge(
    "kvmesh_balancer_recommended_workers",
    "Workers each pool would need at the target utilization",
    ["pool"],
    roles="balancer",
)
BALANCER_PEER_ASSIGNMENTS = _counter(
    "kvmesh_balancer_peer_assignments_total",
    "Decisions of peer balancer replicas counted in this one's load view",
    roles="balancer",
)
ROLLOUT_DECISIONS = _counter(
    "kvmesh_rollout_decisions_total",
    "Canary rollout decisions made by this balancer",
    ["model", "action"],
    roles="balancer",
    note="action: start, hold, step, promote, rollback, abort (start and abort come from the admin API)",
)
ROLLOUT_SAMPLES = _counter(
    "kvmesh_rollout_samples_total",
    "Requests' outcomes (usage records naming a known worker) this balancer's rollout controller kept as samples",
    ["model"],
    roles="balancer",
)
ROLLOUT_QUALITY_PROBES = _counter(
    "kvmesh_rollout_quality_probes_total",
    "Runs of a rollout's quality probe (golden prompts, greedy, canary against stable) whose outcome this gateway "
    "recorded in the rollout",
    ["model", "result"],
    roles="gateway",
    note="result: match, mismatch (the balancers roll the canary back), not_run (no worker of a version, a worker "
    "failed, or an inconclusive rerun: the step holds, the probe runs again)",
)
ROLLOUT_WEIGHT = _gauge(
    "kvmesh_rollout_canary_weight",
    "The canary's share of the model's conversations (percent) by its latest rollout",
    ["model"],
    roles="balancer",
)
BALANCER_FINISHED_HEARD = _counter(
    "kvmesh_balancer_finished_requests_total",
    "Requests that left decode workers, heard on the finished-request feed",
    roles="balancer",
)

# expert rebalancer
EXPERT_BALANCEDNESS = _gauge(
    "kvmesh_expert_balancedness",
    "Mean / max GPU load of the current expert placement on its smoothed window, per MoE layer",
    ["model", "layer"],
    roles="expert_lb",
)
EXPERT_MOVES = _counter(
    "kvmesh_expert_moves_total",
    "Expert slots given a different expert by published plans",
    ["model"],
    roles="expert_lb",
)

# vision encoder
ENCODER_IMAGES = _counter(
    "kvmesh_encoder_images_total",
    "Images encoded, by model and whether the cache served them",
    ["model", "cached"],
    roles="encoder",
    note="true, false",
)
ENCODER_SECONDS = _histogram(
    "kvmesh_encoder_seconds",
    "Time to decode and encode one image (cache misses)",
    ["model"],
    buckets=_LATENCY,
    roles="encoder",
)
ENCODER_CACHE_BYTES = _gauge(
    "kvmesh_encoder_cache_bytes", "Embedding bytes held by this encoder's cache", roles="encoder"
)

# every role's internal gRPC server (mesh.rpc.Authorization)
GRPC_CALLS_DENIED = _counter(
    "kvmesh_grpc_calls_denied_total",
    "Internal gRPC calls refused (PERMISSION_DENIED): the caller's role may not call the method (mesh.access)",
    ["method", "role"],
    roles="encoder, prefill, decode, kvcache, balancer, expert_lb",
    note="method: /kvmesh.v1.Service/Method; role: the caller's certificate's, or none",
)
