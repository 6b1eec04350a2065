"""Decode attention over the paged KV cache: GQA and MLA (absorbed) kernels, with an optional split-K pass.

Both kernels walk a sequence's block table BLOCK_N tokens at a time (a step may span several cache blocks, so any
block size works), keep an online softmax in fp32 (scores in base-2 units: exp2 is the cheap instruction), and
compute scores and the weighted sum with tl.dot over a tile of query heads that share the loaded K/V rows.

With few sequences and long contexts the (sequence, head group) grid cannot fill the GPU, so the context is cut
into partitions (flash-decoding): each program writes its unnormalised accumulator with its running max and sum,
and `_split_reduce_kernel` combines the partitions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from devices.cuda.configs import LaunchConfig

_LOG2_E = 1.4426950408889634


@dataclass(frozen=True)
class SplitPlan:
    """How one attention call cuts the context: partition p covers positions [p * tokens, (p + 1) * tokens)."""

    num_splits: int
    tokens_per_split: int  # a multiple of the kernel's BLOCK_N


def plan_splits(num_programs: int, max_context_len: int, num_sms: int, cfg: LaunchConfig) -> SplitPlan:
    """Split only when the unsplit grid leaves SMs idle and each partition still gets `cfg.split_tokens` tokens."""
    whole = SplitPlan(1, triton.cdiv(max(max_context_len, 1), cfg.block_n) * cfg.block_n)
    if cfg.max_splits <= 1 or cfg.split_tokens <= 0 or num_programs >= num_sms:
        return whole
    # aim at two programs per SM so one's loads overlap the other's math
    wanted = min(triton.cdiv(2 * num_sms, num_programs), max_context_len // cfg.split_tokens, cfg.max_splits)
    if wanted <= 1:
        return whole
    tokens = triton.cdiv(triton.cdiv(max_context_len, wanted), cfg.block_n) * cfg.block_n
    return SplitPlan(triton.cdiv(max_context_len, tokens), tokens)


def _dot_precision(dtype: torch.dtype) -> str:
    # tl.dot rounds fp32 inputs to tf32 by default; fp32 callers asked for fp32 results
    return "ieee" if dtype == torch.float32 else "tf32"


# -- shared pieces ---------------------------------------------------------------------------------------------


@triton.jit
def _softmax_step(scores, m_i, l_i):
    """One online-softmax update. scores (G, N) in base-2 units; returns probabilities and the new state."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))  # (G,)
    alpha = tl.exp2(m_i - m_new)  # rescales what was summed under the old max (0 on the first step)
    p = tl.exp2(scores - m_new[:, None])  # (G, N)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _token_slots(tables_ptr, stride_tb, seq, positions, valid, block_size):
    """Where context `positions` (N,) of sequence `seq` sit: their cache block (from the table) and row in it."""
    block_ids = tl.load(tables_ptr + seq * stride_tb + positions // block_size, mask=valid, other=0)
    return block_ids.to(tl.int64), positions % block_size  # (N,), (N,)


@triton.jit
def _split_range(lens_ptr, seq, tokens_per_split):
    """This program's context positions [lo, hi): its partition, cut at the sequence's length."""
    lo = tl.program_id(2) * tokens_per_split
    hi = tl.minimum(lo + tokens_per_split, tl.load(lens_ptr + seq))
    return lo, hi


@triton.jit
def _store_result(acc, m_i, l_i, seq, heads, head_mask, cols, col_mask, num_heads,
                  out_ptr, stride_ob, stride_oh, part_acc_ptr, part_ml_ptr,
                  BLOCK_COLS: tl.constexpr, IS_SPLIT: tl.constexpr):  # fmt: skip
    """Write the normalised output, or under split-K this partition's accumulator, max and sum."""
    mask = head_mask[:, None] & col_mask[None, :]
    if IS_SPLIT:
        rows = (seq * num_heads + heads) * tl.num_programs(2) + tl.program_id(2)  # (G,) into (B, H, splits)
        tl.store(part_acc_ptr + rows[:, None] * BLOCK_COLS + cols[None, :], acc, mask=mask)
        tl.store(part_ml_ptr + rows * 2, m_i, mask=head_mask)
        tl.store(part_ml_ptr + rows * 2 + 1, l_i, mask=head_mask)
    else:
        ptrs = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + cols[None, :]
        tl.store(ptrs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _split_reduce_kernel(part_acc_ptr, part_ml_ptr, out_ptr, stride_ob, stride_oh, num_heads, num_splits, num_cols,
                         BLOCK_SPLITS: tl.constexpr, BLOCK_COLS: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """Combine the partitions of one (sequence, head): weights 2^(m_p - max m) rescale each partial sum."""
    row = tl.program_id(0)  # sequence * num_heads + head
    splits = tl.arange(0, BLOCK_SPLITS)
    split_mask = splits < num_splits
    ml_ptrs = part_ml_ptr + (row * num_splits + splits) * 2
    maxes = tl.load(ml_ptrs, mask=split_mask, other=float("-inf"))  # (SPLITS,)
    sums = tl.load(ml_ptrs + 1, mask=split_mask, other=0.0)
    # empty partitions (past the sequence's end) hold max = -inf and weigh 0
    weights = tl.exp2(maxes - tl.max(maxes, axis=0))
    denom = tl.sum(weights * sums, axis=0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < num_cols
    acc_ptrs = part_acc_ptr + (row * num_splits + splits)[:, None] * BLOCK_COLS + cols[None, :]
    acc = tl.load(acc_ptrs, mask=split_mask[:, None] & col_mask[None, :], other=0.0)  # (SPLITS, N)
    out = tl.sum(acc * weights[:, None], axis=0) / denom  # (N,)
    seq, head = row // num_heads, row % num_heads
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + cols, out.to(out_ptr.dtype.element_ty), mask=col_mask)


# -- GQA -------------------------------------------------------------------------------------------------------


@triton.jit
def _gqa_decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, part_acc_ptr, part_ml_ptr, qk_scale,
                       stride_qb, stride_qh, stride_kn, stride_ks, stride_kk, stride_vn, stride_vs, stride_vk,
                       stride_tb, stride_ob, stride_oh, block_size, group_size, num_heads, head_dim, v_dim,
                       tokens_per_split, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                       BLOCK_N: tl.constexpr, IS_SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr):  # fmt: skip
    """One program: sequence program_id(0), KV head program_id(1), partition program_id(2); all its query heads."""
    seq, kv_head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    group = tl.arange(0, BLOCK_G)
    heads = kv_head * group_size + group
    head_mask = group < group_size
    dims, dims_v = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    dim_mask, dim_v_mask = dims < head_dim, dims_v < v_dim
    q_ptrs = q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptrs, mask=head_mask[:, None] & dim_mask[None, :], other=0.0)  # (G, D)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    lo, hi = _split_range(lens_ptr, seq, tokens_per_split)
    for start in range(lo, hi, BLOCK_N):
        positions = start + tl.arange(0, BLOCK_N)
        valid = positions < hi
        blocks, rows = _token_slots(tables_ptr, stride_tb, seq, positions, valid, block_size)
        k_ptrs = k_ptr + (blocks * stride_kn + rows * stride_ks + kv_head * stride_kk)[:, None] + dims[None, :]
        k = tl.load(k_ptrs, mask=valid[:, None] & dim_mask[None, :], other=0.0)  # (N, D)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (G, N)
        scores = tl.where(valid[None, :], scores, float("-inf"))
        p, alpha, m_i, l_i = _softmax_step(scores, m_i, l_i)
        v_ptrs = v_ptr + (blocks * stride_vn + rows * stride_vs + kv_head * stride_vk)[:, None] + dims_v[None, :]
        v = tl.load(v_ptrs, mask=valid[:, None] & dim_v_mask[None, :], other=0.0)  # (N, Dv)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)  # (G, Dv)

    _store_result(acc, m_i, l_i, seq, heads, head_mask, dims_v, dim_v_mask, num_heads, out_ptr, stride_ob, stride_oh,
                  part_acc_ptr, part_ml_ptr, BLOCK_DV, IS_SPLIT)  # fmt: skip


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, block_size: int, scale: float, plan: SplitPlan,
                 cfg: LaunchConfig, reduce_cfg: LaunchConfig) -> torch.Tensor:  # fmt: skip
    """q (B, H, D); k_cache (N, S, K, D), v_cache (N, S, K, Dv) -> (B, H, Dv), split as `plan` says."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, v_dim = k_cache.shape[2], v_cache.shape[3]
    group_size = num_heads // num_kv_heads
    out = torch.empty((num_seqs, num_heads, v_dim), dtype=q.dtype, device=q.device)  # (B, H, Dv)
    if num_seqs == 0:
        return out
    block_dv = max(16, triton.next_power_of_2(v_dim))
    part_acc, part_ml = _partials(num_seqs, num_heads, plan.num_splits, block_dv, q.device)
    grid = (num_seqs, num_kv_heads, plan.num_splits)
    _gqa_decode_kernel[grid](
        q, k_cache, v_cache, block_tables, context_lens, out, part_acc, part_ml, scale * _LOG2_E,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_tables.stride(0), out.stride(0), out.stride(1), block_size, group_size, num_heads, head_dim, v_dim,
        plan.tokens_per_split, BLOCK_G=max(16, triton.next_power_of_2(group_size)),
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_DV=block_dv, BLOCK_N=cfg.block_n,
        IS_SPLIT=plan.num_splits > 1, DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return _reduce(part_acc, part_ml, out, plan, block_dv, reduce_cfg)


# -- MLA -------------------------------------------------------------------------------------------------------


@triton.jit
def _mla_decode_kernel(ql_ptr, qr_ptr, kv_ptr, tables_ptr, lens_ptr, out_ptr, part_acc_ptr, part_ml_ptr, qk_scale,
                       stride_qlb, stride_qlh, stride_qrb, stride_qrh, stride_kvn, stride_kvs, stride_tb,
                       stride_ob, stride_oh, block_size, num_heads, rank, rope_dim, tokens_per_split,
                       BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
                       BLOCK_N: tl.constexpr, IS_SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr):  # fmt: skip
    """One program: sequence program_id(0), BLOCK_H heads program_id(1), partition program_id(2)."""
    seq = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < num_heads
    r, p_dims = tl.arange(0, BLOCK_R), tl.arange(0, BLOCK_P)
    r_mask, p_mask = r < rank, p_dims < rope_dim
    ql_ptrs = ql_ptr + seq * stride_qlb + heads[:, None] * stride_qlh + r[None, :]
    q_latent = tl.load(ql_ptrs, mask=head_mask[:, None] & r_mask[None, :], other=0.0)  # (H, R)
    qr_ptrs = qr_ptr + seq * stride_qrb + heads[:, None] * stride_qrh + p_dims[None, :]
    q_rope = tl.load(qr_ptrs, mask=head_mask[:, None] & p_mask[None, :], other=0.0)  # (H, P)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    lo, hi = _split_range(lens_ptr, seq, tokens_per_split)
    for start in range(lo, hi, BLOCK_N):
        positions = start + tl.arange(0, BLOCK_N)
        valid = positions < hi
        blocks, rows = _token_slots(tables_ptr, stride_tb, seq, positions, valid, block_size)
        rows = blocks * stride_kvn + rows * stride_kvs  # (N,)
        latent = tl.load(kv_ptr + rows[:, None] + r[None, :], mask=valid[:, None] & r_mask[None, :], other=0.0)
        rope_ptrs = kv_ptr + rows[:, None] + rank + p_dims[None, :]
        rope = tl.load(rope_ptrs, mask=valid[:, None] & p_mask[None, :], other=0.0)  # (N, P)
        scores = tl.dot(q_latent, tl.trans(latent), input_precision=DOT_PRECISION)  # (H, N)
        scores = tl.dot(q_rope, tl.trans(rope), acc=scores, input_precision=DOT_PRECISION) * qk_scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        p, alpha, m_i, l_i = _softmax_step(scores, m_i, l_i)
        acc = acc * alpha[:, None] + tl.dot(p.to(latent.dtype), latent, input_precision=DOT_PRECISION)  # (H, R)

    _store_result(acc, m_i, l_i, seq, heads, head_mask, r, r_mask, num_heads, out_ptr, stride_ob, stride_oh,
                  part_acc_ptr, part_ml_ptr, BLOCK_R, IS_SPLIT)  # fmt: skip


def mla_decode(q_latent: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
               context_lens: torch.Tensor, block_size: int, scale: float, plan: SplitPlan,
               cfg: LaunchConfig, reduce_cfg: LaunchConfig) -> torch.Tensor:  # fmt: skip
    """q_latent (B, H, R), q_rope (B, H, P), kv_cache (N, S, R+P) -> (B, H, R), split as `plan` says."""
    num_seqs, num_heads, rank = q_latent.shape
    rope_dim = q_rope.shape[2]
    out = torch.empty((num_seqs, num_heads, rank), dtype=q_latent.dtype, device=q_latent.device)  # (B, H, R)
    if num_seqs == 0:
        return out
    block_r = max(16, triton.next_power_of_2(rank))
    part_acc, part_ml = _partials(num_seqs, num_heads, plan.num_splits, block_r, q_latent.device)
    grid = (num_seqs, triton.cdiv(num_heads, cfg.block_m), plan.num_splits)
    _mla_decode_kernel[grid](
        q_latent, q_rope, kv_cache, block_tables, context_lens, out, part_acc, part_ml, scale * _LOG2_E,
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1), kv_cache.stride(0),
        kv_cache.stride(1), block_tables.stride(0), out.stride(0), out.stride(1), block_size, num_heads, rank,
        rope_dim, plan.tokens_per_split, BLOCK_H=cfg.block_m, BLOCK_R=block_r,
        BLOCK_P=max(16, triton.next_power_of_2(rope_dim)), BLOCK_N=cfg.block_n, IS_SPLIT=plan.num_splits > 1,
        DOT_PRECISION=_dot_precision(q_latent.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return _reduce(part_acc, part_ml, out, plan, block_r, reduce_cfg)


# -- split-K buffers and combine -------------------------------------------------------------------------------


def _partials(num_seqs: int, num_heads: int, num_splits: int, width: int, device: torch.device) -> tuple[
        torch.Tensor, torch.Tensor]:  # fmt: skip
    """Per-partition accumulators (B, H, splits, width) and (max, sum) pairs (B, H, splits, 2); empty unsplit."""
    if num_splits == 1:
        empty = torch.empty(0, dtype=torch.float32, device=device)
        return empty, empty
    acc = torch.empty((num_seqs, num_heads, num_splits, width), dtype=torch.float32, device=device)
    ml = torch.empty((num_seqs, num_heads, num_splits, 2), dtype=torch.float32, device=device)
    return acc, ml


def _reduce(part_acc: torch.Tensor, part_ml: torch.Tensor, out: torch.Tensor, plan: SplitPlan, width: int,
            cfg: LaunchConfig) -> torch.Tensor:  # fmt: skip
    """Fold the partitions into `out` (B, H, C); a no-op when the call was not split."""
    if plan.num_splits == 1:
        return out
    num_seqs, num_heads, num_cols = out.shape
    block_n = min(cfg.block_n, width)
    grid = (num_seqs * num_heads, triton.cdiv(num_cols, block_n))
    _split_reduce_kernel[grid](
        part_acc, part_ml, out, out.stride(0), out.stride(1), num_heads, plan.num_splits, num_cols,
        BLOCK_SPLITS=triton.next_power_of_2(plan.num_splits), BLOCK_COLS=width, BLOCK_N=block_n,
        num_warps=cfg.num_warps,
    )  # fmt: skip
    return out
