"""Runs the model for one scheduled step: builds the flattened batch, owns the KV cache.

The KV cache is one tensor (num_layers, *layer_shape) for models whose layers are alike (Llama, DeepSeek-V3), or
per-layer-type pools indexed by block id for a model that makes them (DeepSeek-V4's `new_kv_cache`:
models.deepseek_v4.paged_pools). `ModelRunner` is its only writer: the model writes into it during `execute`, KV
import through `write_blocks`, the prefix store through `write_stored_block`, layer-by-layer loads
(`engine_core.kv_load`) through `write_stored_layer` (the layers of blocks they hold, each before any forward pass
reads it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from devices.base import DecodeBatch, DeviceOps
from engine_core.kv_transfer import KVLayout, block_bytes_to_tensor, layer_bytes_to_tensor, tensor_to_bytes
from engine_core.models.batch import ForwardBatch, PrefillSegment, SequenceRows
from engine_core.models.deepseek_v4.paged_pools import PagedPools
from engine_core.request import Request, RequestStatus
from engine_core.scheduler import ScheduledRequest, SchedulerOutput


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        ops: DeviceOps,
        dtype: torch.dtype,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_state_slots: int = 0,
    ):
        self.model = model
        self.ops = ops
        self.block_size = block_size
        self.num_layers = num_layers
        self.kv_caches: torch.Tensor | PagedPools
        if hasattr(model, "new_kv_cache"):  # per-layer-type pools (module docstring)
            self.kv_caches = model.new_kv_cache(num_blocks, block_size)  # type: ignore[operator]
        else:
            layer_shape = model.kv_cache_shape(num_blocks, block_size)  # type: ignore[operator]
            self.kv_caches = torch.zeros((num_layers, *layer_shape), dtype=dtype, device=ops.torch_device)
        self.block_axis: int = model.kv_block_axis  # type: ignore[assignment]  # where blocks sit in a layer's cache
        # Models that keep a cache per sequence beside the paged tensor (DeepSeek-V4): its fixed part lives in
        # preallocated pools, one slot per request (the KV cache manager hands slots out with blocks), its growing
        # part in the request's blocks. Per request: its slot and how far it has computed, from its first token,
        # from its first blocks after a prefix-cache hit, or from an import; dropped once it finished or went back
        # to waiting (preempted: it restarts from its cached blocks or its first token). The model writes the slots.
        self.keeps_sequence_state: bool = getattr(model, "keeps_sequence_state", False)
        self.pools = model.new_state_pools(num_state_slots) if self.keeps_sequence_state else None  # type: ignore[operator]
        self._slots: dict[str, _SlotState] = {}

    @property
    def state_pool_bytes(self) -> int:
        """Bytes of the per-sequence state pools (0 for models without them)."""
        return self.pools.num_bytes if self.pools is not None else 0

    @property
    def sequence_states(self) -> dict[str, tuple[Request, object]]:
        """Every live request's state as the model sees it (views of its slot, entries read from its blocks)."""
        return {rid: (entry.request, self.sequence_state(rid)) for rid, entry in self._slots.items()}

    def sequence_state(self, request_id: str) -> object:
        entry = self._slots[request_id]
        return self.model.load_sequence_state(  # type: ignore[operator]
            self.pools, entry.slot, self.kv_caches, entry.block_ids, self.block_size, entry.num_tokens
        )

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the paged cache (every pool's, for pools)."""
        if isinstance(self.kv_caches, PagedPools):
            return self.kv_caches.num_bytes
        return self.kv_caches.numel() * self.kv_caches.element_size()

    @property
    def _uniform_cache(self) -> torch.Tensor:
        """The one-tensor cache, for what only models with alike layers do (their block format 1 chunks)."""
        assert isinstance(self.kv_caches, torch.Tensor), "this model's cache is per-layer-type pools"
        return self.kv_caches

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput, wait_for_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Compute every scheduled token; return logits (n, V) of the requests that sample, in scheduled order.
        `wait_for_layer`: called before each layer (KV still arriving layer by layer: engine_core.kv_load)."""
        device = self.ops.torch_device
        self.drop_finished_states()
        if self.keeps_sequence_state and wait_for_layer is not None:
            # a state rebuilt from prefix blocks reads every layer's rows before the forward: the loaded ones must
            # all be there (no overlap of compute and transfer for these models yet)
            for layer in range(self.num_layers):
                wait_for_layer(layer)
        decodes, prefills = _decode_rows_first(output.scheduled)
        rows = _StepRows(self.block_size)
        sequences: list[SequenceRows] = []
        segments: list[PrefillSegment] = []
        loaded: list[tuple[str, object]] = []  # (request id, state) of each request, for models that keep one
        for item in [*decodes, *prefills]:
            first_row = len(rows.input_ids)
            if item.num_new_tokens == 1:
                rows.add_decode(item)
            else:
                segments.append(rows.add_prefill(item, device))
            if self.keeps_sequence_state:
                state = self._load_state(item)
                loaded.append((item.request.request_id, state))
                sequences.append(SequenceRows(first_row, first_row + item.num_new_tokens, state))
        batch = ForwardBatch(
            positions=torch.tensor(rows.positions, dtype=torch.long).to(device),
            slot_mapping=torch.tensor(rows.slots, dtype=torch.long).to(device),
            num_decode_tokens=len(decodes),
            decode=self._prepare_decode(decodes),
            prefills=tuple(segments),
            wait_for_layer=wait_for_layer,
            embed_rows=torch.cat(rows.embed_rows).to(device) if rows.embed_rows else None,
            embed_values=torch.cat(rows.embed_values).to(device) if rows.embed_values else None,
            sequences=tuple(sequences),
            block_size=self.block_size,
        )
        hidden = self.model(torch.tensor(rows.input_ids, dtype=torch.long).to(device), batch, self.kv_caches)
        for request_id, state in loaded:  # the states moved on: their fixed part back into the slots
            entry = self._slots.get(request_id)
            if entry is None:  # aborted while the step ran (its slot may be another request's already)
                continue
            entry.num_tokens = state.num_tokens  # type: ignore[attr-defined]
            self.model.store_sequence_state(self.pools, entry.slot, state)  # type: ignore[operator]
        sample_rows = [rows.last_row[id(item)] for item in output.scheduled if item.needs_sample]
        if sample_rows != list(range(hidden.shape[0])):  # not every row in order (prefills, decodes reordered)
            hidden = hidden[torch.tensor(sample_rows, dtype=torch.long, device=device)]
        return self.model.compute_logits(hidden)  # type: ignore[operator]

    def _load_state(self, item: ScheduledRequest) -> object:
        """The request's state for this step; from its first token when it computes from there (first time or
        recompute), rebuilt from its first blocks into its slot when it starts after a prefix-cache hit (at a block
        boundary)."""
        request, start = item.request, item.request.num_computed_tokens
        entry = self._slots.get(request.request_id)
        if start == 0 or entry is None:
            assert self.pools is not None and 0 <= item.state_slot < self.pools.num_slots, "no state slot"
            entry = _SlotState(request, item.state_slot, item.block_ids)
            if start % self.block_size:
                raise RuntimeError(
                    f"request {request.request_id} resumes at token {start} with no sequence state: this model "
                    "resumes only at a block boundary (KV import is not written for it)"
                )
            if start:
                blocks = list(item.block_ids[: start // self.block_size])
                rebuilt = self.model.sequence_state_from_blocks(self.kv_caches, blocks, self.block_size)  # type: ignore[operator]
                self.model.store_sequence_state(self.pools, entry.slot, rebuilt)  # type: ignore[operator]
                entry.num_tokens = start
            self._slots[request.request_id] = entry
        assert entry.slot == item.state_slot, f"request {request.request_id} moved from slot {entry.slot}"
        entry.block_ids = item.block_ids
        return self.sequence_state(request.request_id)

    def drop_finished_states(self) -> None:
        """Forget the states of requests that finished or went back to waiting (their slots are free again once the
        KV cache manager freed them); a request kept for KV export keeps its state (what the export sends) until
        `forget_sequence_state`."""
        for request_id, entry in list(self._slots.items()):
            request = entry.request
            is_kept = request.keep_kv and request.status in (
                RequestStatus.FINISHED_STOPPED,
                RequestStatus.FINISHED_LENGTH,
            )
            if (request.status.is_finished and not is_kept) or request.status is RequestStatus.WAITING:
                del self._slots[request_id]

    def begin_import(self, request: Request, slot: int, block_ids: tuple[int, ...], num_tokens: int) -> None:
        """A request whose state arrives layer by layer (`import_layer`) into `slot` and its blocks."""
        missing = set(range(self.num_layers))
        self._slots[request.request_id] = _SlotState(request, slot, block_ids, num_tokens, missing)

    def import_layer(self, request_id: str, layer: int, state: object) -> None:
        entry = self._slots[request_id]
        self.model.store_imported_layer(  # type: ignore[operator]
            self.pools, entry.slot, layer, state, self.kv_caches, entry.block_ids, self.block_size
        )
        entry.missing_layers.discard(layer)

    def missing_layers(self, request_id: str) -> list[int]:
        """The layers of an import that have not arrived."""
        return sorted(self._slots[request_id].missing_layers)

    def forget_sequence_state(self, request_id: str) -> None:
        """The kept request was released."""
        self._slots.pop(request_id, None)

    def _prepare_decode(self, decodes: list[ScheduledRequest]) -> DecodeBatch | None:
        if not decodes:
            return None
        width = max(len(item.block_ids) for item in decodes)
        tables = [list(item.block_ids) + [0] * (width - len(item.block_ids)) for item in decodes]
        lens = [item.request.num_computed_tokens + 1 for item in decodes]
        device = self.ops.torch_device
        return self.ops.prepare_decode(
            torch.tensor(tables, dtype=torch.int32).to(device),
            torch.tensor(lens, dtype=torch.int32).to(device),
            self.block_size,
        )

    # -- KV export / import -------------------------------------------------------------------------
    def read_blocks(self, layer: int, block_ids: list[int]) -> torch.Tensor:
        """One layer's KV of the given blocks, blocks along `block_axis`, as a new contiguous CPU tensor."""
        cache = self._uniform_cache
        index = torch.tensor(block_ids, dtype=torch.long, device=cache.device)
        return cache[layer].index_select(self.block_axis, index).cpu()

    def write_blocks(self, layer: int, block_ids: list[int], values: torch.Tensor) -> None:
        cache = self._uniform_cache
        index = torch.tensor(block_ids, dtype=torch.long, device=cache.device)
        cache[layer].index_copy_(self.block_axis, index, values.to(cache.device))

    def read_all_layers(self, block_id: int) -> torch.Tensor:
        """One block across every layer: (num_layers, *layer_shape with a block axis of 1), on the CPU."""
        cache = self._uniform_cache
        index = torch.tensor([block_id], dtype=torch.long, device=cache.device)
        return cache.index_select(self.block_axis + 1, index).cpu()

    def write_all_layers(self, block_id: int, values: torch.Tensor) -> None:
        cache = self._uniform_cache
        index = torch.tensor([block_id], dtype=torch.long, device=cache.device)
        cache.index_copy_(self.block_axis + 1, index, values.to(cache.device))

    # -- whole blocks as a KV store holds them (`layout`: this engine's block format) --------------------
    def read_stored_block(self, block_id: int) -> bytes:
        """One block, every layer, as its stored bytes."""
        if isinstance(self.kv_caches, PagedPools):
            return tensor_to_bytes(self.kv_caches.read_block(block_id))
        return tensor_to_bytes(self.read_all_layers(block_id))

    def write_stored_block(self, block_id: int, data: bytes | bytearray | memoryview, layout: KVLayout) -> None:
        """Put a block's stored bytes into the cache; KVLayoutError unless they are one block of `layout`."""
        values = block_bytes_to_tensor(data, layout)
        if isinstance(self.kv_caches, PagedPools):
            self.kv_caches.write_block(block_id, values)
        else:
            self.write_all_layers(block_id, values)

    def write_stored_layer(
        self, layer: int, block_ids: list[int], pieces: Sequence[bytes | bytearray | memoryview], layout: KVLayout
    ) -> None:
        """One layer of several blocks, `pieces[i]` block i's bytes of it as a stored block holds them. Called
        from the loader's thread for blocks that no forward pass reads until this layer is written (kv_load)."""
        values = layer_bytes_to_tensor(pieces, layout, self.block_axis)
        if isinstance(self.kv_caches, PagedPools):
            self.kv_caches.write_layer(layer, block_ids, values)
        else:
            self.write_blocks(layer, block_ids, values)


