"""What one forward pass needs to know about the batch, built once per step by the model runner.

Tokens of all scheduled requests are flattened into one (T,) batch: first the single-token requests
(decodes, one query each, attended through the device's paged decode kernel), then the multi-token
ones (prefill chunks), each a contiguous segment attended causally over its context.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from devices.base import DecodeBatch


@dataclass(frozen=True)
class PrefillSegment:
    start: int  # first row of the segment in the flattened batch
    end: int  # one past its last row
    num_cached: int  # context tokens before the segment (prefix-cache hits and earlier chunks)
    block_ids: torch.Tensor  # (m,) int64: blocks covering num_cached + (end - start) tokens


@dataclass(frozen=True)
class SequenceRows:
    """One request's rows in the flattened batch, with the state its model keeps per sequence outside the paged
    cache (DeepSeek-V4: the window and the compressors' entries and tails). The runner creates and drops the
    state; the model's forward is its only writer."""

    start: int
    end: int
    state: Any


@dataclass(frozen=True)
class ForwardBatch:
    positions: torch.Tensor  # (T,) int64
    slot_mapping: torch.Tensor  # (T,) int64: flat cache slot (block_id * block_size + offset) each token writes
    num_decode_tokens: int  # rows [0, num_decode_tokens) are single-token requests
    decode: DecodeBatch | None  # their block tables, prepared by the device
    prefills: tuple[PrefillSegment, ...]  # the multi-token segments, after the decodes
    # Rows whose input embeddings are given (image embeddings at placeholder tokens: request.EmbeddingSpan),
    # replacing the token embeddings: rows (E,) int64 and values (E, Hd). None: every row embeds its token.
    embed_rows: torch.Tensor | None = None
    embed_values: torch.Tensor | None = None
    # Called before each layer runs, with its index, when some of the KV it reads is still arriving (a layer-by-
    # layer load from a KV store, engine_core.kv_load); returns once that layer's KV is written.
    wait_for_layer: Callable[[int], None] | None = None
    # Every request of the step in row order, for models that keep per-sequence state (empty for the others).
    sequences: tuple[SequenceRows, ...] = ()
    block_size: int = 0  # tokens per block of the paged cache (slot // block_size is a row's block)


def write_cache(cache: torch.Tensor, slot_mapping: torch.Tensor, values: torch.Tensor) -> None:
    """Store each token's entry at its slot: cache (N, S, *F), values (T, *F)."""
    if values.dtype != cache.dtype:
        values = values.to(cache.dtype)
    cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, values)
