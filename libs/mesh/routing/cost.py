"""The cost model: how long a worker takes to prefill a prompt, fetch cached KV from a tier, hand KV to decode, and
run one decode step. The live balancer predicts with it and the simulator (`kvmesh bench route`) runs workers by it,
so a policy's predictions are as good as the model; live, every heartbeat replaces predicted queues by reported
ones, so a wrong rate costs accuracy between two heartbeats only.

Defaults describe one worker as one unit of DeepSeek's published V3/R1 deployment on H800 GPUs: a prefill unit
is 4 nodes (32 GPUs, EP32), a decode unit 18 nodes (144 GPUs, EP144). DeepSeek reports ~73.7k input tokens/s per
prefill node *including* cache hits at a 56.3% hit rate, so a unit computes 4 x 73.7k x (1 - 0.563) = ~129k
uncached tokens/s, plus ~10 ms per request that no token count explains (scheduling, sampling, the hand-off to
decode: what makes a short prompt cost about as much anywhere); decode runs at ~20 tokens/s per user, i.e.
steps of ~50 ms (14.8k output tokens/s per node).
Attention makes a token dearer the deeper into the context it sits: a token at position p costs
1 + p / `attention_knee_tokens` times a token at position 0; the knee is where MLA attention's FLOPs (~5 MFLOP per
query-key pair over 61 layers) equal the MoE's (~74 GFLOP per token for 37B active parameters). A decode step
reads every KV token of the batch: 70 KB each over 144 GPUs' ~480 TB/s at ~50% efficiency, ~3e-10 s per token.
`scale` multiplies every compute time (2.0: hardware half as fast); docs/balancer.md says how to fit the
constants to `kvmesh bench engine` on other hardware.
"""

from __future__ import annotations

from dataclasses import dataclass

TIER_CREDITS = {"device": 1.0, "host": 0.75, "ssd": 0.5}  # Dynamo-style credit of a cached block by tier


@dataclass(frozen=True)
class CostModel:
    prefill_tokens_per_s: float = 129_000.0  # uncached tokens per second at context position 0, per worker
    attention_knee_tokens: float = 14_800.0  # context depth at which attention doubles a token's cost
    prefill_overhead_s: float = 0.010  # per request: scheduling, sampling the first token, handing off the KV
    kv_bytes_per_token: int = 70_272  # DeepSeek-V3 MLA cache: 61 layers x (512 + 64) x 2 bytes
    host_bytes_per_s: float = 100e9  # the KV store's host tier into a prefill unit (4 nodes' RDMA NICs, half used)
    ssd_bytes_per_s: float = 25e9  # the KV store's SSD tier into a prefill unit
    network_bytes_per_s: float = 100e9  # prefill unit -> decode unit KV push
    decode_step_base_s: float = 0.050  # one decode step, all but attention (weights, expert dispatch/combine)
    decode_s_per_kv_token: float = 3e-10  # attention reads every KV token of the batch once per step
    scale: float = 1.0  # multiplies every compute time

    def __post_init__(self) -> None:
        for name in (
            "prefill_tokens_per_s",
            "attention_knee_tokens",
            "host_bytes_per_s",
            "ssd_bytes_per_s",
            "network_bytes_per_s",
            "scale",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if min(self.decode_step_base_s, self.decode_s_per_kv_token, self.prefill_overhead_s) < 0:
            raise ValueError("fixed and per-token costs must not be negative")

    def prefill_s(self, num_cached_tokens: int, num_new_tokens: int) -> float:
        """Compute `num_new_tokens` after a cached prefix: the mean context depth of a new token is
        cached + new/2, so attention adds that over the knee."""
        depth = num_cached_tokens + num_new_tokens / 2
        compute_s = num_new_tokens / self.prefill_tokens_per_s * (1 + depth / self.attention_knee_tokens)
        return (self.prefill_overhead_s + compute_s) * self.scale

    def queued_s(self, num_tokens: int) -> float:
        """Prefill time of tokens a worker reports queued, whose context depth it does not report."""
        return num_tokens / self.prefill_tokens_per_s * self.scale

    def fetch_s(self, num_tokens: int, tier: str) -> float:
        """Reading cached KV of `num_tokens` from a store tier (device: already in place)."""
        if tier == "device" or num_tokens <= 0:
            return 0.0
        rate = self.host_bytes_per_s if tier == "host" else self.ssd_bytes_per_s
        return num_tokens * self.kv_bytes_per_token / rate

    def transfer_s(self, num_tokens: int) -> float:
        """Pushing a prompt's KV from the prefill worker to the decode worker."""
        return num_tokens * self.kv_bytes_per_token / self.network_bytes_per_s

    def decode_step_s(self, num_kv_tokens: int) -> float:
        return (self.decode_step_base_s + self.decode_s_per_kv_token * num_kv_tokens) * self.scale