def _decode_rows_first(
    scheduled: tuple[ScheduledRequest, ...],
) -> tuple[list[ScheduledRequest], list[ScheduledRequest]]:
    """The step's rows in batch order: single-token requests longest context first (so the device can attend
    rows of similar lengths together, `DeviceOps.prepare_decode`), then the multi-token ones in scheduled order."""
    decodes = [item for item in scheduled if item.num_new_tokens == 1]
    decodes.sort(key=lambda item: -item.request.num_computed_tokens)  # stable: ties keep scheduled order
    return decodes, [item for item in scheduled if item.num_new_tokens != 1]


class _StepRows:
    """The flattened batch's per-row inputs as plain lists, filled one scheduled request at a time; each
    becomes one tensor (a torch op per request would cost more than the arithmetic)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.input_ids: list[int] = []
        self.positions: list[int] = []
        self.slots: list[int] = []  # flat cache slot each row writes
        self.last_row: dict[int, int] = {}  # id(scheduled request) -> its last row
        self.embed_rows: list[torch.Tensor] = []
        self.embed_values: list[torch.Tensor] = []

    def add_decode(self, item: ScheduledRequest) -> None:
        request, position, size = item.request, item.request.num_computed_tokens, self.block_size
        self._note_embeddings(request, position, 1)
        self.last_row[id(item)] = len(self.input_ids)
        self.input_ids.append(request.all_token_ids[position])
        self.positions.append(position)
        self.slots.append(item.block_ids[position // size] * size + position % size)

    def add_prefill(self, item: ScheduledRequest, device: torch.device) -> PrefillSegment:
        request, start, count, size = (
            item.request,
            item.request.num_computed_tokens,
            item.num_new_tokens,
            self.block_size,
        )
        self._note_embeddings(request, start, count)
        first_row = len(self.input_ids)
        self.last_row[id(item)] = first_row + count - 1
        self.input_ids.extend(request.all_token_ids[start : start + count])
        self.positions.extend(range(start, start + count))
        blocks = item.block_ids
        self.slots.extend(blocks[pos // size] * size + pos % size for pos in range(start, start + count))
        num_context_blocks = -(-(start + count) // size)
        block_ids = torch.tensor(blocks[:num_context_blocks], dtype=torch.long).to(device)
        return PrefillSegment(first_row, first_row + count, start, block_ids)

    def _note_embeddings(self, request: Request, start: int, count: int) -> None:
        if request.embedding_spans:
            _given_embeddings(request, start, count, len(self.input_ids), self.embed_rows, self.embed_values)


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


@dataclass
class _SlotState:
    """A request's place in the state pools: its slot, its blocks (where its entries are), its computed tokens."""

    request: Request
    slot: int
    block_ids: tuple[int, ...]
    num_tokens: int = 0
    missing_layers: set[int] = field(default_factory=set)  # an import's layers still to arrive
