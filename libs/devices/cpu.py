"""The reference device module: plain torch ops. Runs everywhere; every other module is checked against it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from devices.base import DecodeBatch, DeviceOps
from devices.cpu_kernels import PagedChunk, PagedDecode, chunk_kernel_pays, paged_chunk_kernel, paged_decode_kernel

# What one more segment costs, in context tokens of attention work: a segment's fixed price (an SDPA call, its
# views, its share of the output copy) against the padding it saves. From a 1-thread timing of one layer's decode
# attention at batch 32 (SmolLM2-135M's shapes, contexts of 32 to 296 tokens): 64, 256 and 1024 made 6, 3 and 2
# segments and timed alike within the machine's noise, all well under one padded segment; 256 is the middle.
SEGMENT_OVERHEAD_TOKENS = 256

# A chunk of at most this many queries over a context of at least this many tokens attends by grouped GEMMs
# (`chunk_attention`), the rest by SDPA. One layer of SmolLM2-135M's shapes at 1 thread (bench/prefill_attention.py,
# CPU time): the GEMMs take 0.74-0.89x SDPA's time at contexts up to 2,048, 1.1-1.6x less at 4,096 for 1-16
# queries and 1.15-1.7x less at 8,192, and lose again from 32 queries on (docs/engine.md).
CHUNK_GEMM_MAX_QUERIES = 16
CHUNK_GEMM_MIN_CONTEXT = 4096
# With the C++ kernels on (`use_decode_kernel`), a chunk over a cached context whose query rows a KV head (chunk
# tokens x query heads per KV head) are at most this many is attended in place by `paged_chunk` at any context
# length: no gather. SmolLM2-135M's shapes (up to 42 tokens), 2 threads, 30 layers: 1.5-6x faster than the gather
# with SDPA or GEMMs from 64 to 7,900 cached tokens (docs/engine.md).
CHUNK_KERNEL_MAX_ROWS = 128


@dataclass(frozen=True)
class DecodeSegment:
    """Rows [start, end) of a decode batch, attended in one call over `num_blocks` blocks each: the most any of
    its rows needs, so a row reads at most the blocks its segment's longest row needs, not the batch's."""

    start: int
    end: int
    num_blocks: int
    offset: int  # where the segment's blocks start in the step's gathered blocks
    num_positions: int  # positions each row attends: num_blocks * S, or its rows' one context length
    valid: torch.Tensor | None  # (n, num_positions) bool: position < context length; None: every position is
    # valid as SDPA's additive mask, (n, 1, 1, num_positions) float32: 0 or -inf (what SDPA would build from the
    # boolean mask in every layer, built once a step)
    bias: torch.Tensor | None


@dataclass(frozen=True)
class _CpuDecodePlan:
    """What every layer's decode attention shares in one step: which blocks to gather, and the segments.

    Each segment's rows' block tables, cut (or padded with block 0) to the segment's `num_blocks`, are
    concatenated into one gather list, so a layer gathers the step's blocks in one copy per cache and each
    segment attends over a contiguous view of them.
    """

    segments: tuple[DecodeSegment, ...]
    block_ids: torch.Tensor  # (G,) int64: G = sum over segments of rows x num_blocks


def _kernel_takes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the C++ decode kernel reads these as they are: float32 on the cpu, caches contiguous (the engine's
    layer views are; a copy of a whole cache per layer would cost more than the gather it saves)."""
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in (q, k_cache, v_cache)) and (
        k_cache.is_contiguous() and v_cache.is_contiguous()
    )


