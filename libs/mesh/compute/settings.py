"""Settings every compute worker (prefill, decode) reads, from KVMESH_* like every other setting."""

from __future__ import annotations

from dataclasses import dataclass

from engine_core import EngineConfig, model_store
from engine_core.config import QUANTIZATION_MODES
from mesh.compute.faults import Faults
from mesh.config import ServiceSettings, require, setting
from mesh.eviction.policies import POLICIES
from mesh.logging import get_logger

DEVICES = ("auto", "cpu", "cuda", "ascend")
log = get_logger(__name__)


@dataclass(frozen=True)
class WorkerSettings(ServiceSettings):
    models: tuple[str, ...] = setting(
        model_store.DEFAULT_MODELS, "served models: known names or paths, each served under that name"
    )
    device: str = setting("cpu", "auto, cpu, cuda or ascend")
    kv_cache_memory_bytes: int = setting(256 * 2**20, "the KV cache of each model, sized once and never exceeded")
    max_num_seqs: int = setting(32, "requests in one batch")
    max_num_batched_tokens: int = setting(1024, "tokens in one engine step (chunked prefill past it)")
    long_prefill_token_threshold: int = setting(
        256,
        "while requests decode, prefills compute at most this many prompt tokens a step, so a long prompt cannot "
        "stall running streams (0: no cap; docs/engine.md)",
    )
    long_prefill_step_ratio: float = setting(
        1.5,
        "while requests stream, long prompts' chunks (over the token cap) are also sized from measured step times "
        "so that a step with prefill work takes at most this many times a decode-only step (0: the token cap alone; "
        "at least 1 otherwise; docs/engine.md)",
    )
    quantization: str = setting(
        "none",
        "none, or int8: linear layers with int8 weights and activations on the cpu (llama models; docs/engine.md)",
    )
    cpu_packed_linear: bool = setting(
        True,
        "float32 on the cpu: linear layers run a weight reordered once for oneDNN at 2 rows or more, a second copy "
        "of the linear weights in memory (off: F.linear alone; docs/engine.md)",
    )
    cpu_decode_kernel: bool = setting(
        True,
        "float32 on the cpu: decode attention, and a prompt chunk's attention over its cached context, by C++ "
        "kernels that read the paged KV cache in place, built by make install or at first use (needs g++ and "
        "ninja; where they cannot be built, a warning and the gather + SDPA path; off: that path always; "
        "docs/engine.md)",
    )
    torch_threads: int = setting(1, "CPU threads per worker (several roles often share one machine's cores)")
    prefix_caching_enabled: bool = setting(
        True, "reuse the KV of a prompt's leading blocks this worker already holds (off: every prompt computed in full)"
    )
    device_cache_policy: str = setting(
        "lru",
        "which cached block the device prefix cache gives up first: "
        + ", ".join(POLICIES)
        + " (mesh.eviction, as the KV store's KVMESH_EVICTION_POLICY; docs/kvcache.md)",
    )
    block_size: int = setting(
        16,
        "tokens per KV block of a model whose engine takes it (Llama, DeepSeek-V3; DeepSeek-V4 rounds it up to a "
        "multiple of its compress ratios: 128 for V4-Flash); each model's own is announced, and routing keys use it",
    )
    # MoE models: expert parallelism simulated in the worker
    expert_parallel_size: int = setting(1, "MoE models: expert-parallel ranks")
    num_redundant_experts: int = setting(0, "MoE models: spare expert slots for replicas of hot experts")
    expert_report_steps: int = setting(
        0, "MoE models: publish expert loads every this many engine steps and apply expert_lb's plans (0: off)"
    )
    # testing only: faults a canary rollout must catch (mesh.compute.faults)
    allow_fault_injection: bool = setting(
        False, "accept the FAULT_* settings below (testing only); without it a worker given one refuses to start"
    )
    fault_token_delay_s: float = setting(0.0, "testing: seconds added before each token this worker streams")
    fault_error_rate: float = setting(
        0.0, "testing: share of requests this worker fails (UNAVAILABLE) before their first token, 0 to 1"
    )
    fault_weight_noise: float = setting(
        0.0,
        "testing: Gaussian noise added to every weight at load, times that weight tensor's standard deviation "
        "(other weights under the same name: a quality probe must catch it)",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        require(len(self.models) > 0, "models", self.models, "must name at least one model")
        require(len(set(self.models)) == len(self.models), "models", self.models, "must not repeat a model")
        require(self.device in DEVICES, "device", self.device, f"must be one of {', '.join(DEVICES)}")
        for name in (
            "kv_cache_memory_bytes",
            "max_num_seqs",
            "max_num_batched_tokens",
            "torch_threads",
            "block_size",
            "expert_parallel_size",
        ):
            value = getattr(self, name)
            require(value > 0, name, value, "must be positive")
        require(
            self.device_cache_policy in POLICIES,
            "device_cache_policy",
            self.device_cache_policy,
            f"must be one of {', '.join(POLICIES)}",
        )
        require(
            self.quantization in QUANTIZATION_MODES,
            "quantization",
            self.quantization,
            f"must be one of {', '.join(QUANTIZATION_MODES)}",
        )
        for name in ("num_redundant_experts", "expert_report_steps", "long_prefill_token_threshold"):
            value = getattr(self, name)
            require(value >= 0, name, value, "must not be negative")
        ratio = self.long_prefill_step_ratio
        require(ratio == 0 or ratio >= 1, "long_prefill_step_ratio", ratio, "must be 0 (off) or at least 1")
        self._check_faults()

    def _check_faults(self) -> None:
        require(self.fault_token_delay_s >= 0, "fault_token_delay_s", self.fault_token_delay_s, "must not be negative")
        require(0 <= self.fault_error_rate <= 1, "fault_error_rate", self.fault_error_rate, "must be from 0 to 1")
        require(self.fault_weight_noise >= 0, "fault_weight_noise", self.fault_weight_noise, "must not be negative")
        for name in ("fault_token_delay_s", "fault_error_rate", "fault_weight_noise"):
            value = getattr(self, name)
            require(
                self.allow_fault_injection or not value,
                name,
                value,
                "fault injection is for tests: set KVMESH_ALLOW_FAULT_INJECTION=1 to accept it",
            )

    def faults(self) -> Faults:
        if self.allow_fault_injection:
            log.warning(
                "fault injection allowed", token_delay_s=self.fault_token_delay_s, error_rate=self.fault_error_rate
            )
        return Faults(self.fault_token_delay_s, self.fault_error_rate)

    def engine_config(self, model: str) -> EngineConfig:
        return EngineConfig(
            model,
            device=self.device,
            block_size=self.block_size,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            long_prefill_step_ratio=self.long_prefill_step_ratio,
            quantization=self.quantization,
            cpu_packed_linear=self.cpu_packed_linear,
            cpu_decode_kernel=self.cpu_decode_kernel,
            enable_prefix_caching=self.prefix_caching_enabled,
            device_cache_policy=self.device_cache_policy,
            served_name=model,
            expert_parallel_size=self.expert_parallel_size,
            num_redundant_experts=self.num_redundant_experts,
        )
