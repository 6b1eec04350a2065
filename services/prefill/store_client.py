"""The KV store as a prefill worker sees it: nodes heard on NATS, each block key on its rendezvous owner.

`StoreClient` reads (Lookup, then Get of the consecutive hits) and writes (Put, batched per node). A store
that fails, times out or is unreachable is a miss, never a failed request: errors are logged and counted.
`StoreWriter` puts newly computed blocks in the background from a bounded queue, never making anyone wait.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Iterator, Sequence

import grpc.aio

from mesh import metrics, rpc
from mesh.discovery import WorkerRegistry
from mesh.logging import get_logger
from mesh.pb import common_pb2, kvcache_pb2, kvcache_pb2_grpc
from mesh.placement import rendezvous_owner
from services.compute.convert import layout_from_proto, layout_to_proto
from services.prefill.prefiller import StoreBlock

log = get_logger(__name__)


def block_to_proto(block: StoreBlock) -> kvcache_pb2.Block:
    return kvcache_pb2.Block(block_hash=block.block_hash, parent_hash=block.parent_hash,
                             layout=layout_to_proto(block.layout), data=block.data)


def block_from_proto(block: kvcache_pb2.Block) -> StoreBlock:
    return StoreBlock(block.block_hash, block.parent_hash, layout_from_proto(block.layout), block.data)


def group_by_owner(keys: Sequence[bytes], owners: Sequence[str]) -> dict[str, list[bytes]]:
    """Each node's keys, in their original order."""
    groups: dict[str, list[bytes]] = {}
    for key, owner in zip(keys, owners):
        groups.setdefault(owner, []).append(key)
    return groups


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
    def __init__(self, registry: WorkerRegistry, channels: rpc.Channels,
                 timeout_s: float = rpc.KVCACHE_TIMEOUT_S) -> None:
        self.registry = registry
        self.channels = channels
        self.timeout_s = timeout_s

    def nodes(self) -> dict[str, str]:
        """Live store nodes: worker id -> address. Placement is by worker id (stable across restarts)."""
        return {w.worker_id: w.info.address for w in self.registry.workers(common_pb2.ROLE_KVCACHE)}

    def is_available(self) -> bool:
        return bool(self.nodes())

    def _stub(self, address: str) -> kvcache_pb2_grpc.KVCacheStub:
        return kvcache_pb2_grpc.KVCacheStub(self.channels.get(address))

    # -- reads ----------------------------------------------------------------------------------------
    async def fetch(self, model: str, block_hashes: Sequence[bytes]) -> list[StoreBlock]:
        """The stored blocks for the first keys, in order, up to the first miss. Never raises."""
        nodes = self.nodes()
        if not nodes or not block_hashes:
            return []
        owners = [rendezvous_owner(key, list(nodes)) for key in block_hashes]
        groups = group_by_owner(block_hashes, owners)
        hits = await asyncio.gather(*(self._lookup(nodes[n], model, keys) for n, keys in groups.items()))
        num_stored = stored_prefix_length(owners, dict(zip(groups, hits)))
        wanted = group_by_owner(block_hashes[:num_stored], owners[:num_stored])
        fetched = await asyncio.gather(*(self._get(nodes[n], model, keys) for n, keys in wanted.items()))
        found = {block.block_hash: block for blocks in fetched for block in blocks}
        result = []
        for key in block_hashes[:num_stored]:  # a block evicted between Lookup and Get ends the prefix
            if key not in found:
                break
            result.append(found[key])
        return result

    async def _lookup(self, address: str, model: str, keys: list[bytes]) -> int:
        try:
            response = await self._stub(address).Lookup(kvcache_pb2.LookupRequest(block_hashes=keys, model=model),
                                                        timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            _store_failed("lookup", address, exc)
            return 0
        return min(response.num_hits, len(keys))

    async def _get(self, address: str, model: str, keys: list[bytes]) -> list[StoreBlock]:
        blocks: list[StoreBlock] = []
        try:
            async for block in self._stub(address).Get(kvcache_pb2.GetRequest(block_hashes=keys, model=model),
                                                        timeout=self.timeout_s):
                blocks.append(block_from_proto(block))
                metrics.KV_TRANSFER_BYTES.labels(direction="store_get").inc(len(block.data))
        except grpc.aio.AioRpcError as exc:
            _store_failed("get", address, exc)  # the blocks that did arrive are still a good prefix
        return blocks

    # -- writes ---------------------------------------------------------------------------------------
    async def put(self, blocks: Sequence[StoreBlock]) -> None:
        """Each block to its owner, one Put stream per node, in parallel. Never raises."""
        nodes = self.nodes()
        if not nodes:
            return
        by_node: dict[str, list[StoreBlock]] = {}
        for block in blocks:
            by_node.setdefault(rendezvous_owner(block.block_hash, list(nodes)), []).append(block)
        await asyncio.gather(*(self._put(nodes[n], node_blocks) for n, node_blocks in by_node.items()))

    async def _put(self, address: str, blocks: list[StoreBlock]) -> None:
        try:
            await self._stub(address).Put(iter([block_to_proto(b) for b in blocks]), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            _store_failed("put", address, exc)
            return
        metrics.KV_TRANSFER_BYTES.labels(direction="store_put").inc(sum(len(b.data) for b in blocks))


def _store_failed(op: str, address: str, exc: grpc.aio.AioRpcError) -> None:
    metrics.PREFILL_STORE_ERRORS.labels(op=op).inc()
    log.warning("KV store call failed; treated as a miss", op=op, node=address, code=exc.code().name,
                details=exc.details())


class StoreWriter:
    """Blocks waiting to be put, bounded by bytes. Only the event loop touches the queue; `is_accepting` is
    written by the writer's task and read by engine threads (to skip copying blocks nobody would put)."""

    def __init__(self, client: StoreClient, max_queued_bytes: int, max_batch_bytes: int = 16 * 2**20,
                 refresh_s: float = 0.25, max_defer_s: float = 0.5) -> None:
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