def _int32_tables(batch: DecodeBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's block tables and context lengths as the C++ kernel takes them (int32)."""
    return batch.block_tables.to(torch.int32), batch.context_lens.to(torch.int32)  # no copy when already int32


def plan_segments(num_blocks: list[int], overhead_blocks: float) -> list[tuple[int, int, int]]:
    """Split rows into contiguous segments (start, end, most blocks) minimising the blocks attended plus
    `overhead_blocks` per segment. Rows sorted by length (the model runner sorts decodes longest first) make the
    segments length buckets; any order is correct, only less saving.

    Dynamic programming over runs of rows with equal block counts: O(runs^2), a few dozen runs at most in
    practice (runs <= distinct block counts when sorted).
    """
    runs: list[tuple[int, int]] = []  # (first row, block count) of each run of equal counts
    for row, count in enumerate(num_blocks):
        if not runs or runs[-1][1] != count:
            runs.append((row, count))
    bounds = [start for start, _ in runs] + [len(num_blocks)]
    best = [0.0] + [float("inf")] * len(runs)  # best[j]: cost of rows before run j
    cut = [0] * (len(runs) + 1)
    for j in range(1, len(runs) + 1):
        most = 0
        for i in range(j - 1, -1, -1):  # segment = runs i .. j-1
            most = max(most, runs[i][1])
            cost = best[i] + (bounds[j] - bounds[i]) * most + overhead_blocks
            if cost < best[j]:
                best[j], cut[j] = cost, i
    segments, j = [], len(runs)
    while j:
        i = cut[j]
        segments.append((bounds[i], bounds[j], max(count for _, count in runs[i:j])))
        j = i
    return segments[::-1]


def sdpa_prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_cached: int, scale: float
) -> torch.Tensor:
    """`DeviceOps.prefill_attention` by torch's SDPA: q (Lq, H, D), k (L, K, D), v (L, K, Dv) -> (Lq, H, Dv)."""
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


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_cached: int, scale: float) -> torch.Tensor:
    """Attention of a few new queries over a long context (a chunk of a long prompt) as two GEMMs per KV head.

    q (Lq, H, D) at positions num_cached .. num_cached+Lq-1; k (L, K, D), v (L, K, Dv) with L = num_cached + Lq.
    Query head h reads KV head h // (H / K), as SDPA's `enable_gqa`: the G = H / K query heads of a KV head and all
    Lq queries form one (Lq * G, D) operand, so each KV head's keys and values are read once for the whole chunk
    (SDPA reads them once per query head, in tiles too small for 8 queries). One KV head at a time keeps its
    (Lq * G, L) scores in the core's cache between the two GEMMs. Only the last Lq columns can be masked (every
    cached position is visible to every query): no (Lq, L) mask is built. Returns (Lq, H, Dv).
    """
    num_new, num_heads, head_dim = q.shape
    num_total, num_kv_heads = k.shape[0], k.shape[1]
    group = num_heads // num_kv_heads
    queries = (q * scale).view(num_new, num_kv_heads, group, head_dim)  # (Lq, K, G, D)
    future = torch.ones(num_new, num_new, dtype=torch.bool, device=q.device).triu_(1)  # (Lq, Lq): key after query
    out = q.new_empty(num_new, num_kv_heads, group, v.shape[2])  # (Lq, K, G, Dv)
    for head in range(num_kv_heads):
        scores = queries[:, head].reshape(num_new * group, head_dim) @ k[:, head].T  # (Lq * G, L)
        scores.view(num_new, group, num_total)[..., num_cached:].masked_fill_(future[:, None, :], -torch.inf)
        probs = torch.softmax(scores, dim=-1)  # every row sees key 0: none is all -inf
        out[:, head] = (probs @ v[:, head]).view(num_new, group, -1)
    return out.view(num_new, num_heads, -1)


