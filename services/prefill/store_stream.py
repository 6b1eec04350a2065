"""A prefix read from the KV store, layer-major, straight into an engine's layer-by-layer load, so that prefill
computes while later layers are still arriving (engine_core.kv_load).

The plan comes from the global index (no call before the read): for each block, its k data fragments (systematic
erasure coding: their bytes are the block's, in order; 1+0 is the whole block). Each node streams its fragments
with `GetRequest.slice_bytes`: one header per block (checksums, layout), then chunks holding a slice of every
block. Each block's bytes land in a buffer at their place; as soon as layer l is complete in every block it is
written to the engine (whose forward pass waits for exactly that). The last layer is written only after every
block passed its checksum, so the engine can never finish a step on unchecked KV. A node that fails mid-stream
costs a detour, not a recompute: the missing blocks are read whole from the other nodes (parity decoded) and the
remaining layers written then; only when that fails too does the load fail, and the engine recomputes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc.aio

from mesh import lane, metrics, rpc
from mesh.kv_blocks import KVLayout, checksum, checksum_more, layout_to_proto
from mesh.logging import get_logger
from mesh.pb import kvcache_pb2
from services.prefill.store_reads import Fetched, FragmentReader, Source, assemble, store_failed

log = get_logger(__name__)
MAX_CHUNK_BYTES = 2 * 2**20  # a slice of every block, past which more layers per slice only add latency
MAX_LAYERS_PER_SLICE = 4

WriteLayer = Callable[[int, list[memoryview]], None]  # (layer, each block's bytes of it)


def slice_bytes_for(layout: KVLayout, num_blocks: int) -> int:
    """Whole layers per slice, as many as keep a chunk (a slice of every block) near MAX_CHUNK_BYTES (block format
    2: layers of the largest size, so a slice still ends on a layer boundary for uniform layers and holds at
    least one whole layer's worth otherwise)."""
    layer_bytes = max(layout.layer_bytes(layer) for layer in range(layout.num_layers))
    layers = max(1, min(MAX_LAYERS_PER_SLICE, MAX_CHUNK_BYTES // max(layer_bytes * num_blocks, 1)))
    return layers * layer_bytes


@dataclass
class StreamBuffers:
    """Every block's bytes as they arrive. Written only by the stream's tasks (one event loop)."""

    layout: KVLayout
    num_data: list[int]  # k, per block
    pool: lane.BufferPool
    data: list[bytearray] = field(init=False)
    filled: list[list[int]] = field(init=False)  # per block, per data fragment: bytes arrived (in order)
    layer_offsets: tuple[int, ...] = field(init=False)  # where each layer starts in a block, then the block's end
    block_bytes: int = field(init=False)
    _fragment_bytes: list[int] = field(init=False)
    block_checksums: dict[int, int] = field(default_factory=dict)
    # block index -> (CRC-32C of its first bytes, how many): whole blocks (k = 1) summed as their bytes land, by
    # the thread that received them (mesh.lane_io), so `is_checked` reads the sum instead of the block again
    running: dict[int, tuple[int, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.layer_offsets = self.layout.layer_offsets()
        self.block_bytes = self.layer_offsets[-1]
        self._fragment_bytes = [-(-self.block_bytes // k) for k in self.num_data]
        self.data = [self.pool.take(self._fragment_bytes[i] * k) for i, k in enumerate(self.num_data)]
        self.filled = [[0] * k for k in self.num_data]

    def fragment_bytes(self, index: int) -> int:
        return self._fragment_bytes[index]

    def put(self, index: int, fragment: int, offset: int, data: memoryview) -> None:
        start = fragment * self.fragment_bytes(index) + offset
        self.data[index][start : start + len(data)] = data
        self.filled[index][fragment] = offset + len(data)

    def region(self, index: int, fragment: int, offset: int, size: int) -> memoryview:
        """Where bytes [offset, offset + size) of a fragment go: receive into it, then `mark` them arrived."""
        start = fragment * self.fragment_bytes(index) + offset
        return memoryview(self.data[index])[start : start + size]

    def mark(self, index: int, fragment: int, end: int) -> None:
        self.filled[index][fragment] = end

    def put_whole(self, index: int, data: bytes) -> None:
        self.data[index][: len(data)] = data
        self.filled[index] = [self.fragment_bytes(index)] * self.num_data[index]

    def prefix(self, index: int) -> int:
        """Bytes of block `index` complete from its start."""
        size = self._fragment_bytes[index]
        for fragment, done in enumerate(self.filled[index]):
            if done < size:
                return fragment * size + done
        return self.block_bytes

    def is_layer_ready(self, layer: int) -> bool:
        """Layer `layer` has arrived in every block (slices arrive in block order, so a miss is found early)."""
        end = self.layer_offsets[layer + 1]
        return all(self.prefix(i) >= end for i in range(len(self.data)))

    def layer(self, layer: int) -> list[memoryview]:
        start, end = self.layer_offsets[layer], self.layer_offsets[layer + 1]
        return [memoryview(data)[start:end] for data in self.data]

    def running_sum(self, index: int, offset: int) -> int | None:
        """The running checksum that bytes of block `index` landing at `offset` continue: only a whole block (one
        data fragment) whose bytes land in order is summed (None for any other: `is_checked` reads it again)."""
        value, num_bytes = self.running.get(index, (0, 0))
        return value if self.num_data[index] == 1 and num_bytes == offset else None

    def is_checked(self, index: int) -> bool:
        expected = self.block_checksums.get(index)
        if expected is None:
            return False
        value, num_bytes = self.running.get(index, (0, -1))
        if num_bytes != self.block_bytes:
            value = checksum(memoryview(self.data[index])[: self.block_bytes])
        return value == expected


class LandingSums:
    """A chunk's slices summed as they land: called by the thread that received them, in order (mesh.lane_io's
    `landed`), it writes only its own sums (one C call per slice while the bytes are in cache); `commit` adds them
    to the blocks' running checksums once the whole chunk is in (the stream's task)."""

    def __init__(self, buffers: StreamBuffers, indices: list[int], offset: int) -> None:
        self.buffers = buffers
        self.indices = indices  # the block of each slice
        self.offset = offset  # where every slice lies in its block
        self.sums = [buffers.running_sum(index, offset) for index in indices]  # None: a slice not summed
        self.num_bytes = [0] * len(indices)

    def __call__(self, n: int, data: memoryview) -> None:
        value = self.sums[n]
        if value is not None:
            self.sums[n] = checksum_more(data, value)
            self.num_bytes[n] += len(data)

    def commit(self) -> None:
        for index, value, num_bytes in zip(self.indices, self.sums, self.num_bytes, strict=True):
            if value is not None:
                self.buffers.running[index] = (value, self.offset + num_bytes)


class LayerStream:
    """One planned read (StoreClient.plan_stream). `run` feeds a load of its first `num_blocks` blocks."""

    def __init__(
        self,
        client: FragmentReader,
        model: str,
        block_hashes: list[bytes],
        plan: list[list[Source]],
        num_data: list[int],
    ) -> None:
        self.client = client
        self.model = model
        self.block_hashes = block_hashes
        self.plan = plan
        self.num_data = num_data

    async def run(self, layout: KVLayout, num_blocks: int, write_layer: WriteLayer) -> bool:
        """Stream, writing layers as they complete; True once every layer of every block is written."""
        keys = self.block_hashes[:num_blocks]
        buffers = StreamBuffers(layout, self.num_data[:num_blocks], self.client.read_buffers)
        done = await self._stream(layout, keys, buffers, write_layer)
        self.client.read_buffers.give(buffers.data)  # not after an exception: a pull may not have stopped yet
        return done

    async def _stream(
        self, layout: KVLayout, keys: list[bytes], buffers: StreamBuffers, write_layer: WriteLayer
    ) -> bool:
        num_blocks = len(keys)
        written = 0

        def advance(limit: int) -> None:
            nonlocal written
            while written < limit and buffers.is_layer_ready(written):
                write_layer(written, buffers.layer(written))
                written += 1

        slice_bytes = slice_bytes_for(layout, num_blocks)
        by_node: dict[str, list[tuple[int, int]]] = {}  # node -> (block index, fragment index)
        for index, sources in enumerate(self.plan[:num_blocks]):
            for source in sources:
                by_node.setdefault(source.node, []).append((index, source.fragment_index))
        nodes, lanes = self.client.nodes(), self.client.lane_addresses()
        expected = layout_to_proto(layout)
        await asyncio.gather(
            *(
                (
                    self._pull_lane(
                        lanes[node], keys, items, slice_bytes, buffers, expected, lambda: advance(layout.num_layers - 1)
                    )
                    if node in lanes
                    else self._pull(
                        nodes.get(node, ""),
                        keys,
                        items,
                        slice_bytes,
                        buffers,
                        expected,
                        lambda: advance(layout.num_layers - 1),
                    )
                )
                for node, items in by_node.items()
            )
        )
        missing = [i for i in range(num_blocks) if buffers.prefix(i) < buffers.block_bytes or not buffers.is_checked(i)]
        if missing and not await self._fill_whole(keys, missing, buffers):
            return False
        advance(layout.num_layers)  # every block checked: the last layer may go
        return written == layout.num_layers

    def _get_request(
        self, keys: list[bytes], items: list[tuple[int, int]], slice_bytes: int
    ) -> tuple[dict[bytes, tuple[int, int]], kvcache_pb2.GetRequest]:
        """What to ask a node for `items` ((block index, fragment index) pairs), and where each answer goes."""
        positions = {keys[index]: (index, fragment) for index, fragment in items}
        request = kvcache_pb2.GetRequest(
            block_hashes=[keys[i] for i, _ in items], model=self.model, skip_missing=True, slice_bytes=slice_bytes
        )
        return positions, request

    async def _pull(
        self,
        address: str,
        keys: list[bytes],
        items: list[tuple[int, int]],
        slice_bytes: int,
        buffers: StreamBuffers,
        expected: object,
        on_data: Callable[[], None],
    ) -> bool:
        if not address:
            return False
        positions, request = self._get_request(keys, items, slice_bytes)
        headers: list[tuple[int, int]] = []  # (block index, fragment index), in the node's order
        call = self.client.stub(address).Get(request, timeout=self.client.timeout_s, metadata=rpc.metadata())
        try:
            async for message in call:
                if message.HasField("layout"):  # a header
                    index, fragment = positions.get(message.block_hash, (-1, -1))
                    if index < 0 or message.fragment_index != fragment or message.layout != expected:
                        call.cancel()
                        return False  # not what was planned: the detour reads it whole
                    buffers.block_checksums[index] = message.block_checksum
                    headers.append((index, fragment))
                    continue
                data = message.data  # each access to a bytes field copies it (upb): once
                view, position = memoryview(data), 0
                for index, fragment in headers[message.first_block :]:
                    if position >= len(view):
                        break
                    size = max(0, min(slice_bytes, buffers.fragment_bytes(index) - message.offset))
                    buffers.put(index, fragment, message.offset, view[position : position + size])
                    position += size
                metrics.KV_TRANSFER_BYTES.labels(direction="store_get").inc(len(data))
                on_data()
        except grpc.aio.AioRpcError as exc:
            store_failed("get", address, exc)
            return False
        return len(headers) == len(items)

    async def _pull_lane(
        self,
        address: str,
        keys: list[bytes],
        items: list[tuple[int, int]],
        slice_bytes: int,
        buffers: StreamBuffers,
        expected: object,
        on_data: Callable[[], None],
    ) -> bool:
        """`_pull` over the node's bulk lane: each chunk's slices are received straight into their blocks."""
        positions, request = self._get_request(keys, items, slice_bytes)
        headers: list[tuple[int, int]] = []  # (block index, fragment index), in the node's order
        try:
            async with asyncio.timeout(self.client.timeout_s), self.client.lanes.connection(address) as sock:
                async for block, payload_bytes in lane.read_answer(sock, request):
                    if block.HasField("layout"):  # a header
                        index, fragment = positions.get(block.block_hash, (-1, -1))
                        if payload_bytes or index < 0 or block.fragment_index != fragment or block.layout != expected:
                            raise lane.LaneError("not what was planned")  # the detour reads it whole
                        buffers.block_checksums[index] = block.block_checksum
                        headers.append((index, fragment))
                        continue
                    regions = []  # (index, fragment, end): where this chunk's slices go, in order
                    remaining = payload_bytes
                    for index, fragment in headers[block.first_block :]:
                        if not remaining:
                            break
                        size = max(0, min(slice_bytes, buffers.fragment_bytes(index) - block.offset))
                        if size > remaining:
                            raise lane.LaneError("a chunk ends inside a block's slice")
                        regions.append((index, fragment, block.offset + size))
                        remaining -= size
                    if remaining:
                        raise lane.LaneError("a chunk holds more than its blocks' slices")
                    landed = LandingSums(buffers, [i for i, _, _ in regions], block.offset)
                    await lane.recv_exactly_into(
                        sock,
                        *(buffers.region(i, f, block.offset, end - block.offset) for i, f, end in regions),
                        landed=landed,
                    )
                    landed.commit()
                    for index, fragment, end in regions:
                        buffers.mark(index, fragment, end)
                    metrics.KV_TRANSFER_BYTES.labels(direction="store_get").inc(payload_bytes)
                    on_data()
        except (OSError, TimeoutError, lane.LaneError) as exc:
            metrics.PREFILL_STORE_ERRORS.labels(op="lane").inc()
            log.warning("KV store lane read failed; the detour reads the rest whole", node=address, error=str(exc))
            return False
        return len(headers) == len(items)

    async def _fill_whole(self, keys: list[bytes], missing: list[int], buffers: StreamBuffers) -> bool:
        """The detour: read the missing blocks whole from any live holders (decoding parity), then check them; a
        block in another layout (another model's or block format's bytes under the key) fails it."""
        nodes = self.client.nodes()
        wanted = [keys[i] for i in missing]
        sources, _ = self.client.sources_from_index(wanted, nodes)
        if len(sources) < len(wanted):
            return False
        fetched: dict[bytes, Fetched] = await self.client.read_planned(self.model, wanted, sources, nodes)
        for index, key in zip(missing, wanted, strict=True):
            blocks = await asyncio.to_thread(assemble, [key], fetched)
            if not blocks or blocks[0].layout != buffers.layout:
                return False
            buffers.put_whole(index, blocks[0].data)
            buffers.block_checksums[index] = checksum(blocks[0].data)
        return True
