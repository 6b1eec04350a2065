"""Compressed attention's compressors (CSA and HCA layers) and CSA's lightning indexer.

A compressor turns every closed window of m tokens into one entry: a softmax-gated sum of the tokens' projected
vectors (gate logits plus a learned per-offset bias), RMS-normed, its tail rotated at the window's first position.
An entry exists only once its window closes, in prefill and in decode alike; the tokens of the open window wait
in the sequence's tail. CSA compressors overlap: each token projects two series, and entry w mixes window w-1's
first series with window w's second (2m slots, stride m), so a sequence also carries the last closed window's
first series. The indexer compresses its own narrower keys the same way and keeps, per query, the top-k entries
by its score sum_h w_h * relu(q_h . k).

Shapes: T tokens, Hd hidden, W the entry width, c series (2 for CSA, 1 for HCA), n windows closed this step,
Hi indexer heads, E entries.
"""

from __future__ import annotations

import torch
from torch import nn

from engine_core.models.deepseek_v4.functional import Fp32RMSNorm, rotate_tail
from engine_core.models.deepseek_v4.state import CompressorState
from engine_core.models.rope import RotaryEmbedding


class Compressor(nn.Module):
    def __init__(self, hidden_size: int, width: int, ratio: int, overlap: bool, eps: float) -> None:
        super().__init__()
        self.width, self.ratio = width, ratio
        self.num_series = 2 if overlap else 1
        self.wkv = nn.Linear(hidden_size, self.num_series * width, bias=False)
        self.wgate = nn.Linear(hidden_size, self.num_series * width, bias=False)
        self.ape = nn.Parameter(torch.empty(ratio, self.num_series * width, dtype=torch.float32))  # position bias
        self.norm = Fp32RMSNorm(width, eps)

    def empty_state(self, dtype: torch.dtype, device: torch.device) -> CompressorState:
        return CompressorState.empty(self.width, self.num_series, dtype, device)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, Hd) -> kv, gate logits (T, c * W), for every sequence of the batch at once."""
        return self.wkv(x), self.wgate(x)

    def extend(self, state: CompressorState, kv: torch.Tensor, gate: torch.Tensor, rope: RotaryEmbedding) -> None:
        """Append one sequence's new tokens (kv, gate (L, c * W)); emit an entry for every window they close."""
        m = self.ratio
        kv, gate = torch.cat([state.tail_kv, kv]), torch.cat([state.tail_gate.to(gate.dtype), gate])
        usable = kv.shape[0] // m * m
        state.tail_kv, state.tail_gate = kv[usable:].clone(), gate[usable:].clone()  # not views of the whole chunk
        if usable == 0:
            return
        n = usable // m
        chunk_kv = kv[:usable].view(n, m, -1)  # (n, m, c * W)
        chunk_gate = gate[:usable].view(n, m, -1) + self.ape  # fp32 from here
        if self.num_series == 2:
            chunk_kv, chunk_gate = self._overlap(state, chunk_kv, chunk_gate)
        weights = chunk_gate.softmax(dim=1, dtype=torch.float32).to(chunk_kv.dtype)
        entries = self.norm((chunk_kv * weights).sum(dim=1))  # (n, W)
        positions = torch.arange(n, device=kv.device) * m + state.num_entries * m  # each window's first token
        cos, sin = rope.cos_sin(positions)
        entries = rotate_tail(entries[:, None, :], cos, sin)[:, 0]
        state.entries = torch.cat([state.entries, entries])

    def resume(
        self, state: CompressorState, entries: torch.Tensor, overlap_kv: torch.Tensor, overlap_gate: torch.Tensor
    ) -> None:
        """Set an empty state to where a sequence stands at a window boundary: its entries (E, W) and, for CSA,
        the last closed window's first series (m, W) with its raw gate logits (the position bias is added here, in
        fp32, as `extend` adds it)."""
        state.entries = entries
        if self.num_series == 2:
            state.overlap_kv, state.overlap_gate = overlap_kv, overlap_gate + self.ape[:, : self.width]

    def _overlap(
        self, state: CompressorState, chunk_kv: torch.Tensor, chunk_gate: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(n, m, 2W) -> (n, 2m, W): window w's slots are window w-1's first series then its own second series;
        the first window of a sequence has no predecessor (zero values, -inf gates: weight 0)."""
        n, m, w = chunk_kv.shape[0], self.ratio, self.width
        kv = chunk_kv.new_zeros((n, 2 * m, w))
        gate = chunk_gate.new_full((n, 2 * m, w), float("-inf"))
        kv[:, m:], gate[:, m:] = chunk_kv[..., w:], chunk_gate[..., w:]
        kv[1:, :m], gate[1:, :m] = chunk_kv[:-1, :, :w], chunk_gate[:-1, :, :w]
        if state.overlap_kv is not None and state.overlap_gate is not None:
            kv[0, :m], gate[0, :m] = state.overlap_kv.to(kv.dtype), state.overlap_gate.to(gate.dtype)
        state.overlap_kv, state.overlap_gate = chunk_kv[-1, :, :w].clone(), chunk_gate[-1, :, :w].clone()
        return kv, gate


class Indexer(nn.Module):
    """CSA's lightning indexer: its own overlapping compressor of narrow keys, and queries from the attention's
    low-rank query, both rotated by the compress rope."""

    def __init__(
        self, hidden_size: int, q_lora_rank: int, num_heads: int, head_dim: int, ratio: int, topk: int, eps: float
    ) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.ratio, self.topk = num_heads, head_dim, ratio, topk
        self.compressor = Compressor(hidden_size, head_dim, ratio, overlap=True, eps=eps)
        self.wq_b = nn.Linear(q_lora_rank, num_heads * head_dim, bias=False)
        self.weights_proj = nn.Linear(hidden_size, num_heads, bias=False)

    def queries(self, q_residual: torch.Tensor, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]):
        """(T, q_lora), (T, Hd) -> queries (T, Hi, Di) rotated at the tokens' positions, head weights (T, Hi)."""
        q = self.wq_b(q_residual).view(q_residual.shape[0], self.num_heads, self.head_dim)
        weights = self.weights_proj(x).float() * self.num_heads**-0.5
        return rotate_tail(q, *cos_sin), weights

    def select(self, keys: torch.Tensor, q: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor):
        """The entries each query attends to: keys (E, Di), q (L, Hi, Di), weights (L, Hi), positions (L,) ->
        (L, k) entry indices, -1 where fewer than k entries are visible (closed at or before the query)."""
        scores = torch.matmul(q.float(), keys.float().T)  # (L, Hi, E)
        scores = (torch.relu(scores) * self.head_dim**-0.5 * weights[..., None]).sum(dim=1)  # (L, E)
        visible = (positions + 1) // self.ratio  # (L,): entries [0, visible) are closed
        entry_ids = torch.arange(keys.shape[0], device=keys.device)
        scores = scores.masked_fill(entry_ids[None, :] >= visible[:, None], float("-inf"))
        chosen = scores.topk(min(self.topk, keys.shape[0]), dim=-1).indices  # (L, k)
        return torch.where(chosen >= visible[:, None], torch.full_like(chosen, -1), chosen)
