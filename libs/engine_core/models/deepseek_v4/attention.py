"""DeepSeek-V4 attention: one KV vector per token, a sliding window on every layer, compressed entries beyond it.

Queries come from a low-rank projection, RMS-normed per head; each token's KV is one D-wide vector read as both
key and value; the last r dims of queries and keys are rotated (the "main" rope on window-only layers, the YaRN
"compress" rope elsewhere). A query attends to the latest `sliding_window` tokens (itself included) and, on CSA
and HCA layers, to compressed entries whose window has closed (HCA: all of them; CSA: the indexer's top-k), with
a learned per-head sink logit in the softmax. The output's rotated dims are rotated back at the query's position,
then heads are projected in groups to a low rank and mixed to the hidden size.

The window and the compressors' state live in each sequence's `LayerState`; projections run over the whole
batch, the window and compressors sequence by sequence, the attention over every sequence at once (padded).
Shapes: T tokens, L one sequence's new tokens, H heads, D head size, K keys a query may see (window + entries),
G output groups.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from engine_core.config import ModelConfig, V4Config
from engine_core.models.deepseek_v4.block_layout import BlockLayout, LayerBlocks, LayerRows, read_layer_state
from engine_core.models.deepseek_v4.compressor import Compressor, Indexer
from engine_core.models.deepseek_v4.functional import Fp32RMSNorm, rotate_tail, unweighted_rms_norm
from engine_core.models.deepseek_v4.state import CompressorState, LayerState
from engine_core.models.rope import RotaryEmbedding

CosSin = tuple[torch.Tensor, torch.Tensor]


class V4Attention(nn.Module):
    def __init__(self, config: ModelConfig, v4: V4Config, layer: int) -> None:
        super().__init__()
        hidden, heads, d, eps = config.hidden_size, config.num_heads, v4.head_dim, config.rms_norm_eps
        self.v4, self.num_heads, self.eps = v4, heads, eps
        self.kind = v4.attention_types[layer]
        self.wq_a = nn.Linear(hidden, v4.q_lora_rank, bias=False)
        self.q_norm = Fp32RMSNorm(v4.q_lora_rank, eps)
        self.wq_b = nn.Linear(v4.q_lora_rank, heads * d, bias=False)
        self.wkv = nn.Linear(hidden, d, bias=False)
        self.norm = Fp32RMSNorm(d, eps)  # of the KV vector
        self.wo_a = nn.Linear(heads * d // v4.o_groups, v4.o_groups * v4.o_lora_rank, bias=False)  # per group
        self.wo_b = nn.Linear(v4.o_groups * v4.o_lora_rank, hidden, bias=False)
        self.attn_sink = nn.Parameter(torch.empty(heads, dtype=torch.float32))
        ratio = v4.compress_ratio(layer)
        self.compressor = Compressor(hidden, d, ratio, self.kind == "csa", eps) if ratio else None
        self.indexer = (
            Indexer(hidden, v4.q_lora_rank, v4.index_num_heads, v4.index_head_dim, ratio, v4.index_topk, eps)
            if self.kind == "csa"
            else None
        )

    def empty_state(self, dtype: torch.dtype, device: torch.device) -> LayerState:
        window = torch.empty(0, self.v4.head_dim, dtype=dtype, device=device)
        compressor = self.compressor.empty_state(dtype, device) if self.compressor is not None else None
        indexer = self.indexer.compressor.empty_state(dtype, device) if self.indexer is not None else None
        return LayerState(window, compressor, indexer)

    def state_from_blocks(self, cache: LayerRows, layout: BlockLayout, block_ids: torch.Tensor) -> LayerState:
        """The state after the tokens of blocks `block_ids` (k,) of this layer's rows of the paged pools, at a
        boundary where every compressor's open window is empty (block_layout)."""
        read = read_layer_state(cache, layout, block_ids, self.v4.sliding_window - 1)
        state = self.empty_state(cache["window"].dtype, cache["window"].device)
        state.window = read["window"]
        parts = [(self.compressor, state.compressor, "")]
        if self.indexer is not None:
            parts.append((self.indexer.compressor, state.indexer, "index_"))
        for compressor, compressed, prefix in parts:
            if compressor is not None and compressed is not None:
                overlap = (read.get(prefix + "overlap_kv"), read.get(prefix + "overlap_gate"))
                compressor.resume(compressed, read[prefix + "entries"], *overlap)  # type: ignore[arg-type]
        return state

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        cos_sin: CosSin,
        sequences: list[tuple[int, int, LayerState]],
        blocks: LayerBlocks | None = None,
    ) -> torch.Tensor:
        """x (T, Hd) -> (T, Hd); `rope`/`cos_sin` are this layer's rope and its values at `positions` (T,);
        `sequences`: (first row, end row, state) of each request, covering every row once; `blocks`: this layer's
        block rows, where each token's KV, entries and overlaps are also written (block_layout)."""
        t, d = x.shape[0], self.v4.head_dim
        q_residual = self.q_norm(self.wq_a(x))  # (T, q_lora)
        q = unweighted_rms_norm(self.wq_b(q_residual).view(t, self.num_heads, d), self.eps)
        q = rotate_tail(q, *cos_sin)  # (T, H, D)
        kv = rotate_tail(self.norm(self.wkv(x))[:, None, :], *cos_sin)[:, 0]  # (T, D)
        compressed = self.compressor.project(x) if self.compressor is not None else None
        index_q = None
        if self.indexer is not None:
            index_q = (*self.indexer.queries(q_residual, x, cos_sin), *self.indexer.compressor.project(x))
        if blocks is not None:
            blocks.write_window(kv)
        attended = []  # per sequence: its rows, keys (K, D) and mask (L, K)
        for start, end, state in sequences:
            rows = slice(start, end)
            keys, mask = self._window(state, kv[rows], positions[rows])
            if self.compressor is not None and compressed is not None:
                assert state.compressor is not None
                kv_c, gate_c = compressed[0][rows], compressed[1][rows]
                _extend(self.compressor, state.compressor, kv_c, gate_c, rope, blocks, "", rows, positions[rows])
                entry_mask = self._entry_mask(state, x[rows], positions[rows], rope, index_q, rows, blocks)
                keys = torch.cat([keys, state.compressor.entries])
                mask = torch.cat([mask, entry_mask], dim=1)
            attended.append((rows, keys, mask))
        out = self._attend(q, attended)
        out = rotate_tail(out, cos_sin[0], -cos_sin[1])  # undo the keys' rotation carried into the values
        return self.wo_b(self._grouped_output(out))

    def _window(self, state: LayerState, kv: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Keys of the window (the kept tokens, then the new ones) and which of them each query sees: (K, D),
        (L, K). Keeps the latest `sliding_window - 1` for the next step."""
        keys = torch.cat([state.window, kv])
        first = int(positions[0]) - state.window.shape[0]
        key_positions = torch.arange(first, first + keys.shape[0], device=kv.device)
        delta = positions[:, None] - key_positions[None, :]  # (L, K)
        mask = (delta >= 0) & (delta < self.v4.sliding_window)
        state.window = keys[max(0, keys.shape[0] - (self.v4.sliding_window - 1)) :].clone()  # not a view of keys
        return keys, mask

    def _entry_mask(
        self,
        state: LayerState,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        index_q: tuple[torch.Tensor, ...] | None,
        rows: slice,
        blocks: LayerBlocks | None,
    ) -> torch.Tensor:
        """(L, E): the closed entries each query sees; on CSA layers only those the indexer picks. `index_q`: the
        indexer's queries, head weights and its compressor's kv and gate logits, for the whole batch (T, ...)."""
        assert state.compressor is not None and self.compressor is not None
        num_entries = state.compressor.num_entries
        if self.indexer is None or index_q is None:
            visible = (positions + 1) // self.compressor.ratio
            return torch.arange(num_entries, device=x.device)[None, :] < visible[:, None]
        assert state.indexer is not None
        kv, gate = index_q[2][rows], index_q[3][rows]
        _extend(self.indexer.compressor, state.indexer, kv, gate, rope, blocks, "index_", rows, positions)
        chosen = self.indexer.select(state.indexer.entries, index_q[0][rows], index_q[1][rows], positions)
        chosen = torch.where(chosen >= 0, chosen, torch.full_like(chosen, num_entries))  # -1: a spare column
        picked = torch.zeros(positions.shape[0], num_entries + 1, dtype=torch.bool, device=x.device)
        return picked.scatter_(1, chosen, True)[:, :num_entries]

    def _attend(self, q: torch.Tensor, sequences: list[tuple[slice, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """q (T, H, D); per sequence its rows, keys = values (K, D) and mask (L, K), with one sink logit per head ->
        (T, H, D). Every sequence at once: queries, keys and masks padded to the longest (S, L, K); a padded key is
        masked out, a padded query's row is dropped."""
        if len(sequences) == 1:
            (rows, keys, mask), width = sequences[0], None
            q_pad, keys_pad, mask_pad = q[rows][None], keys[None], mask[None]
        else:
            width = max(keys.shape[0] for _, keys, _ in sequences)
            q_pad = pad_sequence([q[rows] for rows, _, _ in sequences], batch_first=True)  # (S, L, H, D)
            keys_pad = pad_sequence([keys for _, keys, _ in sequences], batch_first=True)  # (S, K, D)
            mask_pad = q.new_zeros((len(sequences), q_pad.shape[1], width), dtype=torch.bool)
            for i, (_, _, mask) in enumerate(sequences):
                mask_pad[i, : mask.shape[0], : mask.shape[1]] = mask
        scores = torch.matmul(q_pad.transpose(1, 2), keys_pad.transpose(1, 2)[:, None]) * self.v4.head_dim**-0.5
        scores = scores.masked_fill(~mask_pad[:, None], float("-inf"))  # (S, H, L, K)
        sinks = self.attn_sink.to(scores.dtype)[None, :, None, None].expand(*scores.shape[:3], 1)  # (S, H, L, 1)
        logits = torch.cat([scores, sinks], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = logits.softmax(dim=-1, dtype=logits.dtype)[..., :-1]  # the sink takes its share, gives nothing
        out = torch.matmul(probs.to(keys_pad.dtype), keys_pad[:, None]).transpose(1, 2)  # (S, L, H, D)
        if width is None:
            return out[0]
        result = q.new_empty(q.shape)
        for i, (rows, _, _) in enumerate(sequences):
            result[rows] = out[i, : rows.stop - rows.start]
        return result

    def _grouped_output(self, out: torch.Tensor) -> torch.Tensor:
        """(T, H, D) -> (T, G * o_lora): each group of heads projected by its own block of wo_a."""
        groups = self.v4.o_groups
        x = out.reshape(out.shape[0], groups, -1).transpose(0, 1)  # (G, T, H * D / G)
        w = self.wo_a.weight.view(groups, -1, x.shape[-1]).transpose(1, 2)  # (G, H * D / G, o_lora)
        return torch.bmm(x, w).transpose(0, 1).flatten(1)


def _extend(
    compressor: Compressor,
    state: CompressorState,
    kv: torch.Tensor,
    gate: torch.Tensor,
    rope: RotaryEmbedding,
    blocks: LayerBlocks | None,
    prefix: str,
    rows: slice,
    positions: torch.Tensor,
) -> None:
    """`Compressor.extend` for one sequence's rows (kv, gate (L, c W), positions (L,)), also writing the entries it
    emits and, for CSA, each block's last-window projections into the sequence's blocks."""
    num_before = state.num_entries
    compressor.extend(state, kv, gate, rope)
    if blocks is None:
        return
    blocks.write_entries(prefix, rows, int(positions[0]), state.entries[num_before:], num_before)
    if compressor.num_series == 2:
        blocks.write_overlap(prefix, rows, kv, gate)
