"""The KV store as a prefill worker sees it: nodes heard on NATS, each block's fragments on its rendezvous nodes.

`StoreClient` writes each block as k+m fragments (erasure coding, `mesh.erasure`; 1+0 is a whole block on one
node) on the block's first k+m nodes in rendezvous order, and reads a prefix back. Reads go straight to the nodes
the global KV index (JetStream replay, `mesh.kv_index`) says hold each block, preferring data fragments (no
decoding) and host memory; a prefix the index says is not stored costs no call at all. Until the index has caught
up, reads probe the rendezvous nodes with Lookup first. Every fragment is checked against its checksum and every
decoded block against the whole block's before use, so a stale index or a bad node costs a miss, never wrong KV.
A store that fails, times out or is unreachable is a miss, never a failed request: errors are logged and counted.
`StoreWriter` puts newly computed blocks in the background from a bounded queue, never making anyone wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence

import grpc.aio

from mesh import erasure, lane, metrics, rpc
from mesh.bus import Bus
from mesh.discovery import WorkerRegistry
from mesh.kv_blocks import checksum, layout_to_proto
from mesh.kv_index import GlobalKVIndex
from mesh.kv_stream import KVEventFollower
from mesh.lane import BufferPool, LanePool
from mesh.logging import get_logger
from mesh.pb import common_pb2, kvcache_pb2, kvcache_pb2_grpc
from mesh.placement import rank_nodes
from mesh.protection_price import PricedProtection, ReuseBook, assign
from mesh.tasks import cancel_until_done
from services.prefill.prefiller import StoreBlock
from services.prefill.store_reads import Fetched, Source, assemble, is_complete, plan_reads, store_failed
from services.prefill.store_stream import LayerStream

log = get_logger(__name__)
MAX_REMEMBERED_CLASSES = 1 << 16
WHOLE_BLOCKS = erasure.Protection()  # 1+0: each block whole on one node (frozen, so one default for all)


PutFragment = tuple[kvcache_pb2.Block, bytes]  # a Put message without its data, and the data


def fragments_of(block: StoreBlock, protection: erasure.Protection, traffic_class: str) -> list[PutFragment]:
    """The block's k+m fragments, each with its own checksum and the whole block's."""
    k, n = protection.num_data, protection.num_total
    layout = layout_to_proto(block.layout)
    block_checksum = checksum(block.data)
    coded = n > 1
    return [
        (
            kvcache_pb2.Block(
                block_hash=block.block_hash,
                parent_hash=block.parent_hash,
                layout=layout,
                checksum=checksum(data) if coded else block_checksum,
                block_checksum=block_checksum,
                fragment_index=index,
                num_data_fragments=k if coded else 0,
                num_fragments=n if coded else 0,
                traffic_class=traffic_class,
            ),
            data,
        )
        for index, data in enumerate(erasure.encode(block.data, k, n))
    ]


def with_data(header: kvcache_pb2.Block, data: bytes) -> kvcache_pb2.Block:
    message = kvcache_pb2.Block()
    message.CopyFrom(header)
    message.data = data
    return message


def stored_prefix_length(owners: Sequence[str], num_hits: dict[str, int]) -> int:
    """How many keys from the first are stored, given each node's hit count over its own keys in order.

    A key is stored while it is among the first `num_hits[owner]` of its owner's keys; past a node's first
    miss the global prefix has ended anyway, so nothing beyond it matters.
    """
    seen: dict[str, int] = {}
    for index, owner in enumerate(owners):
        if seen.get(owner, 0) >= num_hits.get(owner, 0):
            return index
        seen[owner] = seen.get(owner, 0) + 1
    return len(owners)


class StoreClient:
    def __init__(
        self,
        registry: WorkerRegistry,
        channels: rpc.Channels,
        timeout_s: float = rpc.KVCACHE_TIMEOUT_S,
        protection: erasure.Protection = WHOLE_BLOCKS,
        use_index: bool = True,
        stream_layers: bool = True,
        use_lanes: bool = True,
        read_buffer_bytes: int = 512 * 2**20,
        lane_tls: ssl.SSLContext | None = None,
        priced: PricedProtection | None = None,
    ) -> None:
        self.registry = registry
        self.channels = channels
        self.timeout_s = timeout_s
        self.protection = protection  # every block's level, unless priced
        # each block's level from its recompute price, within the plan's budget over each batch written (priced
        # protection, mesh.protection_price); None: `protection` for all
        self.priced = priced
        self.prices = ReuseBook()  # written only by note_prompt
        self.index = GlobalKVIndex()  # written only by the follower
        self.follower: KVEventFollower | None = None
        self._starting: asyncio.Task[None] | None = None  # the follower's start while the stream does not exist
        self.use_index = use_index
        self.stream_layers = stream_layers  # read layer-major into the engine while it computes (store_stream.py)
        self.use_lanes = use_lanes  # ... over the nodes' bulk lanes where they have one (mesh.lane), else gRPC
        self.lanes = LanePool(ssl_context=lane_tls)  # mutual TLS unless the mesh runs insecure
        self.read_buffers = BufferPool(read_buffer_bytes)
        self._classes: OrderedDict[bytes, str] = OrderedDict()  # block key -> traffic class of its request

    async def start(self, bus: Bus) -> None:
        """Follow the KV event stream (store tiers only) into the index: replay, then live. Prefill only reads the
        stream: until its owners (store nodes, balancers) have made it, reads probe the nodes (Lookup) and the
        follower starts in the background once it exists."""
        if self.use_index:
            follower = KVEventFollower(bus, self.index, tiers=frozenset({"host", "ssd"}), create=False)
            try:
                await follower.start()
            except Exception as exc:
                log.warning("KV store reads go without the global index until its stream exists", error=str(exc))
                self._starting = asyncio.create_task(self._start_later(follower))
                return
            self.follower = follower

    async def _start_later(self, follower: KVEventFollower) -> None:
        await follower.start_eventually()
        self.follower = follower
        log.info("KV store reads follow the global index")

    async def stop(self) -> None:
        await cancel_until_done(self._starting)
        if self.follower is not None:
            await self.follower.stop()
        self.lanes.close()

    def nodes(self) -> dict[str, str]:
        """Live store nodes: worker id -> address. Placement is by worker id (stable across restarts)."""
        return {w.worker_id: w.info.address for w in self.registry.workers(common_pb2.ROLE_KVCACHE)}

    def lane_addresses(self) -> dict[str, str]:
        """Live store nodes with a bulk lane: worker id -> its address (empty when lanes are off)."""
        if not self.use_lanes:
            return {}
        return {
            w.worker_id: w.info.data_address
            for w in self.registry.workers(common_pb2.ROLE_KVCACHE)
            if w.info.data_address
        }

    def is_available(self) -> bool:
        return bool(self.nodes())

    def note_prompt(self, keys: Sequence[bytes], traffic_class: str) -> None:
        """A prompt's block keys in order and its request's class: when the blocks are written, the class sets
        their TTL and the prompt their price (depth, the chain below, uses)."""
        self.prices.note_prompt(keys)
        if not traffic_class:
            return
        for key in keys:
            self._classes[key] = traffic_class
            self._classes.move_to_end(key)
        while len(self._classes) > MAX_REMEMBERED_CLASSES:
            self._classes.popitem(last=False)

    def stub(self, address: str) -> kvcache_pb2_grpc.KVCacheStub:
        return kvcache_pb2_grpc.KVCacheStub(self.channels.get(address))

    # -- reads ----------------------------------------------------------------------------------------
    def plan_stream(self, model: str, block_hashes: Sequence[bytes]) -> LayerStream | None:
        """A layer-major read (store_stream.py) of the leading blocks the index says are stored, when all of them
        can be read from data fragments alone; else None (then `fetch`, which decodes parity: a lost node must cost
        no block)."""
        if not self.stream_layers or self.follower is None or not self.follower.is_caught_up:
            return None
        sources, num_data = self.sources_from_index(block_hashes, self.nodes())
        plan = plan_reads(sources, num_data)
        if not plan or any(s.fragment_index >= num_data[n] for n, chosen in enumerate(plan) for s in chosen):
            return None
        metrics.PREFILL_STORE_READS.labels(mode="stream").inc()
        return LayerStream(self, model, list(block_hashes[: len(plan)]), plan, num_data[: len(plan)])

    def stored(self, block_hashes: Sequence[bytes]) -> list[bool] | None:
        """Per key, whether a live node holds it by the index (None until the index has caught up): where it says
        no, `plan_stream` and `fetch` would find nothing, so prefill skips them and the engine call they need."""
        if self.follower is None or not self.follower.is_caught_up:
            return None
        nodes = self.nodes()
        return [any(worker in nodes for worker in self.index.holders(key)) for key in block_hashes]

    def note_skipped(self) -> None:
        metrics.PREFILL_STORE_READS.labels(mode="skipped").inc()

    def streams_layers(self) -> bool:
        """Whether `plan_stream` may return a stream now (it also needs every block readable from data fragments)."""
        return self.stream_layers and self.follower is not None and self.follower.is_caught_up

    async def fetch(self, model: str, block_hashes: Sequence[bytes]) -> list[StoreBlock]:
        """The stored blocks for the first keys, in order, up to the first miss. Never raises."""
        nodes = self.nodes()
        if not nodes or not block_hashes:
            return []
        if self.follower is not None and self.follower.is_caught_up:
            sources, num_data = self.sources_from_index(block_hashes, nodes)
            plan = plan_reads(sources, num_data)
            if not plan:
                metrics.PREFILL_STORE_READS.labels(mode="skipped").inc()
                return []
        else:
            sources, num_data = await self._sources_from_lookup(model, block_hashes, nodes)
            plan = plan_reads(sources, num_data)
            plan = [list(s) for s in sources[: len(plan)]]  # no tier or coding known: read every fragment
        if not plan:
            return []
        metrics.PREFILL_STORE_READS.labels(mode="fetch").inc()
        fetched = await self.read_planned(model, block_hashes, plan, nodes)
        spare = [[s for s in sources[i] if s not in plan[i]] for i in range(len(plan))]
        if any(not is_complete(fetched.get(key)) and spare[i] for i, key in enumerate(block_hashes[: len(plan)])):
            await self.read_planned(model, block_hashes, spare, nodes, fetched)  # one more round for the gaps
        return await asyncio.to_thread(assemble, block_hashes[: len(plan)], fetched)

    def sources_from_index(self, keys: Sequence[bytes], nodes: dict[str, str]) -> tuple[list[list[Source]], list[int]]:
        sources, num_data = [], []
        for key in keys:
            holders = self.index.holders(key)
            found = [Source(w, h.fragment_index, h.has_tier("host")) for w, h in sorted(holders.items()) if w in nodes]
            if not found:
                break  # the index says the prefix ends here: no call needed
            sources.append(found)
            num_data.append(self.index.coding(key).num_data)
        return sources, num_data

    async def _sources_from_lookup(
        self, model: str, keys: Sequence[bytes], nodes: dict[str, str]
    ) -> tuple[list[list[Source]], list[int]]:
        """Ask each key's first k+m rendezvous nodes which fragment they hold."""
        levels = self.priced.levels if self.priced is not None else (self.protection,)
        n = min(max(level.num_total for level in levels), len(nodes))
        asked: dict[str, list[int]] = {}
        for position, key in enumerate(keys):
            for node in rank_nodes(key, list(nodes))[:n]:
                asked.setdefault(node, []).append(position)
        answers = await asyncio.gather(
            *(self._lookup(nodes[node], model, [keys[p] for p in positions]) for node, positions in asked.items())
        )
        sources: list[list[Source]] = [[] for _ in keys]
        for (node, positions), indices in zip(asked.items(), answers, strict=True):
            for position, index in zip(positions, indices, strict=False):  # a node's extra answers: ignored
                if index >= 0:
                    sources[position].append(Source(node, index, False))
        k = min(level.num_data for level in levels)  # too few for a wider block: its assembly fails, a miss
        num_data = [1 if [s.fragment_index for s in found] == [0] else k for found in sources]
        return sources, num_data

    async def _lookup(self, address: str, model: str, keys: list[bytes]) -> list[int]:
        request = kvcache_pb2.LookupRequest(block_hashes=keys, model=model, per_block=True)
        try:
            response = await self.stub(address).Lookup(request, timeout=self.timeout_s, metadata=rpc.metadata())
        except grpc.aio.AioRpcError as exc:
            store_failed("lookup", address, exc)
            return [-1] * len(keys)
        indices = list(response.fragment_indices)
        return indices + [-1] * (len(keys) - len(indices))

    async def read_planned(
        self,
        model: str,
        keys: Sequence[bytes],
        plan: Sequence[Sequence[Source]],
        nodes: dict[str, str],
        fetched: dict[bytes, Fetched] | None = None,
    ) -> dict[bytes, Fetched]:
        fetched = {} if fetched is None else fetched
        by_node: dict[str, list[bytes]] = {}
        for key, sources in zip(keys, plan, strict=False):  # the plan may end before the keys
            for source in sources:
                by_node.setdefault(source.node, []).append(key)
        lanes = self.lane_addresses()
        await asyncio.gather(
            *(
                self._get_lane(lanes[node], model, node_keys, fetched)
                if node in lanes
                else self._get(nodes[node], model, node_keys, fetched)
                for node, node_keys in by_node.items()
            )
        )
        return fetched

    async def _get(self, address: str, model: str, keys: list[bytes], fetched: dict[bytes, Fetched]) -> None:
        request = kvcache_pb2.GetRequest(block_hashes=keys, model=model, skip_missing=True)
        try:
            async for message in self.stub(address).Get(request, timeout=self.timeout_s, metadata=rpc.metadata()):
                data = message.data  # each access to a bytes field copies it (upb): once
                message.ClearField("data")
                self._take(address, message, data, fetched)
        except grpc.aio.AioRpcError as exc:
            store_failed("get", address, exc)  # the fragments that did arrive are still good

    async def _get_lane(self, address: str, model: str, keys: list[bytes], fetched: dict[bytes, Fetched]) -> None:
        """`_get` over the node's bulk lane: each block's header, its bytes as the frame's payload."""
        request = kvcache_pb2.GetRequest(block_hashes=keys, model=model, skip_missing=True)
        try:
            async with asyncio.timeout(self.timeout_s), self.lanes.connection(address) as sock:
                async for block, payload_bytes in lane.read_answer(sock, request):
                    data = bytearray(payload_bytes)
                    await lane.recv_exactly_into(sock, memoryview(data))
                    self._take(address, block, bytes(data), fetched)
        except (OSError, TimeoutError, lane.LaneError) as exc:  # the fragments that did arrive are still good
            metrics.PREFILL_STORE_ERRORS.labels(op="get").inc()
            log.warning("KV store lane read failed; treated as a miss", node=address, error=str(exc))

    @staticmethod
    def _take(address: str, message: kvcache_pb2.Block, data: bytes, fetched: dict[bytes, Fetched]) -> None:
        """One fragment (or whole block) read, its header without the data: checked, then kept."""
        metrics.KV_TRANSFER_BYTES.labels(direction="store_get").inc(len(data))
        # a fragment is checked here; a whole block once, by `assemble`, against the block's checksum
        coded = message.num_fragments > 1
        if coded and message.HasField("checksum") and checksum(data) != message.checksum:
            metrics.PREFILL_STORE_ERRORS.labels(op="checksum").inc()
            log.warning(
                "store fragment fails its checksum; skipped", node=address, block_hash=message.block_hash.hex()[:16]
            )
            return
        entry = fetched.setdefault(message.block_hash, Fetched())
        entry.pieces[message.fragment_index] = data
        if entry.meta is None:
            entry.meta = message

    # -- writes ---------------------------------------------------------------------------------------
    async def put(self, blocks: Sequence[StoreBlock]) -> None:
        """Each block's fragments to its first k+m nodes, one Put stream per node, in parallel. Never raises."""
        nodes = self.nodes()
        if not nodes:
            return
        leveled = [
            (b, level) for b, level in zip(blocks, self.levels(blocks), strict=True) if level.num_data <= len(nodes)
        ]
        if len(leveled) < len(blocks):
            metrics.PREFILL_STORE_DROPPED_BLOCKS.inc(len(blocks) - len(leveled))  # too few nodes to hold k fragments
        if not leveled:
            return
        fragments = await asyncio.to_thread(self._encode, leveled, list(nodes))
        lanes = self.lane_addresses()
        await asyncio.gather(
            *(
                self._put_lane(lanes[n], node_fragments) if n in lanes else self._put(nodes[n], node_fragments)
                for n, node_fragments in fragments.items()
            )
        )

    def levels(self, blocks: Sequence[StoreBlock]) -> list[erasure.Protection]:
        """Each block's k+m: priced within the budget over these blocks, or `protection` for all."""
        if self.priced is None:
            return [self.protection] * len(blocks)
        prices = [self.prices.price(block.block_hash, block.layout.block_size) for block in blocks]
        return assign(prices, self.priced)

    def _encode(
        self, blocks: Sequence[tuple[StoreBlock, erasure.Protection]], nodes: list[str]
    ) -> dict[str, list[PutFragment]]:
        by_node: dict[str, list[PutFragment]] = {}
        for block, level in blocks:
            fragments = fragments_of(block, level, self._classes.get(block.block_hash, ""))
            for node, fragment in zip(rank_nodes(block.block_hash, nodes), fragments, strict=False):
                by_node.setdefault(node, []).append(fragment)  # fewer nodes than k+m: repair adds the rest later
        return by_node

    async def _put(self, address: str, fragments: list[PutFragment]) -> None:
        try:
            await self.stub(address).Put(
                (with_data(header, data) for header, data in fragments), timeout=self.timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            store_failed("put", address, exc)
            return
        metrics.KV_TRANSFER_BYTES.labels(direction="store_put").inc(sum(len(data) for _, data in fragments))

    async def _put_lane(self, address: str, fragments: list[PutFragment]) -> None:
        """`_put` over the node's bulk lane: each fragment's bytes go from where they lie, after its header."""
        try:
            async with asyncio.timeout(self.timeout_s), self.lanes.connection(address) as sock:
                for header, data in fragments:
                    await lane.send_frame(sock, kvcache_pb2.LaneFrame(block=header), [data])
                await lane.send_frame(sock, kvcache_pb2.LaneFrame(end=common_pb2.LaneEnd()))
                frame, payload_bytes = await lane.recv_frame(sock, kvcache_pb2.LaneFrame)
                if frame.WhichOneof("kind") != "put_response" or payload_bytes:
                    raise lane.LaneError(frame.end.error or "the node did not answer the write")
        except (OSError, TimeoutError, lane.LaneError) as exc:
            metrics.PREFILL_STORE_ERRORS.labels(op="put").inc()
            log.warning("KV store write failed; the blocks are not stored", node=address, error=str(exc))
            return
        metrics.KV_TRANSFER_BYTES.labels(direction="store_put").inc(sum(len(data) for _, data in fragments))

    async def pin(self, model: str, block_hashes: Sequence[bytes], ttl_s: float) -> int:
        """Pin the blocks on every node holding a fragment of them (0 unpins); returns fragments pinned."""
        request = kvcache_pb2.PinRequest(block_hashes=block_hashes, model=model, ttl_seconds=ttl_s)

        async def pin_on(address: str) -> int:
            try:
                return int((await self.stub(address).Pin(request, timeout=self.timeout_s)).num_pinned)
            except grpc.aio.AioRpcError as exc:
                store_failed("pin", address, exc)
                return 0

        return sum(await asyncio.gather(*(pin_on(address) for address in self.nodes().values())))


class StoreWriter:
    """Blocks waiting to be put, bounded by bytes. Only the event loop touches the queue; `is_accepting` is
    written by the writer's task and read by engine threads (to skip copying blocks nobody would put)."""

    def __init__(
        self,
        client: StoreClient,
        max_queued_bytes: int,
        max_batch_bytes: int = 16 * 2**20,
        refresh_s: float = 0.25,
        max_defer_s: float = 0.5,
    ) -> None:
        self.client = client
        self.max_defer_s = max_defer_s
        self.max_queued_bytes = max_queued_bytes
        self.max_batch_bytes = max_batch_bytes
        self.refresh_s = refresh_s
        self.is_accepting = False
        self._queue: deque[StoreBlock] = deque()
        self._num_queued_bytes = 0
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()  # nothing queued and no put in flight
        self._idle.set()
        self._num_critical = 0  # requests on their way to a first token; puts wait for them (a while)
        self._no_critical = asyncio.Event()
        self._no_critical.set()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.is_accepting = self.client.is_available()
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def offer(self, blocks: Sequence[StoreBlock]) -> None:
        """Queue blocks to put; when the queue is full they are dropped and counted (never wait)."""
        for block in blocks:
            if self._num_queued_bytes + len(block.data) > self.max_queued_bytes:
                metrics.PREFILL_STORE_DROPPED_BLOCKS.inc()
                continue
            self._queue.append(block)
            self._num_queued_bytes += len(block.data)
            self._idle.clear()
        self._wake.set()

    @contextlib.contextmanager
    def defer_while(self) -> Iterator[None]:
        """Around a request's critical path (store fetch, compute, KV push): puts are background work, and
        serialising megabytes of blocks on the same event loop would delay the push to decode. They wait at
        most `max_defer_s`, so a steady stream of requests cannot starve the store."""
        self._num_critical += 1
        self._no_critical.clear()
        try:
            yield
        finally:
            self._num_critical -= 1
            if self._num_critical == 0:
                self._no_critical.set()

    async def flush(self, timeout_s: float) -> bool:
        """Wait until every queued block was put (at shutdown); False at the timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.refresh_s)
            self._wake.clear()
            while self._queue:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._no_critical.wait(), self.max_defer_s)
                await self.client.put(self._take_batch())
            self._idle.set()
            self.is_accepting = self._num_queued_bytes < self.max_queued_bytes and self.client.is_available()

    def _take_batch(self) -> list[StoreBlock]:
        batch = [self._queue.popleft()]
        num_bytes = len(batch[0].data)
        while self._queue and num_bytes + len(self._queue[0].data) <= self.max_batch_bytes:
            batch.append(self._queue.popleft())
            num_bytes += len(batch[-1].data)
        self._num_queued_bytes -= num_bytes
        return batch
