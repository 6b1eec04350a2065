"""Typed, validated configuration: the model's architecture (from an HF config.json) and the engine's settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from mesh.eviction.policies import POLICIES

SUPPORTED_MODEL_TYPES = ("llama", "deepseek_v3", "deepseek_v4")
QUANTIZATION_MODES = ("none", "int8")  # engine_core.quantization implements them
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ConfigError(ValueError):
    """A model or engine configuration that cannot be used; the message names the setting."""


def _require(raw: dict[str, Any], key: str, kind: type[int] | type[float]) -> Any:
    """A positive number the model cannot do without."""
    if key not in raw:
        raise ConfigError(f"malformed model config: missing {key!r}")
    value = raw[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ConfigError(f"malformed model config: {key!r} must be {kind.__name__}, got {value!r}")
    if value <= 0:
        raise ConfigError(f"malformed model config: {key!r} must be positive, got {value!r}")
    return value


def _rope_params(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling) from either the old (`rope_theta` + `rope_scaling`) or new (`rope_parameters`) form."""
    params = raw.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    scaling = raw.get("rope_scaling") or None
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling is not None:
        scaling = dict(scaling)
        scaling["rope_type"] = scaling.get("rope_type") or scaling.get("type") or "default"
        if scaling["rope_type"] == "default":
            scaling = None
    return theta, scaling


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3)."""

    q_lora_rank: int | None  # None: a plain q_proj
    kv_lora_rank: int  # R: the latent cached per token
    qk_nope_head_dim: int
    qk_rope_head_dim: int  # P: the rotary part, cached per token beside the latent
    v_head_dim: int
    rope_interleave: bool  # rotary dims stored as (x0, x1), (x2, x3) pairs, as DeepSeek's checkpoints are


@dataclass(frozen=True)
class MoEConfig:
    """DeepSeekMoE: sigmoid scores, group-limited top-k with a score-correction bias, shared experts."""

    num_experts: int
    num_shared_experts: int
    num_experts_per_tok: int
    num_groups: int
    topk_groups: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    moe_intermediate_size: int
    first_k_dense_replace: int  # layers before this index use a dense MLP


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # llama: per-head size; deepseek: the rotary dims (HF's convention)
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str  # the checkpoint's dtype, informational
    mla: MLAConfig | None = None
    moe: MoEConfig | None = None
    v4: V4Config | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unsupported model_type {model_type!r}: supported are {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if model_type == "deepseek_v4":
            return _deepseek_v4_model_config(raw)
        hidden = _require(raw, "hidden_size", int)
        heads = _require(raw, "num_attention_heads", int)
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ConfigError(
                f"malformed model config: num_attention_heads {heads} not a multiple of kv heads {kv_heads}"
            )
        theta, scaling = _rope_params(raw)
        mla = moe = None
        if model_type == "deepseek_v3":
            mla, moe = _mla_config(raw), _moe_config(raw)
        head_dim = int(raw.get("head_dim") or hidden // heads)
        if mla is not None:
            head_dim = mla.qk_rope_head_dim
        return cls(
            model_type=model_type,
            vocab_size=_require(raw, "vocab_size", int),
            hidden_size=hidden,
            intermediate_size=_require(raw, "intermediate_size", int),
            num_layers=_require(raw, "num_hidden_layers", int),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=_require(raw, "max_position_embeddings", int),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_eos_ids(raw.get("eos_token_id")),
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            mla=mla,
            moe=moe,
            raw=raw,
        )

    @property
    def kv_entry_shape(self) -> tuple[int, ...]:
        """Shape of one token's KV in one layer: (2, K, D) for GQA, (R + P,) for MLA's latent cache."""
        if self.mla is not None:
            return (self.mla.kv_lora_rank + self.mla.qk_rope_head_dim,)
        if self.v4 is not None:
            return (self.head_dim,)
        return (2, self.num_kv_heads, self.head_dim)


def _deepseek_v4_model_config(raw: dict[str, Any]) -> ModelConfig:
    v4 = _v4_config(raw)
    return ModelConfig(
        model_type="deepseek_v4",
        vocab_size=_require(raw, "vocab_size", int),
        hidden_size=_require(raw, "hidden_size", int),
        intermediate_size=v4.moe_intermediate_size,  # V4 has no dense MLP: every layer is MoE
        num_layers=len(v4.attention_types),
        num_heads=_require(raw, "num_attention_heads", int),
        num_kv_heads=1,  # one KV vector per token, read as both key and value
        head_dim=v4.head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=v4.rope_theta,
        rope_scaling=None,  # V4's two ropes live in `v4` (main and compress)
        max_position_embeddings=_require(raw, "max_position_embeddings", int),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=False,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos_ids(raw.get("eos_token_id")),
        torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
        v4=v4,
        raw=raw,
    )


def _mla_config(raw: dict[str, Any]) -> MLAConfig:
    q_lora = raw.get("q_lora_rank")
    return MLAConfig(
        q_lora_rank=int(q_lora) if q_lora else None,
        kv_lora_rank=_require(raw, "kv_lora_rank", int),
        qk_nope_head_dim=_require(raw, "qk_nope_head_dim", int),
        qk_rope_head_dim=_require(raw, "qk_rope_head_dim", int),
        v_head_dim=_require(raw, "v_head_dim", int),
        rope_interleave=bool(raw.get("rope_interleave", True)),
    )


def _moe_config(raw: dict[str, Any]) -> MoEConfig:
    scoring = raw.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise ConfigError(f"unsupported scoring_func {scoring!r} for deepseek_v3: only 'sigmoid'")
    experts = _require(raw, "n_routed_experts", int)
    groups = int(raw.get("n_group") or 1)
    if experts % groups:
        raise ConfigError(f"malformed model config: n_routed_experts {experts} not a multiple of n_group {groups}")
    topk_groups = int(raw.get("topk_group") or groups)
    top_k = _require(raw, "num_experts_per_tok", int)
    if topk_groups > groups or top_k > topk_groups * (experts // groups):
        raise ConfigError(
            f"malformed model config: num_experts_per_tok {top_k} cannot be chosen from topk_group {topk_groups} "
            f"of n_group {groups} groups"
        )
    return MoEConfig(
        num_experts=experts,
        num_shared_experts=int(raw.get("n_shared_experts") or 0),
        num_experts_per_tok=top_k,
        num_groups=groups,
        topk_groups=topk_groups,
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        moe_intermediate_size=_require(raw, "moe_intermediate_size", int),
        first_k_dense_replace=int(raw.get("first_k_dense_replace", 0)),
    )


# DeepSeek-V4's attention types, by their names in HF configs, and the short names used in code and docs.
V4_ATTENTION_TYPES = {
    "sliding_attention": "window",
    "compressed_sparse_attention": "csa",
    "heavily_compressed_attention": "hca",
}


@dataclass(frozen=True)
class V4Config:
    """DeepSeek-V4: a sliding window on every layer, compressed entries appended to it on CSA and HCA layers,
    hyper-connections (several residual streams), MoE on every layer (the first ones hash-routed)."""

    attention_types: tuple[str, ...]  # per layer: window | csa | hca
    is_hash_moe: tuple[bool, ...]  # per layer: experts chosen by token id (tid2eid), not by score
    csa_ratio: int  # tokens per compressed entry on CSA layers (4 in V4-Flash)
    hca_ratio: int  # ... on HCA layers (128)
    head_dim: int  # D: the one KV vector per token, also each query head's size (512)
    rope_head_dim: int  # the rotated tail of every head and entry (64)
    q_lora_rank: int
    o_groups: int  # the grouped output projection: heads in o_groups groups ...
    o_lora_rank: int  # ... each projected to o_lora_rank values
    sliding_window: int  # every query sees this many latest tokens, itself included (128)
    index_num_heads: int  # the lightning indexer of CSA layers
    index_head_dim: int
    index_topk: int  # compressed entries a CSA query attends to
    hc_mult: int  # residual streams (4)
    hc_sinkhorn_iters: int
    hc_eps: float
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int  # routed experts' and the one shared expert's width
    routed_scaling_factor: float
    scoring_func: str  # sqrtsoftplus | sigmoid
    swiglu_limit: float  # gate and up clamped to this before SwiGLU
    rope_theta: float  # "main" rope: window-only layers
    compress_rope_theta: float  # "compress" rope: CSA/HCA layers, their compressors and the indexer
    compress_rope_scaling: dict[str, Any] | None  # YaRN of the compress rope (attention factor 1)

    def compress_ratio(self, layer: int) -> int:
        """Tokens per compressed entry on `layer`; 0 on window-only layers."""
        kind = self.attention_types[layer]
        return {"window": 0, "csa": self.csa_ratio, "hca": self.hca_ratio}[kind]


def _v4_layer_types(raw: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    """Per-layer attention types from `layer_types`, or the legacy per-layer `compress_ratios` (0/4/128)."""
    names = raw.get("layer_types")
    if names is None and raw.get("compress_ratios") is not None:
        by_ratio = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
        unknown = [r for r in raw["compress_ratios"] if r not in by_ratio]
        if unknown:
            raise ConfigError(f"unsupported compress_ratios entries {unknown}: supported are 0, 4 and 128")
        names = [by_ratio[r] for r in raw["compress_ratios"]]
    if names is None:  # transformers' default: two HCA layers, then CSA and HCA alternating
        names = ["heavily_compressed_attention"] * min(num_layers, 2) + [
            "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention"
            for i in range(max(num_layers - 2, 0))
        ]
    names = list(names)[:num_layers]
    if len(names) != num_layers:
        raise ConfigError(f"malformed model config: layer_types has {len(names)} entries for {num_layers} layers")
    bad = [n for n in names if n not in V4_ATTENTION_TYPES]
    if bad:
        raise ConfigError(f"unsupported layer_types entries {bad}: supported are {', '.join(V4_ATTENTION_TYPES)}")
    return tuple(V4_ATTENTION_TYPES[n] for n in names)


def _v4_hash_layers(raw: dict[str, Any], num_layers: int) -> tuple[bool, ...]:
    """Hash-routed MoE layers from `mlp_layer_types`, or the legacy `num_hash_layers` (default 3)."""
    kinds = raw.get("mlp_layer_types")
    if kinds is None:
        num_hash = int(raw.get("num_hash_layers", 3))
        kinds = ["hash_moe"] * min(num_layers, num_hash) + ["moe"] * max(0, num_layers - num_hash)
    kinds = list(kinds)[:num_layers]
    bad = [k for k in kinds if k not in ("hash_moe", "moe")]
    if bad or len(kinds) != num_layers:
        raise ConfigError(f"malformed model config: mlp_layer_types {kinds!r} (hash_moe or moe, one per layer)")
    return tuple(k == "hash_moe" for k in kinds)


def _v4_ropes(raw: dict[str, Any], head_dim: int) -> tuple[int, float, float, dict[str, Any] | None]:
    """(rope dims, main theta, compress theta, compress YaRN) from nested `rope_parameters` {main, compress}, a
    flat `rope_parameters`, or the legacy `rope_scaling` + `qk_rope_head_dim`."""
    params = dict(raw.get("rope_parameters") or {})
    main, compress = params.get("main"), params.get("compress")
    if not isinstance(compress, dict):
        compress = {k: v for k, v in (params or raw.get("rope_scaling") or {}).items() if k not in ("main", "compress")}
        compress["rope_theta"] = raw.get("compress_rope_theta", 160000.0)
    main = main if isinstance(main, dict) else {"rope_theta": raw.get("rope_theta", 10000.0)}
    factor = compress.get("partial_rotary_factor") or raw.get("partial_rotary_factor")
    if factor is not None:
        rope_dim = int(head_dim * float(factor))
    else:
        rope_dim = int(raw.get("qk_rope_head_dim") or head_dim // 8)
    if rope_dim <= 0 or rope_dim % 2 or rope_dim > head_dim:
        raise ConfigError(f"malformed model config: rotary dims {rope_dim} (partial_rotary_factor) for {head_dim}")
    scaling = {k: v for k, v in compress.items() if k not in ("rope_theta", "partial_rotary_factor")}
    scaling["rope_type"] = scaling.get("rope_type") or scaling.get("type") or "default"
    if scaling["rope_type"] == "yarn":
        scaling.setdefault("attention_factor", 1.0)  # the V4 reference never scales cos/sin
    elif scaling["rope_type"] != "default":
        raise ConfigError(f"unsupported compress rope type {scaling['rope_type']!r} for deepseek_v4: yarn or default")
    yarn = scaling if scaling["rope_type"] == "yarn" else None
    return rope_dim, float(main.get("rope_theta", 10000.0)), float(compress["rope_theta"]), yarn


def _v4_config(raw: dict[str, Any]) -> V4Config:
    num_layers = _require(raw, "num_hidden_layers", int)
    heads, head_dim = _require(raw, "num_attention_heads", int), _require(raw, "head_dim", int)
    rates = dict(raw.get("compress_rates") or {})
    csa = int(raw.get("compress_rate_csa") or rates.get("compressed_sparse_attention", 4))
    hca = int(raw.get("compress_rate_hca") or rates.get("heavily_compressed_attention", 128))
    if csa <= 0 or hca <= 0:
        raise ConfigError(f"malformed model config: compress rates must be positive, got csa {csa}, hca {hca}")
    if int(raw.get("num_key_value_heads") or 1) != 1:
        raise ConfigError("malformed model config: num_key_value_heads must be 1 for deepseek_v4 (one KV vector)")
    if int(raw.get("n_shared_experts", 1)) != 1:
        raise ConfigError(f"unsupported n_shared_experts {raw['n_shared_experts']!r} for deepseek_v4: only 1")
    scoring = raw.get("scoring_func", "sqrtsoftplus")
    if scoring not in ("sqrtsoftplus", "sigmoid"):
        raise ConfigError(f"unsupported scoring_func {scoring!r} for deepseek_v4: sqrtsoftplus or sigmoid")
    groups = _require(raw, "o_groups", int)
    if heads % groups:
        raise ConfigError(f"malformed model config: o_groups {groups} must divide num_attention_heads {heads}")
    rope_dim, theta, compress_theta, yarn = _v4_ropes(raw, head_dim)
    index_head_dim = _require(raw, "index_head_dim", int)
    if index_head_dim < rope_dim:
        raise ConfigError(f"malformed model config: index_head_dim {index_head_dim} below the rotary dims {rope_dim}")
    return V4Config(
        attention_types=_v4_layer_types(raw, num_layers),
        is_hash_moe=_v4_hash_layers(raw, num_layers),
        csa_ratio=csa,
        hca_ratio=hca,
        head_dim=head_dim,
        rope_head_dim=rope_dim,
        q_lora_rank=_require(raw, "q_lora_rank", int),
        o_groups=groups,
        o_lora_rank=_require(raw, "o_lora_rank", int),
        sliding_window=int(raw.get("sliding_window", 128)),
        index_num_heads=_require(raw, "index_n_heads", int),
        index_head_dim=index_head_dim,
        index_topk=_require(raw, "index_topk", int),
        hc_mult=int(raw.get("hc_mult", 4)),
        hc_sinkhorn_iters=int(raw.get("hc_sinkhorn_iters", 20)),
        hc_eps=float(raw.get("hc_eps", 1e-6)),
        num_experts=_require(raw, "n_routed_experts", int),
        num_experts_per_tok=_require(raw, "num_experts_per_tok", int),
        moe_intermediate_size=_require(raw, "moe_intermediate_size", int),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.5)),
        scoring_func=scoring,
        swiglu_limit=float(raw.get("swiglu_limit", 10.0)),
        rope_theta=theta,
        compress_rope_theta=compress_theta,
        compress_rope_scaling=yarn,
    )


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model. Validated when built; a bad value names the setting."""

    model: str  # a known name (`kvmesh models list`), an HF directory, or a .gguf file
    device: str = "auto"  # auto | cpu | cuda | ascend
    dtype: str = "auto"  # auto (bfloat16 on accelerators, float32 on cpu) | float32 | bfloat16 | float16
    block_size: int = 16  # tokens per KV block
    kv_cache_memory_bytes: int = 512 * 2**20  # the KV cache never takes more than this
    num_kv_blocks: int | None = None  # overrides kv_cache_memory_bytes when set
    max_num_seqs: int = 64  # requests in one batch
    max_num_batched_tokens: int = 2048  # tokens computed in one step (chunked prefill splits longer prompts)
    max_model_len: int | None = None  # context limit; defaults to the model's, capped by the KV cache's capacity
    enable_prefix_caching: bool = True
    seed: int = 0  # seeds unseeded sampling
    served_name: str | None = None  # the model's name in block hashes and APIs (default: the `model` argument)
    # MoE models only (others ignore them): ranks the routed experts run on, and spare slots for replicas of hot
    # experts; (experts + num_redundant_experts) must be a multiple of expert_parallel_size
    expert_parallel_size: int = 1
    num_redundant_experts: int = 0
    quantization: str = "none"  # none | int8 (linear layers in int8 on the cpu: engine_core.quantization)
    # float32 on the cpu without quantization: linear layers run a weight reordered once for oneDNN at 2 rows or
    # more (engine_core.packed_linear; a second copy of the linear weights in memory); elsewhere ignored
    cpu_packed_linear: bool = True
    # float32 decode attention on the cpu, and a prompt chunk's attention over its cached context, by C++ kernels
    # that read the paged cache in place (devices.cpu_kernels, built by make install or at first use; off, or where
    # they cannot be built: each layer gathers its blocks for SDPA or GEMMs); elsewhere ignored
    cpu_decode_kernel: bool = True
    # while requests decode, a prefill computes at most this many prompt tokens a step (0: no cap), so that a long
    # prompt arriving cannot stall the running streams (vLLM's long_prefill_token_threshold)
    long_prefill_token_threshold: int = 256
    # while requests stream, long prompts' chunks are also sized from measured step times so that a step with
    # prefill work takes at most this many times a decode-only step (engine_core.prefill_budget; 0: the token cap
    # alone). Off here, for offline batches, where nobody waits between two tokens and it costs throughput (a batch
    # whose last prompts trickle in beside the first to stream); the serving workers turn it on
    # (mesh.compute.settings: KVMESH_LONG_PREFILL_STEP_RATIO, 1.5).
    long_prefill_step_ratio: float = 0.0
    device_cache_policy: str = "lru"  # which free cached block goes first: a mesh.eviction policy (POLICIES)

    def __post_init__(self) -> None:
        for name in (
            "block_size",
            "kv_cache_memory_bytes",
            "max_num_seqs",
            "max_num_batched_tokens",
            "expert_parallel_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.num_redundant_experts, int) or self.num_redundant_experts < 0:
            raise ConfigError(
                f"num_redundant_experts must be a non-negative integer, got {self.num_redundant_experts!r}"
            )
        for name in ("num_kv_blocks", "max_model_len"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ConfigError(f"{name} must be a positive integer or None, got {value!r}")
        for name in ("cpu_packed_linear", "cpu_decode_kernel"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.quantization not in QUANTIZATION_MODES:
            raise ConfigError(f"quantization must be one of {', '.join(QUANTIZATION_MODES)}, got {self.quantization!r}")
        threshold = self.long_prefill_token_threshold
        if not isinstance(threshold, int) or isinstance(threshold, bool) or threshold < 0:
            raise ConfigError(f"long_prefill_token_threshold must be a non-negative integer, got {threshold!r}")
        ratio = self.long_prefill_step_ratio
        if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not (ratio == 0 or ratio >= 1):
            raise ConfigError(f"long_prefill_step_ratio must be 0 (off) or at least 1, got {ratio!r}")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ConfigError(f"dtype must be auto or one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        if self.device_cache_policy not in POLICIES:
            raise ConfigError(
                f"device_cache_policy must be one of {', '.join(POLICIES)}, got {self.device_cache_policy!r}"
            )

    def torch_dtype(self, device_name: str) -> torch.dtype:
        if self.dtype == "auto":
            return torch.float32 if device_name == "cpu" else torch.bfloat16
        return _DTYPES[self.dtype]
