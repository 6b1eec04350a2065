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

from devices.base import DecodeBatch, DeviceOps


@dataclass(frozen=True)
class PrefillSegment:
    start: int  # first row of the segment in the flattened batch
    end: int  # one past its last row
    num_cached: int  # context tokens before the segment (prefix-cache hits and earlier chunks)
    block_ids: torch.Tensor  # (m,) int64: blocks covering num_cached + (end - start) tokens
    # The request's context kept contiguous between its chunks (None: gather it from the blocks every layer)
    context: PrefillContext | None = None


class PrefillContext:
    """One request's context entries kept contiguous between the chunks of its prefill, per layer and role.

    Without it, a chunk's attention gathers its whole context from the paged cache in every layer, a copy that
    grows with the context, not the chunk: late in an 8k prompt an 8-token chunk's step cost 2.7x a decode step.
    With it, each chunk copies only its own new entries (read back from the cache, so the values are the cache's
    exactly) after those of the chunks before; the attention reads the same values as from a full gather.

    The model runner creates one for a request whose prefill spans several chunks and drops it when the prefill
    ends, or the request is preempted or aborted; each layer's attention is the only writer of its buffers.
    """

    def __init__(self, capacity: int, block_ids: tuple[int, ...]) -> None:
        self.capacity = capacity  # tokens each buffer holds: the whole prefill's
        self.block_ids = block_ids  # the request's blocks when the buffers were filled
        self._buffers: dict[tuple[int, str], torch.Tensor] = {}  # (layer, role) -> (capacity, *F)
        self._num_tokens: dict[tuple[int, str], int] = {}  # (layer, role) -> context tokens its buffer holds

    @property
    def num_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def reset(self, block_ids: tuple[int, ...]) -> None:
        """The request's blocks changed (or the buffers no longer match them): the next chunk gathers in full."""
        self.block_ids = block_ids
        self._num_tokens.clear()

    def extend(
        self, key: tuple[int, str], ops: DeviceOps, cache: torch.Tensor, seg: PrefillSegment, slots: torch.Tensor
    ) -> torch.Tensor:
        """The segment's context, cache (N, S, *F) -> (num_cached + its tokens, *F): a view of the buffer for `key`
        after copying in the segment's new entries, at `slots` (its rows' flat cache slots), already written."""
        num_new = seg.end - seg.start
        num_total = seg.num_cached + num_new
        buffer = self._buffers.get(key)
        if buffer is None:
            buffer = cache.new_empty(self.capacity, *cache.shape[2:])
            self._buffers[key] = buffer
        assert num_total <= self.capacity, f"a context of {num_total} tokens in a buffer of {self.capacity}"
        if self._num_tokens.get(key) != seg.num_cached and seg.num_cached:  # first chunk after a hit, or a reset
            buffer[: seg.num_cached] = ops.gather_cache(cache, seg.block_ids, seg.num_cached)
        entries = cache.view(-1, *cache.shape[2:])  # (N * S, *F)
        torch.index_select(entries, 0, slots, out=buffer[seg.num_cached : num_total])
        self._num_tokens[key] = num_total
        return buffer[:num_total]


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
    cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, values.to(cache.dtype))
