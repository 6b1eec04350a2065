"""What DeepSeek-V4 keeps per sequence between steps, as the model's forward sees it.

Per layer: the window (the latest `sliding_window - 1` tokens' KV vectors: the next query sees them plus itself),
and on CSA/HCA layers each compressor's state: the entries emitted so far, the tokens of the window not yet
closed (the tail) and, for CSA's overlapping windows, the first half of the last closed window. Between steps
these live in the request's slot of the state pools and, for the entries, in its blocks (`pools`); for a step the
runner hands the model a `SequenceState` of views of the slot and entries read from the blocks, and writes the
state's fixed part back after the forward (the forward replaces tensors, it does not write into them). A state is
rebuilt from a request's first blocks when it starts after a prefix-cache hit (`block_layout`: blocks end where
every tail is empty). `num_bytes` is what the state's tensors span.

Shapes: D the head size (the one KV vector per token), W a compressor's entry width (D, or the indexer's),
c = 2 for overlapping (CSA) compressors and 1 otherwise, m the compress ratio.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_core.config import V4Config


@dataclass
class CompressorState:
    tail_kv: torch.Tensor  # (b < m, c * W): projected tokens of the unfinished window
    tail_gate: torch.Tensor  # (b, c * W): their gate logits
    entries: torch.Tensor  # (E, W): one per closed window, normed and rotated
    overlap_kv: torch.Tensor | None = None  # (m, W): the last closed window's first half (CSA only)
    overlap_gate: torch.Tensor | None = None  # (m, W): its gate logits, position bias included

    @classmethod
    def empty(cls, width: int, num_series: int, dtype: torch.dtype, device: torch.device) -> CompressorState:
        tail = torch.empty(0, num_series * width, dtype=dtype, device=device)
        return cls(tail, tail, torch.empty(0, width, dtype=dtype, device=device))

    @property
    def num_entries(self) -> int:
        return int(self.entries.shape[0])

    @property
    def num_bytes(self) -> int:
        tensors = (self.tail_kv, self.tail_gate, self.entries, self.overlap_kv, self.overlap_gate)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass
class LayerState:
    window: torch.Tensor  # (<= sliding_window - 1, D): the latest tokens' KV, rotated
    compressor: CompressorState | None = None  # CSA and HCA layers
    indexer: CompressorState | None = None  # CSA layers: the lightning indexer's keys

    @property
    def num_bytes(self) -> int:
        parts = (self.compressor, self.indexer)
        return self.window.numel() * self.window.element_size() + sum(p.num_bytes for p in parts if p is not None)


@dataclass
class SequenceState:
    layers: list[LayerState]
    num_tokens: int = 0  # tokens computed so far: the next step's first position

    @property
    def num_bytes(self) -> int:
        return sum(layer.num_bytes for layer in self.layers)


def bytes_per_token(v4: V4Config, itemsize: int) -> dict[str, int]:
    """KV bytes one more token adds, per layer of each type, once the window is full (entries only; a token's
    window vector is dropped `sliding_window` tokens later). Per-layer figures are for one layer of the type."""
    return {
        "window": 0,
        "csa": (v4.head_dim + v4.index_head_dim) * itemsize // v4.csa_ratio,  # an entry and an indexer key per m
        "hca": v4.head_dim * itemsize // v4.hca_ratio,
    }


def bytes_per_sequence(v4: V4Config, itemsize: int) -> dict[str, int]:
    """The fixed part of one sequence's state per layer of each type, at its largest: the window, and the
    compressors' open windows (kv and gates in the model's dtype) and CSA's kept half-window (its gates, position
    bias added, in fp32)."""
    window = (v4.sliding_window - 1) * v4.head_dim * itemsize

    def tail(width: int, ratio: int, series: int) -> int:
        open_window = (ratio - 1) * series * width * 2 * itemsize
        kept_half = ratio * width * (itemsize + 4) if series == 2 else 0
        return open_window + kept_half

    csa = tail(v4.head_dim, v4.csa_ratio, 2) + tail(v4.index_head_dim, v4.csa_ratio, 2)
    return {"window": window, "csa": window + csa, "hca": window + tail(v4.head_dim, v4.hca_ratio, 1)}