class CpuOps(DeviceOps):
    name = "cpu"
    segment_overhead_tokens: float = SEGMENT_OVERHEAD_TOKENS  # decode attention's price of one more segment

    def __init__(self, torch_device: torch.device | None = None) -> None:
        super().__init__(torch_device or torch.device("cpu"))
        # gather buffers of decode attention, by role; written only by the thread that runs the model
        self._workspaces: dict[str, torch.Tensor] = {}
        # use_decode_kernel(): decode attention and short chunks' attention over the paged cache in place
        self.decode_kernel: PagedDecode | None = None
        self.chunk_kernel: PagedChunk | None = None

    def use_decode_kernel(self) -> bool:
        """Run float32 decode attention, and a short chunk's attention over a cached context where
        `chunk_kernel_pays`, by the C++ kernels that read the paged cache in place (devices.cpu_kernels) instead of
        gathering each layer's blocks for SDPA or GEMMs; False (and the gathers stay) where they cannot be built."""
        self.decode_kernel = paged_decode_kernel()
        self.chunk_kernel = paged_chunk_kernel() if chunk_kernel_pays() else None  # slower than the gather on AVX2
        return self.decode_kernel is not None

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
        lens = context_lens.tolist()
        num_blocks = [-(-n // block_size) for n in lens]
        pieces, segments, offset = [], [], 0
        for start, end, most in plan_segments(num_blocks, self.segment_overhead_tokens / block_size):
            pieces.append(block_tables[start:end, :most].flatten())
            num_positions, valid, bias = most * block_size, None, None
            shortest, longest = min(lens[start:end]), max(lens[start:end])
            if shortest == longest:  # rows of one length (a row alone): read that many positions, no mask
                num_positions = longest
            else:
                positions = torch.arange(num_positions, device=context_lens.device)
                valid = positions[None, :] < context_lens[start:end, None]  # (n, most * S)
                bias = torch.zeros(valid.shape, device=valid.device).masked_fill_(~valid, float("-inf"))
                bias = bias[:, None, None, :]
            segments.append(DecodeSegment(start, end, most, offset, num_positions, valid, bias))
            offset += (end - start) * most
        plan = _CpuDecodePlan(tuple(segments), torch.cat(pieces).long())
        return DecodeBatch(block_tables, context_lens, block_size, plan)

    def paged_decode_attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: DecodeBatch, scale: float
    ) -> torch.Tensor:
        if self.decode_kernel is not None and _kernel_takes(q, k_cache, v_cache):
            return self.decode_kernel(q.contiguous(), k_cache, v_cache, *_int32_tables(batch), scale)
        plan: _CpuDecodePlan = batch.extra
        keys = self._gather("k", k_cache, plan.block_ids)  # (G, S, K, D)
        values = self._gather("v", v_cache, plan.block_ids)  # (G, S, K, Dv)
        outs = []
        for seg in plan.segments:
            num_rows, num_gathered = seg.end - seg.start, seg.num_blocks * batch.block_size
            blocks = slice(seg.offset, seg.offset + num_rows * seg.num_blocks)
            k = keys[blocks].view(num_rows, num_gathered, *k_cache.shape[2:])[:, : seg.num_positions]  # (n, L, K, D)
            v = values[blocks].view(num_rows, num_gathered, *v_cache.shape[2:])[:, : seg.num_positions]
            bias = seg.bias
            if bias is not None and bias.dtype != q.dtype:
                bias = bias.to(q.dtype)
            out = F.scaled_dot_product_attention(
                q[seg.start : seg.end].unsqueeze(2),  # (n, H, 1, D)
                k.transpose(1, 2),  # (n, K, L, D)
                v.transpose(1, 2),
                attn_mask=bias,  # (n, 1, 1, L)
                scale=scale,
                enable_gqa=True,
            )
            outs.append(out.squeeze(2))  # (n, H, Dv)
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def mla_decode_attention(
        self, q_latent: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor, batch: DecodeBatch, scale: float
    ) -> torch.Tensor:
        rank = q_latent.shape[-1]
        q = torch.cat([q_latent, q_rope], dim=-1).float()  # (B, H, R+P)
        if self.decode_kernel is not None and _kernel_takes(q, kv_cache, kv_cache):
            entries = kv_cache.unsqueeze(2)  # (N, S, 1, R+P): one "KV head" that every query head reads
            # the value: a position's latent vector, without its rope part (its first `rank` floats)
            return self.decode_kernel(q, entries, entries, *_int32_tables(batch), scale, rank)
        plan: _CpuDecodePlan = batch.extra
        gathered = self._gather("latent", kv_cache, plan.block_ids)  # (G, S, R+P)
        outs = []
        for seg in plan.segments:
            num_rows = seg.end - seg.start
            blocks = slice(seg.offset, seg.offset + num_rows * seg.num_blocks)
            entries = gathered[blocks].view(num_rows, seg.num_blocks * batch.block_size, -1)[:, : seg.num_positions]
            scores = torch.bmm(q[seg.start : seg.end], entries.float().transpose(1, 2)) * scale  # (n, H, L)
            if seg.valid is not None:
                scores = scores.masked_fill(~seg.valid[:, None, :], float("-inf"))
            probs = scores.softmax(dim=-1).to(q_latent.dtype)
            outs.append(torch.bmm(probs, entries[..., :rank]))  # (n, H, R)
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _gather(self, role: str, cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """cache (N, S, *F) -> its blocks `block_ids`, (G, S, *F), copied into a buffer this object keeps for
        `role` and reuses every layer and step. A fresh tensor each call costs more than the copy: glibc hands
        large freed blocks back to the OS, so every call would fault its pages in again."""
        needed = block_ids.numel() * cache[0].numel()
        buffer = self._workspaces.get(role)
        if buffer is None or buffer.numel() < needed or buffer.dtype != cache.dtype or buffer.device != cache.device:
            buffer = torch.empty(needed, dtype=cache.dtype, device=cache.device)
            self._workspaces[role] = buffer
        out = buffer[:needed].view(block_ids.numel(), *cache.shape[1:])
        return torch.index_select(cache, 0, block_ids, out=out)

    def gather_cache(
        self, cache: torch.Tensor, block_ids: torch.Tensor, num_tokens: int, role: str | None = None
    ) -> torch.Tensor:
        gathered = cache[block_ids] if role is None else self._gather(role, cache, block_ids)  # (m, S, *F)
        return gathered.flatten(0, 1)[:num_tokens]  # (num_tokens, *F)

    def cached_prefill_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_ids: torch.Tensor,
        num_cached: int,
        scale: float,
    ) -> torch.Tensor:
        num_new, num_heads, num_kv_heads = q.shape[0], q.shape[1], k_cache.shape[2]
        if (
            self.chunk_kernel is not None
            and num_heads % num_kv_heads == 0
            and num_new * (num_heads // num_kv_heads) <= CHUNK_KERNEL_MAX_ROWS
            and v_cache.shape[3] in (16, 32, 64, 128)  # the kernel's value widths
            and _kernel_takes(q, k_cache, v_cache)
        ):
            return self.chunk_kernel(q.contiguous(), k_cache, v_cache, block_ids.to(torch.int32), num_cached, scale)
        return super().cached_prefill_attention(q, k_cache, v_cache, block_ids, num_cached, scale)

    def prefill_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_cached: int, scale: float
    ) -> torch.Tensor:
        # on the CPU only: the cuda and ascend modules inherit this method, and SDPA's kernels there are fused
        is_chunk = q.shape[0] <= CHUNK_GEMM_MAX_QUERIES and k.shape[0] >= CHUNK_GEMM_MIN_CONTEXT
        is_grouped = q.shape[1] > k.shape[1] and q.shape[1] % k.shape[1] == 0  # GQA: MLA's expanded heads are not
        if q.device.type == "cpu" and is_chunk and is_grouped:
            return chunk_attention(q, k, v, num_cached, scale)
        return sdpa_prefill_attention(q, k, v, num_cached, scale)

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
