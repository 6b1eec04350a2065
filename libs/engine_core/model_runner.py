"""Runs the model for one scheduled step: builds the flattened batch, owns the KV cache tensor.

`ModelRunner` is the only writer of the KV cache tensor (the model writes into it during `execute`,
KV import writes through `write_blocks`), except for layer-by-layer loads (`engine_core.kv_load`), which write
the layers of blocks they hold, each before any forward pass reads it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from devices.base import DeviceOps
from engine_core.models.batch import ForwardBatch, PrefillSegment, SequenceRows
from engine_core.request import Request, RequestStatus
from engine_core.scheduler import SchedulerOutput


class ModelRunner:
    def __init__(
        self, model: nn.Module, ops: DeviceOps, dtype: torch.dtype, num_layers: int, num_blocks: int, block_size: int
    ):
        self.model = model
        self.ops = ops
        self.block_size = block_size
        layer_shape = model.kv_cache_shape(num_blocks, block_size)  # type: ignore[operator]
        self.kv_caches = torch.zeros((num_layers, *layer_shape), dtype=dtype, device=ops.torch_device)
        self.block_axis: int = model.kv_block_axis  # type: ignore[assignment]  # where blocks sit in a layer's cache
        # Models that keep a cache per sequence outside the paged tensor (DeepSeek-V4): request id -> (request,
        # state). Created here when a request computes its first token, dropped once it finished or went back
        # to waiting (preempted: it recomputes from its first token); the model writes the states' contents.
        self.keeps_sequence_state: bool = getattr(model, "keeps_sequence_state", False)
        self.sequence_states: dict[str, tuple[Request, object]] = {}

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_caches.numel() * self.kv_caches.element_size()

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput, wait_for_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Compute every scheduled token; return logits (n, V) of the requests that sample, in scheduled order.
        `wait_for_layer`: called before each layer (KV still arriving layer by layer: engine_core.kv_load)."""
        device = self.ops.torch_device
        input_ids, positions, slots, sample_rows = [], [], [], []
        decode_tables, decode_lens, prefills = [], [], []
        embed_rows: list[torch.Tensor] = []
        embed_values: list[torch.Tensor] = []
        sequences: list[SequenceRows] = []
        self.drop_finished_states()
        offset = 0
        for item in output.scheduled:
            request, start, count = item.request, item.request.num_computed_tokens, item.num_new_tokens
            pos = torch.arange(start, start + count)
            block_ids = torch.tensor(item.block_ids, dtype=torch.long)
            input_ids.append(torch.tensor(request.all_token_ids[start : start + count]))
            positions.append(pos)
            slots.append(block_ids[pos // self.block_size] * self.block_size + pos % self.block_size)
            if count == 1:
                decode_tables.append(item.block_ids)
                decode_lens.append(start + 1)
            else:
                num_context_blocks = -(-(start + count) // self.block_size)
                prefills.append(
                    PrefillSegment(offset, offset + count, start, block_ids[:num_context_blocks].to(device))
                )
            if item.needs_sample:
                sample_rows.append(offset + count - 1)
            if request.embedding_spans:
                _given_embeddings(request, start, count, offset, embed_rows, embed_values)
            if self.keeps_sequence_state:
                sequences.append(SequenceRows(offset, offset + count, self._sequence_state(request, start)))
            offset += count
        batch = ForwardBatch(
            positions=torch.cat(positions).to(device),
            slot_mapping=torch.cat(slots).to(device),
            num_decode_tokens=len(decode_lens),
            decode=self._prepare_decode(decode_tables, decode_lens),
            prefills=tuple(prefills),
            wait_for_layer=wait_for_layer,
            embed_rows=torch.cat(embed_rows).to(device) if embed_rows else None,
            embed_values=torch.cat(embed_values).to(device) if embed_values else None,
            sequences=tuple(sequences),
        )
        hidden = self.model(torch.cat(input_ids).to(device), batch, self.kv_caches)
        rows = torch.tensor(sample_rows, dtype=torch.long, device=device)
        return self.model.compute_logits(hidden[rows])  # type: ignore[operator]

    def _sequence_state(self, request: Request, start: int) -> object:
        """The request's state; a new one when it computes from its first token (first time or recompute)."""
        entry = self.sequence_states.get(request.request_id)
        if start == 0 or entry is None:
            if start != 0:
                raise RuntimeError(
                    f"request {request.request_id} resumes at token {start} with no sequence state: this model "
                    "cannot resume from paged KV (prefix hits and KV import are off for it)"
                )
            entry = (request, self.model.new_sequence_state())  # type: ignore[operator]
            self.sequence_states[request.request_id] = entry
        return entry[1]

    def drop_finished_states(self) -> None:
        """Forget the sequence states of requests that finished or went back to waiting."""
        for request_id, (request, _) in list(self.sequence_states.items()):
            if request.status.is_finished or request.status is RequestStatus.WAITING:
                del self.sequence_states[request_id]

    def _prepare_decode(self, tables: list[tuple[int, ...]], lens: list[int]):
        if not lens:
            return None
        width = max(len(t) for t in tables)
        padded = torch.zeros((len(tables), width), dtype=torch.int32)
        for i, table in enumerate(tables):
            padded[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
        device = self.ops.torch_device
        return self.ops.prepare_decode(
            padded.to(device), torch.tensor(lens, dtype=torch.int32, device=device), self.block_size
        )

    # -- KV export / import -------------------------------------------------------------------------
    def read_blocks(self, layer: int, block_ids: list[int]) -> torch.Tensor:
        """One layer's KV of the given blocks, blocks along `block_axis`, as a new contiguous CPU tensor."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.kv_caches.device)
        return self.kv_caches[layer].index_select(self.block_axis, index).cpu()

    def write_blocks(self, layer: int, block_ids: list[int], values: torch.Tensor) -> None:
        index = torch.tensor(block_ids, dtype=torch.long, device=self.kv_caches.device)
        self.kv_caches[layer].index_copy_(self.block_axis, index, values.to(self.kv_caches.device))

    def read_all_layers(self, block_id: int) -> torch.Tensor:
        """One block across every layer: (num_layers, *layer_shape with a block axis of 1), on the CPU."""
        index = torch.tensor([block_id], dtype=torch.long, device=self.kv_caches.device)
        return self.kv_caches.index_select(self.block_axis + 1, index).cpu()

    def write_all_layers(self, block_id: int, values: torch.Tensor) -> None:
        index = torch.tensor([block_id], dtype=torch.long, device=self.kv_caches.device)
        self.kv_caches.index_copy_(self.block_axis + 1, index, values.to(self.kv_caches.device))


def _given_embeddings(
    request: Request, start: int, count: int, row: int, rows: list[torch.Tensor], values: list[torch.Tensor]
) -> None:
    """The rows of positions [start, start + count) that fall in the request's embedding spans (a chunk may cover
    part of a span: only that part), with their embeddings; `row` is the batch row of position `start`."""
    for span in request.embedding_spans:
        first, last = max(span.offset, start), min(span.end, start + count)
        if first < last:
            rows.append(torch.arange(row + first - start, row + last - start))
            values.append(span.embeddings[first - span.offset : last - span.offset])
