"""Fused MoE: the routed experts as two grouped GEMMs over (token, slot) pairs sorted by expert.

1. `align_pairs` sorts the T*k (token, slot) pairs by expert and pads each expert's run to a multiple of
   BLOCK_M, so every M-block of the sorted order belongs to one expert (torch ops on the device, no host sync).
2. `_gate_up_kernel`: per M-block, x[tokens] @ w_gate_up[e].T for the gate and the up half at once, and
   silu(gate) * up in the epilogue, written per pair: h (T*k, I).
3. `_down_kernel`: h @ w_down[e].T times the pair's routing weight, written per pair in fp32: (T, k, Hd).
4. The k slots of each token are summed (a fixed order, so results do not depend on scheduling).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from devices.cuda.configs import LaunchConfig

# the (T, k, Hd) fp32 buffer of step 3 stays under this size; larger batches run in token chunks. Every chunk
# reads all used experts' weights again, so chunks stay large (about 4.7K tokens at DeepSeek-V3's k=8, Hd=7168)
_PAIR_BUFFER_BYTES = 1 << 30


@dataclass(frozen=True)
class PairLayout:
    """The pairs sorted by expert, padded per expert to whole M-blocks; written by `align_pairs`."""

    sorted_pairs: torch.Tensor  # (num_blocks * BLOCK_M,) int32: pair id (token * k + slot); num_pairs pads
    block_experts: torch.Tensor  # (num_blocks,) int32: the expert of each M-block; -1 past the last used block
    num_pairs: int


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> PairLayout:
    """Sort and pad the pairs of topk_ids (T, k). num_blocks is an upper bound, so no count leaves the device."""
    flat = topk_ids.reshape(-1).long()  # (T*k,)
    num_pairs = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)  # (E,)
    padded = (counts + block_m - 1) // block_m * block_m
    seg_end = padded.cumsum(0)  # (E,) end of each expert's padded run
    order = torch.argsort(flat, stable=True)  # (T*k,) pair ids grouped by expert
    experts = flat[order]
    rank = torch.arange(num_pairs, device=flat.device) - (counts.cumsum(0) - counts)[experts]  # place in its run
    # each used expert pads by at most block_m - 1 slots
    num_blocks = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)
    sorted_pairs = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_pairs[(seg_end - padded)[experts] + rank] = order.int()
    block_starts = torch.arange(num_blocks, device=flat.device) * block_m  # (num_blocks,)
    block_experts = torch.searchsorted(seg_end, block_starts, right=True)  # empty experts are stepped over
    block_experts = torch.where(block_experts < num_experts, block_experts, -1).int()
    return PairLayout(sorted_pairs, block_experts, num_pairs)


@triton.jit
def _block_rows(sorted_pairs_ptr, num_pairs, BLOCK_M: tl.constexpr):
    """The pair ids of this program's M-block (M,) and which of them are real (not padding)."""
    pairs = tl.load(sorted_pairs_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
    return pairs.to(tl.int64), pairs < num_pairs


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, h_ptr, sorted_pairs_ptr, block_experts_ptr, num_pairs, top_k, hidden, inter,
                    stride_xt, stride_we, stride_wn, stride_hp, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):  # fmt: skip
    """h[pairs, cols] = silu(x[tokens] @ gate.T) * (x[tokens] @ up.T) for one M-block and BLOCK_N columns of I."""
    expert = tl.load(block_experts_ptr + tl.program_id(0)).to(tl.int64)
    if expert < 0:  # a block past the end of the padded order (the grid is an upper bound)
        return
    pairs, row_mask = _block_rows(sorted_pairs_ptr, num_pairs, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < inter
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + (pairs // top_k)[:, None] * stride_xt + ks[None, :]  # (M, K)
    gate_ptrs = w_ptr + expert * stride_we + cols[None, :] * stride_wn + ks[:, None]  # (K, N) of w[e, cols, :].T
    up_ptrs = gate_ptrs + inter * stride_wn
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_mask = ks < hidden - k0
        a = tl.load(a_ptrs + k0, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & col_mask[None, :]
        gate = tl.dot(a, tl.load(gate_ptrs + k0, mask=w_mask, other=0.0), acc=gate, input_precision=DOT_PRECISION)
        up = tl.dot(a, tl.load(up_ptrs + k0, mask=w_mask, other=0.0), acc=up, input_precision=DOT_PRECISION)
    # round where the unfused reference rounds: the GEMM output, then silu, then the product
    dtype = h_ptr.dtype.element_ty
    gate = gate.to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    h = (act * up.to(dtype).to(tl.float32)).to(dtype)  # (M, N)
    tl.store(h_ptr + pairs[:, None] * stride_hp + cols[None, :], h, mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _down_kernel(h_ptr, w_ptr, out_ptr, routing_ptr, sorted_pairs_ptr, block_experts_ptr, num_pairs, hidden, inter,
                 stride_hp, stride_we, stride_wn, stride_op, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):  # fmt: skip
    """out[pairs, cols] = routing weight * (h[pairs] @ w_down[e, cols].T), in fp32, for one M-block."""
    expert = tl.load(block_experts_ptr + tl.program_id(0)).to(tl.int64)
    if expert < 0:
        return
    pairs, row_mask = _block_rows(sorted_pairs_ptr, num_pairs, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < hidden
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + pairs[:, None] * stride_hp + ks[None, :]  # (M, K)
    w_ptrs = w_ptr + expert * stride_we + cols[None, :] * stride_wn + ks[:, None]  # (K, N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_mask = ks < inter - k0
        a = tl.load(a_ptrs + k0, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs + k0, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc = tl.dot(a, w, acc=acc, input_precision=DOT_PRECISION)
    routing = tl.load(routing_ptr + pairs, mask=row_mask, other=0.0)  # (M,) fp32
    # the reference rounds the expert output to the activation dtype before weighting it in fp32
    out = acc.to(h_ptr.dtype.element_ty).to(tl.float32) * routing[:, None]
    tl.store(out_ptr + pairs[:, None] * stride_op + cols[None, :], out, mask=row_mask[:, None] & col_mask[None, :])


def moe_experts(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor, cfg: LaunchConfig) -> torch.Tensor:  # fmt: skip
    """x (T, Hd); w_gate_up (E, 2I, Hd); w_down (E, Hd, I); topk_ids, topk_weights (T, k) -> (T, Hd)."""
    num_tokens, top_k = topk_ids.shape
    hidden = x.shape[1]
    chunk = max(1, _PAIR_BUFFER_BYTES // (top_k * hidden * 4))
    if num_tokens <= chunk:
        return _moe_chunk(x, w_gate_up, w_down, topk_ids, topk_weights, cfg)
    parts = [
        _moe_chunk(x[i : i + chunk], w_gate_up, w_down, topk_ids[i : i + chunk], topk_weights[i : i + chunk], cfg)
        for i in range(0, num_tokens, chunk)
    ]
    return torch.cat(parts)  # (T, Hd)


def _moe_chunk(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_ids: torch.Tensor,
               topk_weights: torch.Tensor, cfg: LaunchConfig) -> torch.Tensor:  # fmt: skip
    num_tokens, top_k = topk_ids.shape
    num_experts, inter, hidden = w_down.shape[0], w_down.shape[2], x.shape[1]
    if num_tokens == 0:
        return torch.zeros_like(x)
    layout = align_pairs(topk_ids, num_experts, cfg.block_m)
    num_blocks = layout.block_experts.numel()
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    launch = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT_PRECISION=precision,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)  # fmt: skip

    h = torch.empty((layout.num_pairs, inter), dtype=x.dtype, device=x.device)  # (T*k, I)
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, cfg.block_n))](
        x, w_gate_up, h, layout.sorted_pairs, layout.block_experts, layout.num_pairs, top_k, hidden, inter,
        x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), h.stride(0), **launch,
    )  # fmt: skip
    per_pair = torch.empty((layout.num_pairs, hidden), dtype=torch.float32, device=x.device)  # (T*k, Hd)
    routing = topk_weights.reshape(-1).float().contiguous()  # (T*k,)
    _down_kernel[(num_blocks, triton.cdiv(hidden, cfg.block_n))](
        h, w_down, per_pair, routing, layout.sorted_pairs, layout.block_experts, layout.num_pairs, hidden, inter,
        h.stride(0), w_down.stride(0), w_down.stride(1), per_pair.stride(0), **launch,
    )  # fmt: skip
    return per_pair.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)  # (T, Hd)
