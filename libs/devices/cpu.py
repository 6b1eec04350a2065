"""The reference device module: plain torch ops. Runs everywhere; every other module is checked against it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from devices.base import DecodeBatch, DeviceOps


@dataclass(frozen=True)
class _CpuDecodeIndex:
    """Gather indices shared by every layer's decode attention in one step.

    Whole blocks are gathered (index_select of contiguous S-token slabs), not single tokens: on a CPU that
    is about twice as fast, and attention over the padding positions is masked out.
    """

    block_ids: torch.Tensor  # (B * M,) int64: every sequence's block table, flattened
    valid: torch.Tensor  # (B, M * S) bool: position < context length


class CpuOps(DeviceOps):
    name = "cpu"

    def __init__(self, torch_device: torch.device | None = None) -> None:
        super().__init__(torch_device or torch.device("cpu"))

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype == torch.float32 and weight.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), weight, eps)  # fused; the same values as below
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(x.dtype)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)

    def prepare_decode(self, block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int) -> DecodeBatch:
        num_positions = block_tables.shape[1] * block_size
        positions = torch.arange(num_positions, device=block_tables.device)  # (M * S,)
        valid = positions[None, :] < context_lens[:, None]  # (B, M * S)
        index = _CpuDecodeIndex(block_tables.flatten().long(), valid)
        return DecodeBatch(block_tables, context_lens, block_size, index)

    def paged_decode_attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: DecodeBatch, scale: float
    ) -> torch.Tensor:
        index: _CpuDecodeIndex = batch.extra
        num_seqs, num_positions = index.valid.shape
        k = k_cache.index_select(0, index.block_ids).view(num_seqs, num_positions, *k_cache.shape[2:])  # (B, L, K, D)
        v = v_cache.index_select(0, index.block_ids).view(num_seqs, num_positions, *v_cache.shape[2:])  # (B, L, K, Dv)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # (B, H, 1, D)
            k.transpose(1, 2),  # (B, K, L, D)
            v.transpose(1, 2),
            attn_mask=index.valid[:, None, None, :],  # (B, 1, 1, L)
            scale=scale,
            enable_gqa=True,
        )
        return out.squeeze(2)  # (B, H, Dv)

    def mla_decode_attention(
        self, q_latent: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor, batch: DecodeBatch, scale: float
    ) -> torch.Tensor:
        index: _CpuDecodeIndex = batch.extra
        num_seqs, num_positions = index.valid.shape
        rank = q_latent.shape[-1]
        entries = kv_cache.index_select(0, index.block_ids).view(num_seqs, num_positions, -1)  # (B, L, R+P)
        q = torch.cat([q_latent, q_rope], dim=-1)  # (B, H, R+P)
        scores = torch.bmm(q.float(), entries.float().transpose(1, 2)) * scale  # (B, H, L)
        scores = scores.masked_fill(~index.valid[:, None, :], float("-inf"))
        probs = scores.softmax(dim=-1).to(q_latent.dtype)
        return torch.bmm(probs, entries[..., :rank])  # (B, H, R)

    def gather_cache(self, cache: torch.Tensor, block_ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
        return cache[block_ids].flatten(0, 1)[:num_tokens]  # (m, S, *F) -> (num_tokens, *F)

    def prefill_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_cached: int, scale: float
    ) -> torch.Tensor:
        num_new, num_total = q.shape[0], k.shape[0]
        mask = None
        if num_cached > 0:
            # query i sits at position num_cached + i and sees keys 0 .. num_cached + i
            rows = torch.arange(num_new, device=q.device)[:, None] + num_cached
            mask = torch.arange(num_total, device=q.device)[None, :] <= rows  # (Lq, L)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),  # (1, H, Lq, D)
            k.transpose(0, 1).unsqueeze(0),  # (1, K, L, D)
            v.transpose(0, 1).unsqueeze(0),  # (1, K, L, Dv)
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )
        return out.squeeze(0).transpose(0, 1)  # (Lq, H, Dv)

    def moe_experts(
        self,
        x: torch.Tensor,
        w_gate_up: torch.Tensor,
        w_down: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
    ) -> torch.Tensor:
        top_k = topk_ids.shape[1]
        flat_ids = topk_ids.flatten()  # (T*k,)
        order = torch.argsort(flat_ids, stable=True)  # pairs grouped by expert
        counts = torch.bincount(flat_ids, minlength=w_gate_up.shape[0]).tolist()
        flat_weights = topk_weights.flatten()
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            pairs = order[start : start + count]
            start += count
            tokens = pairs // top_k
            hidden = self.silu_and_mul(x[tokens] @ w_gate_up[expert].T) @ w_down[expert].T  # (c, Hd)
            out.index_add_(0, tokens, (hidden * flat_weights[pairs, None]).float())
        return out.to(x.dtype)
