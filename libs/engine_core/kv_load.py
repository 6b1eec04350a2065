"""Layer-by-layer KV loads: blocks enter the prefix cache before their KV has arrived (from a KV store), and the
forward pass waits, layer by layer, only for the layers it is about to read, so compute overlaps the transfer.

    load = engine.loads.begin(parent_hash, block_hashes, token_ids)   # engine thread (with add_request)
    engine.loads.write_layer(load, layer, data)                        # any thread, layer 0 first
    engine.loads.fail(load)                                            # any thread: the data will not come

`LayerLoads` is owned by the engine. `begin` holds a reference on the blocks until the load is over, so nothing
evicts or reuses them while bytes are still being written. A step whose requests use a pending load's blocks
passes `wait_for_layer` to the forward pass; it returns once every such load has written that layer and raises
`KVLoadFailed` when one failed or ran past its deadline. The engine then drops the failed load's blocks from the
prefix cache, sends the requests that used them back to waiting (they recompute from scratch), and retries the
step for the others: the interrupted step changed no request's state, and rewriting the same tokens' KV into the
same slots is harmless. Loaded KV is never used unchecked: the loader writes the last layer only after every
block's checksum held, so a step that reads bad bytes cannot finish.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from engine_core.kv_cache.block_pool import BlockPool, KVBlock
from engine_core.kv_transfer import KVLayout

DEFAULT_TIMEOUT_S = 30.0


class KVLoadFailed(RuntimeError):
    """A layer the forward pass needs will not arrive (the load failed or timed out)."""


@dataclass(eq=False)
class LayerLoad:
    blocks: list[KVBlock]  # held (one reference) until the load is over
    num_layers: int
    deadline: float  # time.monotonic() after which waiting fails
    block_ids: frozenset[int] = field(init=False)
    num_layers_done: int = 0  # layers [0, num_layers_done) are written; written under LayerLoads' lock
    failed: bool = False

    def __post_init__(self) -> None:
        self.block_ids = frozenset(b.block_id for b in self.blocks)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def is_done(self) -> bool:
        return self.failed or self.num_layers_done >= self.num_layers


# (layer, block ids, each block's bytes of the layer, their format): the model runner's write_stored_layer
WriteLayer = Callable[[int, list[int], Sequence[bytes | bytearray | memoryview], KVLayout], None]


class LayerLoads:
    def __init__(
        self, pool: BlockPool, layout: KVLayout, write_layer: WriteLayer, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> None:
        self.pool = pool
        self.layout = layout  # the blocks' format (engine_core.kv_transfer: how a block's bytes fill the cache)
        self.write = write_layer  # puts a layer of the loads' blocks into the KV cache (the runner owns it)
        self.timeout_s = timeout_s
        self._pending: list[LayerLoad] = []  # engine thread only
        self._changed = threading.Condition()

    @property
    def pending(self) -> list[LayerLoad]:
        return list(self._pending)

    # -- engine thread --------------------------------------------------------------------------------------
    def begin(self, parent_hash: bytes, block_hashes: Sequence[bytes], token_ids: Sequence[int]) -> LayerLoad:
        """Allocate and cache blocks for `block_hashes` (as many as are free), their KV still to come."""
        count = min(len(block_hashes), self.pool.num_free_blocks)
        blocks = self.pool.allocate(count)
        block_size = self.layout.block_size
        self.pool.cache_blocks(blocks, block_hashes[:count], parent_hash, token_ids[: count * block_size], block_size)
        load = LayerLoad(blocks, self.layout.num_layers, time.monotonic() + self.timeout_s)
        if count:
            self._pending.append(load)
        else:
            load.num_layers_done = load.num_layers
        return load

    def waiter(self, block_tables: Sequence[Sequence[int]]) -> Callable[[int], None] | None:
        """For a step whose requests hold `block_tables`: the forward pass's wait for the pending loads they read
        (None when they read none, so unrelated steps never wait)."""
        used = [load for load in self._pending if any(load.block_ids.intersection(t) for t in block_tables)]
        if not used:
            return None
        return lambda layer: self.wait_for_layer(layer, used)

    def wait_for_layer(self, layer: int, loads: Sequence[LayerLoad]) -> None:
        """Block until every one of `loads` has written `layer`; KVLoadFailed when one will not."""
        with self._changed:
            for load in loads:
                while load.num_layers_done <= layer and not load.failed:
                    remaining = load.deadline - time.monotonic()
                    if remaining <= 0:
                        load.failed = True
                        break
                    self._changed.wait(remaining)
                if load.failed:
                    raise KVLoadFailed(f"layer {layer} of {load.num_blocks} loaded block(s) will not arrive")

    def release_done(self) -> None:
        """Give back the hold of loads that are over; failed ones also leave the prefix cache."""
        for load in [load for load in self._pending if load.is_done]:
            self._pending.remove(load)
            if load.failed:
                self.pool.uncache(load.blocks)
            self.pool.free(reversed(load.blocks))

    def failed_block_ids(self) -> frozenset[int]:
        return frozenset(i for load in self._pending if load.failed for i in load.block_ids)

    # -- any thread (the loader) ----------------------------------------------------------------------------
    def write_layer(self, load: LayerLoad, layer: int, pieces: Sequence[bytes | bytearray | memoryview]) -> None:
        """Write one layer of every block of the load: `pieces[i]` is block i's bytes of that layer, as a KV store
        block holds them (layer-major within the block: layout.layer_offsets())."""
        assert layer == load.num_layers_done, f"layer {layer} written out of order (next is {load.num_layers_done})"
        assert len(pieces) == load.num_blocks
        if load.failed:
            return
        self.write(layer, [b.block_id for b in load.blocks], pieces, self.layout)
        with self._changed:
            load.num_layers_done = layer + 1
            self._changed.notify_all()

    def fail(self, load: LayerLoad) -> None:
        with self._changed:
            if load.num_layers_done < load.num_layers:
                load.failed = True
            self._changed.notify_all()
