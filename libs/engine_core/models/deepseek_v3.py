"""DeepSeek-V3: multi-head latent attention (MLA) and DeepSeekMoE.

The KV cache holds, per token and layer, only the compressed latent (R = kv_lora_rank values, after its
norm) and the rotated shared key part (P = qk_rope_head_dim values): (R + P) values instead of
2 * H * head size. Prefill expands the latent into per-head keys and values; decode stays in the latent
space ("absorbed" attention): queries are projected into it, attention runs over the cached latents, and
the result is projected to values per head.

Shapes: T tokens, Hd hidden, H heads, dn/dr/dv the no-rope, rope and value head sizes, R, P as above,
E routed experts, k experts per token.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from devices.base import DeviceOps
from engine_core.config import MLAConfig, ModelConfig, MoEConfig
from engine_core.models.batch import ForwardBatch, write_cache
from engine_core.models.experts import ExpertCounters, PhysicalExperts
from engine_core.models.layers import CausalLM, CosSin, DecoderLayer, GatedMLP, RMSNorm
from engine_core.models.loading import Target
from engine_core.models.rope import RotaryEmbedding, yarn_mscale


def softmax_scale(config: ModelConfig) -> float:
    assert config.mla is not None
    scale = (config.mla.qk_nope_head_dim + config.mla.qk_rope_head_dim) ** -0.5
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type") == "yarn" and scaling.get("mscale_all_dim"):
        mscale = yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"]))
        scale *= mscale * mscale
    return scale


class MLAttention(nn.Module):
    def __init__(self, config: ModelConfig, ops: DeviceOps) -> None:
        super().__init__()
        mla = config.mla
        assert mla is not None
        self.mla: MLAConfig = mla
        self.num_heads = config.num_heads
        qk_head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        hidden, bias = config.hidden_size, config.attention_bias
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, self.num_heads * qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, 1e-6, ops)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, self.num_heads * qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, mla.kv_lora_rank + mla.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, 1e-6, ops)
        self.kv_b_proj = nn.Linear(
            mla.kv_lora_rank, self.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(self.num_heads * mla.v_head_dim, hidden, bias=bias)
        self.scale = softmax_scale(config)
        self.ops = ops

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q_proj(x) if self.mla.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(x.shape[0], self.num_heads, -1)  # (T, H, dn + dr)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: CosSin,
        rope: RotaryEmbedding,
        cache: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        mla = self.mla
        q_nope, q_rope = self._queries(x).split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)  # (T, R)
        q_rope = rope(q_rope, *cos_sin)  # (T, H, dr)
        k_rope = rope(k_rope[:, None, :], *cos_sin)[:, 0]  # (T, dr): one rope key shared by all heads
        entries = torch.cat([latent, k_rope], dim=-1)  # (T, R + P)
        write_cache(cache, batch.slot_mapping, entries)
        out = x.new_empty(x.shape[0], self.num_heads, mla.v_head_dim)  # (T, H, dv)
        if batch.num_decode_tokens:
            n = batch.num_decode_tokens
            out[:n] = self._decode(q_nope[:n], q_rope[:n], cache, batch)
        for seg in batch.prefills:
            seg_entries = entries[seg.start : seg.end]
            if seg.num_cached:
                num_total = seg.num_cached + seg.end - seg.start
                seg_entries = self.ops.gather_cache(cache, seg.block_ids, num_total, role="latent")
            out[seg.start : seg.end] = self._prefill(
                q_nope[seg.start : seg.end], q_rope[seg.start : seg.end], seg_entries, seg.num_cached
            )
        return self.o_proj(out.flatten(1))

    def _prefill(
        self, q_nope: torch.Tensor, q_rope: torch.Tensor, entries: torch.Tensor, num_cached: int
    ) -> torch.Tensor:
        """Expanded attention for one segment: entries (L, R + P) -> (Lq, H, dv)."""
        mla = self.mla
        latent, k_rope = entries.split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(latent).view(latent.shape[0], self.num_heads, -1)  # (L, H, dn + dv)
        k_nope, v = kv.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_rope[:, None, :].expand(-1, self.num_heads, -1)], dim=-1)  # (L, H, dn + dr)
        q = torch.cat([q_nope, q_rope], dim=-1)  # (Lq, H, dn + dr)
        return self.ops.prefill_attention(q, k, v, num_cached, self.scale)

    def _decode(
        self, q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """Absorbed attention for single-token requests: (B, H, dn), (B, H, dr) -> (B, H, dv)."""
        assert batch.decode is not None
        mla = self.mla
        w_kv_b = self.kv_b_proj.weight.view(self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        w_uk, w_uv = w_kv_b.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=1)  # (H, dn, R), (H, dv, R)
        q_latent = torch.einsum("bhd,hdr->bhr", q_nope, w_uk)  # (B, H, R)
        out_latent = self.ops.mla_decode_attention(q_latent, q_rope, cache, batch.decode, self.scale)  # (B, H, R)
        return torch.einsum("bhr,hvr->bhv", out_latent, w_uv)  # (B, H, dv)


class MoEGate(nn.Module):
    """Sigmoid scores; the top `topk_groups` groups (by the sum of their two best biased scores) are eligible;
    the top-k experts among them by biased score are chosen, weighted by their unbiased scores."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        assert config.moe is not None
        self.moe: MoEConfig = config.moe
        self.weight = nn.Parameter(torch.empty(self.moe.num_experts, config.hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(self.moe.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, Hd) -> topk ids (T, k) int64, topk weights (T, k) fp32."""
        moe = self.moe
        scores = (x.float() @ self.weight.float().T).sigmoid()  # (T, E)
        biased = scores + self.e_score_correction_bias
        per_group = biased.view(-1, moe.num_groups, moe.num_experts // moe.num_groups)  # (T, G, E/G)
        group_scores = per_group.topk(min(2, per_group.shape[-1]), dim=-1).values.sum(dim=-1)  # (T, G)
        groups = group_scores.topk(moe.topk_groups, dim=-1, sorted=False).indices  # (T, g)
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
        expert_mask = group_mask[:, :, None].expand_as(per_group).reshape(-1, moe.num_experts)  # (T, E)
        topk_ids = (
            biased.masked_fill(~expert_mask, float("-inf")).topk(moe.num_experts_per_tok, dim=-1, sorted=False).indices
        )
        topk_weights = scores.gather(1, topk_ids)
        if moe.norm_topk_prob:
            topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
        return topk_ids, topk_weights * moe.routed_scaling_factor


class DeepseekMoE(nn.Module):
    """Shared experts plus the routed ones. The routed experts' logical weights (E, ...) are what checkpoints
    load; under expert parallelism the engine sets `placement` (their copies in slot order, replicas of hot
    experts included) and the tokens go to slots. `placement` and `counters` are set and replaced only by the
    engine thread (engine_core.expert_parallel), between steps; a model outside an engine has neither."""

    def __init__(self, config: ModelConfig, ops: DeviceOps) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None
        inter, hidden = moe.moe_intermediate_size, config.hidden_size
        self.gate = MoEGate(config)
        self.w_gate_up = nn.Parameter(torch.empty(moe.num_experts, 2 * inter, hidden), requires_grad=False)
        self.w_down = nn.Parameter(torch.empty(moe.num_experts, hidden, inter), requires_grad=False)
        self.shared_experts = GatedMLP(hidden, inter * moe.num_shared_experts, ops) if moe.num_shared_experts else None
        self.ops = ops
        self.placement: PhysicalExperts | None = None  # None: the logical experts are the slots, on one rank
        self.counters: ExpertCounters | None = None
        self.num_routed_tokens = 0  # every token so far: rotates tokens over an expert's replicas

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_ids, topk_weights = self.gate(x)
        placement = self.placement
        if placement is None:
            slot_ids = None
            out = self.ops.moe_experts(x, self.w_gate_up, self.w_down, topk_ids, topk_weights)
        else:
            slot_ids = placement.dispatch(topk_ids, self.num_routed_tokens)  # (T, k)
            out = self.ops.moe_experts(x, placement.w_gate_up, placement.w_down, slot_ids, topk_weights)
        self.num_routed_tokens += x.shape[0]
        if self.counters is not None:
            self.counters.record(topk_ids, slot_ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class DeepseekV3ForCausalLM(CausalLM):
    kv_block_axis = 0

    def __init__(self, config: ModelConfig, ops: DeviceOps) -> None:
        assert config.mla is not None and config.moe is not None
        first_moe = config.moe.first_k_dense_replace
        layers = (
            DecoderLayer(
                config,
                ops,
                MLAttention(config, ops),
                DeepseekMoE(config, ops)
                if i >= first_moe
                else GatedMLP(config.hidden_size, config.intermediate_size, ops),
            )
            for i in range(config.num_layers)
        )
        rope = RotaryEmbedding(
            config.mla.qk_rope_head_dim,
            config.rope_theta,
            config.rope_scaling,
            config.max_position_embeddings,
            interleaved=config.mla.rope_interleave,
        )
        super().__init__(config, ops, layers, rope)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Per layer: the latent and the rope key, (N, S, R + P)."""
        assert self.config.mla is not None
        return (num_blocks, block_size, self.config.mla.kv_lora_rank + self.config.mla.qk_rope_head_dim)

    def _target(self, name: str) -> Target:
        match = re.match(r"model\.layers\.(\d+)\.", name)
        if match and int(match.group(1)) >= self.config.num_layers:
            return None  # multi-token-prediction layers, which serving does not use
        if self._skips(name):
            return None
        assert self.config.moe is not None
        inter = self.config.moe.moe_intermediate_size
        expert = re.fullmatch(r"(model\.layers\.\d+\.mlp)\.experts\.(\d+)\.(gate|up|down)_proj\.weight", name)
        if expert:
            prefix, index, part = expert.group(1), int(expert.group(2)), expert.group(3)
            if part == "down":
                return f"{prefix}.w_down", index
            rows = slice(0, inter) if part == "gate" else slice(inter, 2 * inter)
            return f"{prefix}.w_gate_up", (index, rows)
        stacked = re.fullmatch(r"(model\.layers\.\d+\.mlp)\.experts\.(gate_up|down)_proj", name)
        if stacked:  # transformers' in-memory layout: experts stacked already
            return f"{stacked.group(1)}.w_{stacked.group(2)}", None
        dense = re.fullmatch(r"(model\.layers\.\d+\.mlp(?:\.shared_experts)?)\.(gate|up)_proj\.weight", name)
        if dense:
            size = self._dense_intermediate(dense.group(1))
            rows = slice(0, size) if dense.group(2) == "gate" else slice(size, 2 * size)
            return f"{dense.group(1)}.gate_up_proj.weight", rows
        return name, None

    def _dense_intermediate(self, prefix: str) -> int:
        module = self.get_submodule(prefix)
        assert isinstance(module, GatedMLP)
        return module.down_proj.in_features
