"""Repair: bring erasure-coded blocks back to k+m fragments on live nodes after a node is lost or replaced.

Every node runs the same loop over the fragments it holds. For each one, the global index (JetStream replay)
says which nodes hold which fragments of the block, and heartbeats say which nodes are live. A block with a
fragment on a node that is gone (and on no live node) is under-protected. (A fragment a live node evicted is not
lost: the block is on its way out of the cache, and rebuilding it would fight the eviction policy.) Exactly one
node acts on it, the leader: the first of the live holders in the block's rendezvous order, so every node agrees
without talking. Once the block has been
under-protected for `delay_s` (a restarting node with its SSD intact comes back with its fragments and needs no
repair), the leader fetches k fragments (its own and others'), decodes the block, checks the whole block's
checksum, re-encodes the missing fragments and puts each on a live node that holds none of the block, in
rendezvous order. With no such node (3 nodes, 2+1, one gone) the block stays readable but under-protected until
a node joins or returns; then the next round places the fragment there.

Blocks are repaired most valuable first (`mesh.protection_price.repair_rank`): those their writer gave more
parity, because it priced their loss higher; at most MAX_REPAIRS_PER_ROUND a round.

A briefly stale index costs a wasted round or a duplicate fragment (an extra copy), never a wrong block:
fragments are checked against their checksums before decoding, the block against its own after.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import grpc.aio

from mesh import erasure, metrics, rpc
from mesh.discovery import WorkerRegistry
from mesh.kv_blocks import checksum
from mesh.kv_index import GlobalKVIndex
from mesh.kv_stream import KVEventFollower
from mesh.logging import get_logger
from mesh.pb import common_pb2, kvcache_pb2, kvcache_pb2_grpc
from mesh.placement import rank_nodes
from mesh.protection_price import repair_rank
from services.kvcache.blocks import Block, Fragment
from services.kvcache.codec import block_from_pb, block_to_pb
from services.kvcache.store import BlockStore

MAX_REPAIRS_PER_ROUND = 512
log = get_logger(__name__)


@dataclass(frozen=True)
class RepairTask:
    key: bytes
    meta: Block  # this node's fragment, without data
    sources: dict[int, str]  # fragment index -> a live node holding it (this node included)
    targets: dict[int, str]  # missing fragment index -> the node to put it on


class Repairer:
    def __init__(
        self,
        worker_id: str,
        store: BlockStore,
        index: GlobalKVIndex,
        registry: WorkerRegistry,
        channels: rpc.Channels,
        delay_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.worker_id = worker_id
        self.store = store
        self.index = index  # read only here
        self.registry = registry
        self.channels = channels
        self.delay_s = delay_s
        self.clock = clock
        self.num_under_protected = 0  # blocks this node leads with a fragment lost with a node
        self._since: dict[bytes, float] = {}  # key -> when it was first seen under-protected

    def live_nodes(self) -> dict[str, str]:
        nodes = {w.worker_id: w.info.address for w in self.registry.workers(common_pb2.ROLE_KVCACHE)}
        nodes.setdefault(self.worker_id, "")
        return nodes

    def plan(self) -> list[RepairTask]:
        """What to repair now; counts the under-protected blocks this node leads."""
        live = self.live_nodes()
        now = self.clock()
        tasks: list[RepairTask] = []
        under: dict[bytes, float] = {}
        for key in list(self.store.host.keys()) + (list(self.store.ssd.keys()) if self.store.ssd else []):
            if key in under:
                continue
            task = self._plan_key(key, live)
            if task is None:
                continue
            under[key] = self._since.get(key, now)
            if task.targets and now - under[key] >= self.delay_s:
                tasks.append(task)
        self._since = under
        self.num_under_protected = len(under)
        tasks.sort(key=lambda task: repair_rank(task.meta.fragment.protection))
        return tasks[:MAX_REPAIRS_PER_ROUND]

    def _plan_key(self, key: bytes, live: dict[str, str]) -> RepairTask | None:
        """None when the block is fully protected, whole (not coded), or another node leads it."""
        meta = self.store.host.meta(key) or (self.store.ssd.meta(key) if self.store.ssd else None)
        if meta is None or meta.fragment.is_whole:
            return None
        everywhere = {w: h.fragment_index for w, h in self.index.holders(key).items()}
        everywhere[self.worker_id] = meta.fragment.index  # the index may lag this node's own events
        holders = {w: index for w, index in everywhere.items() if w in live}
        # only fragments that went with a node count as lost: one a live node evicted went out with the cache
        lost = {index for w, index in everywhere.items() if w not in live} - set(holders.values())
        if not lost or rank_nodes(key, list(holders))[0] != self.worker_id:
            return None
        sources = {index: worker for worker, index in sorted(holders.items())}
        free = [w for w in rank_nodes(key, list(live)) if w not in holders]
        targets = dict(zip(sorted(lost), free, strict=False))  # fewer free nodes than lost fragments: what fits
        return RepairTask(key, meta.without_data(), sources, targets)

    async def run_forever(self, interval_s: float, follower: KVEventFollower) -> None:
        await follower.wait_caught_up(timeout_s=600)
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.repair_once()
            except Exception:
                log.warning("repair round failed", exc_info=True)

    async def repair_once(self) -> int:
        tasks = self.plan()
        metrics.KVCACHE_UNDER_PROTECTED.set(self.num_under_protected)
        num_repaired = 0
        for task in tasks:
            if await self._repair(task):
                num_repaired += len(task.targets)
        if num_repaired:
            metrics.KVCACHE_REPAIRED_FRAGMENTS.inc(num_repaired)
            log.info("fragments repaired", num_fragments=num_repaired, num_blocks=len(tasks))
        return num_repaired

    async def _repair(self, task: RepairTask) -> bool:
        fragment = task.meta.fragment
        pieces = await self._gather(task)
        if len(pieces) < fragment.num_data:
            return False
        num_block_bytes = task.meta.layout.num_block_bytes
        data = erasure.decode(pieces, fragment.num_data, fragment.num_total, num_block_bytes)
        if checksum(data) != task.meta.block_checksum:
            log.warning("repair: decoded block fails its checksum", block_hash=task.key.hex()[:16])
            return False
        fragments = erasure.encode(data, fragment.num_data, fragment.num_total)
        live = self.live_nodes()
        results = await asyncio.gather(
            *(
                self._put(
                    live[node],
                    replace(
                        task.meta,
                        data=fragments[index],
                        checksum=checksum(fragments[index]),
                        fragment=Fragment(index, fragment.num_data, fragment.num_total),
                    ),
                )
                for index, node in task.targets.items()
            )
        )
        return all(results)

    async def _gather(self, task: RepairTask) -> dict[int, bytes]:
        """k checked fragments: this node's first, then others' (data fragments first)."""
        need = task.meta.fragment.num_data
        pieces: dict[int, bytes] = {}
        own = self.store.peek(task.key)
        if own is not None:
            pieces[own.fragment.index] = own.data
        live = self.live_nodes()
        for index, node in sorted(task.sources.items()):
            if len(pieces) >= need:
                break
            if index in pieces or node == self.worker_id or node not in live:
                continue
            block = await self._get(live[node], task)
            if block is not None and block.fragment.index == index and checksum(block.data) == block.checksum:
                pieces[index] = block.data
        return pieces

    async def _get(self, address: str, task: RepairTask) -> Block | None:
        stub = kvcache_pb2_grpc.KVCacheStub(self.channels.get(address))
        request = kvcache_pb2.GetRequest(block_hashes=[task.key], model=task.meta.layout.model)
        try:
            async for message in stub.Get(request, timeout=rpc.KVCACHE_TIMEOUT_S):
                return block_from_pb(message)
        except (grpc.aio.AioRpcError, ValueError) as exc:
            log.warning("repair: fragment fetch failed", node=address, error=str(exc))
        return None

    async def _put(self, address: str, block: Block) -> bool:
        stub = kvcache_pb2_grpc.KVCacheStub(self.channels.get(address))
        try:
            await stub.Put(iter([block_to_pb(block)]), timeout=rpc.KVCACHE_TIMEOUT_S)
            return True
        except grpc.aio.AioRpcError as exc:
            log.warning("repair: fragment put failed", node=address, code=exc.code().name)
            return False
