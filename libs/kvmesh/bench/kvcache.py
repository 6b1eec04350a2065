"""`kvmesh bench kvcache`: replay a Mooncake trace's full prefix blocks through the real KV store (services.kvcache's
BlockStore, host tier, the chosen eviction policy) and report its hit rate against an unlimited cache's.

Each request, in trace order: probe how many of its blocks from the first the store holds (Lookup), read them (Get,
which is what a prefill worker does and what a policy sees as use), then write the rest (Put) as a chain. A hit
counts only as part of the leading prefix, exactly as an engine can use it. The store's clock is the trace's.
Blocks are tiny (one float32), so capacity is counted in blocks; the policy sees exactly the trace's key order.
"""

from __future__ import annotations

import heapq
import json
import time
from collections import OrderedDict
from collections.abc import Callable, Container, Sequence
from pathlib import Path
from typing import Any

from engine_core.kv_cache.block_pool import BlockPool
from kvmesh.bench import kvcache_trace
from mesh.eviction.policies import POLICIES, make_policy
from mesh.eviction.reuse import run_bucket
from mesh.kv_blocks import KVLayout, checksum
from services.kvcache.blocks import Block
from services.kvcache.store import BlockStore, StoreConfig

LAYOUT = KVLayout(model="trace", dtype="float32", block_size=512, num_layers=1, layer_shape=(1,), block_axis=0)
BLOCK_BYTES = LAYOUT.num_block_bytes
DATA = bytes(BLOCK_BYTES)
DATA_CHECKSUM = checksum(DATA)
ROOT = b"\xff" * 32  # no key_of(hash_id) is this: a chain's first block extends nothing the store holds


def load_trace(path: str | Path) -> list[tuple[float, list[int]]]:
    """(timestamp in seconds, the hash_ids of its full blocks) per request, in trace order; `generated` is
    `kvcache_trace`'s (whose blocks are all full).

    Full blocks only, the one rule every figure here (the replay, the ideal, the oracles) sees: a Mooncake
    hash_id is one 512-token block, and the last one covers `input_length % 512` tokens when that is not 0. A live
    prefill computes keys for full blocks only (engine_core's `hash_token_blocks`), so no store ever holds a partial
    block; replaying it would count a hit whenever the same prompt is sent again (1-9% of requests), one no live
    store gets. Not modelled: a prompt of an exact multiple of 512 tokens (26 of the two traces' 16,024
    requests) reads one block fewer than it writes, since the last prompt token is always computed."""
    if str(path) == kvcache_trace.NAME:
        return kvcache_trace.generate_trace()
    requests = []
    with open(path) as file:
        for line in file:
            if line.strip():
                record = json.loads(line)
                num_full = record["input_length"] // LAYOUT.block_size
                requests.append((record["timestamp"] / 1000.0, list(record["hash_ids"][:num_full])))
    return requests


def key_of(hash_id: int) -> bytes:
    return hash_id.to_bytes(8, "little") + bytes(24)


def ideal_hit_rate(requests: Sequence[tuple[float, list[int]]]) -> float:
    """An unlimited cache: a block hits when it was seen before (hash_ids chain, so its prefix was seen too)."""
    seen: set[int] = set()
    hits = total = 0
    for _, ids in requests:
        for hash_id in ids:
            hits += hash_id in seen
            seen.add(hash_id)
        total += len(ids)
    return hits / max(total, 1)


def _prefix_hit_rate(
    requests: Sequence[tuple[float, list[int]]], cached: Container[int], after: Callable[[int, int], None]
) -> float:
    """Hits counted as the store counts them (a request's blocks hit up to its first miss), over a cache that
    `after(position in the trace, hash_id)` updates once each block has been looked up."""
    hits = position = 0
    for _, ids in requests:
        leading = True
        for hash_id in ids:
            leading = leading and hash_id in cached
            hits += leading
            after(position, hash_id)
            position += 1
    return hits / max(position, 1)


def belady_hit_rate(requests: Sequence[tuple[float, list[int]]], capacity_blocks: int) -> float:
    """The offline optimum's neighbourhood: Belady's MIN (evict the block used again furthest in the future) with
    the same leading-prefix hits. No online policy can know the future; this says how much of the gap between a
    policy and the unlimited cache any policy could close at this capacity."""
    sequence = [hash_id for _, ids in requests for hash_id in ids]
    next_use = [0] * len(sequence)
    upcoming: dict[int, int] = {}
    for position in range(len(sequence) - 1, -1, -1):
        next_use[position] = upcoming.get(sequence[position], len(sequence))
        upcoming[sequence[position]] = position
    cached: dict[int, int] = {}  # hash_id -> its next use
    farthest: list[tuple[int, int]] = []  # (-next use, hash_id), stale entries skipped

    def store(position: int, hash_id: int) -> None:
        cached[hash_id] = next_use[position]
        heapq.heappush(farthest, (-next_use[position], hash_id))
        while len(cached) > capacity_blocks:
            negative_next, victim = heapq.heappop(farthest)
            if cached.get(victim) == -negative_next:
                del cached[victim]

    return _prefix_hit_rate(requests, cached, store)


def reuse_oracle_lru_hit_rate(requests: Sequence[tuple[float, list[int]]], capacity_blocks: int) -> float:
    """LRU told, for free, whether a block will ever be used again (it never stores one that will not): what
    perfect admission alone is worth. Belady's gap beyond it is knowing *when* blocks come back."""
    sequence = [hash_id for _, ids in requests for hash_id in ids]
    last_use = {hash_id: position for position, hash_id in enumerate(sequence)}
    cached: OrderedDict[int, None] = OrderedDict()

    def store(position: int, hash_id: int) -> None:
        if hash_id in cached:
            cached.move_to_end(hash_id)
        elif last_use[hash_id] > position:
            cached[hash_id] = None
        while len(cached) > capacity_blocks:
            cached.popitem(last=False)

    return _prefix_hit_rate(requests, cached, store)


def class_oracle_lru_hit_rate(requests: Sequence[tuple[float, list[int]]], capacity_blocks: int) -> float:
    """LRU that admits a first-seen block when its class (the `reuse` policy's: the length of the run its request
    writes, whether that run extends a cached prefix) is reused at least a threshold over the *whole* trace, and
    always a block seen before; the best threshold. The most any admission filter on those features could get."""
    uses: dict[int, int] = {}
    for _, ids in requests:
        for hash_id in ids:
            uses[hash_id] = uses.get(hash_id, 0) + 1
    seen: set[int] = set()
    counts: dict[tuple[int, bool], list[int]] = {}  # class -> [first-seen blocks, of those used again]
    for _, ids in requests:
        hits = next((n for n, hash_id in enumerate(ids) if hash_id not in seen), len(ids))
        klass = (run_bucket(len(ids) - hits), hits > 0)
        for hash_id in ids[hits:]:
            if hash_id not in seen:
                count = counts.setdefault(klass, [0, 0])
                count[0] += 1
                count[1] += uses[hash_id] > 1
        seen.update(ids)
    rate = {klass: reused / num for klass, (num, reused) in counts.items()}
    return max(_class_admitted_lru(requests, capacity_blocks, rate, t / 10) for t in range(1, 7))


def _class_admitted_lru(
    requests: Sequence[tuple[float, list[int]]], capacity_blocks: int, rate: dict[tuple[int, bool], float], at: float
) -> float:
    cached: OrderedDict[int, None] = OrderedDict()
    seen: set[int] = set()
    hits = total = 0
    for _, ids in requests:
        num_hits = next((n for n, hash_id in enumerate(ids) if hash_id not in cached), len(ids))
        for hash_id in reversed(ids[:num_hits]):
            cached.move_to_end(hash_id)
        klass = (run_bucket(len(ids) - num_hits), num_hits > 0)
        for hash_id in ids[num_hits:]:
            if hash_id in cached:
                cached.move_to_end(hash_id)
            elif hash_id in seen or rate.get(klass, 0.0) >= at:
                cached[hash_id] = None
                while len(cached) > capacity_blocks:
                    cached.popitem(last=False)
            seen.add(hash_id)
        hits += num_hits
        total += len(ids)
    return hits / max(total, 1)


class _TraceClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def replay(requests: Sequence[tuple[float, list[int]]], capacity_blocks: int, policy: str) -> float:
    """The hit rate of the real store with room for `capacity_blocks` blocks."""
    clock = _TraceClock()
    store = BlockStore(StoreConfig(host_capacity_bytes=capacity_blocks * BLOCK_BYTES, policy=policy), clock)
    hits = total = 0
    for timestamp, ids in requests:
        clock.now = timestamp
        keys = [key_of(i) for i in ids]
        num_hits = store.lookup(keys, LAYOUT.model)
        store.get(keys[:num_hits], LAYOUT.model)
        parents = [ROOT, *keys][: len(keys)]  # a prompt under one block has none
        store.put(
            [
                Block(k, p, LAYOUT, DATA, checksum=DATA_CHECKSUM)
                for k, p in zip(keys[num_hits:], parents[num_hits:], strict=True)
            ]
        )
        hits += num_hits
        total += len(keys)
    return hits / max(total, 1)


def replay_device(requests: Sequence[tuple[float, list[int]]], capacity_blocks: int, policy: str) -> float:
    """The hit rate of a worker's device prefix cache (engine_core's BlockPool, as `KVCacheManager` builds it for
    `policy`) with `capacity_blocks` blocks, one request at a time: its leading cached blocks are taken back, the
    rest allocated and cached, and all freed last block first when it ends, as the engine frees them. A request
    longer than the cache keeps its first blocks only."""
    pool = BlockPool(capacity_blocks, eviction=None if policy == "lru" else make_policy(policy, capacity_blocks))
    hits = total = 0
    for _, ids in requests:
        keys = [key_of(i) for i in ids[:capacity_blocks]]
        cached = []
        for key in keys:
            block = pool.get_cached_block(key)
            if block is None:
                break
            cached.append(block)
        pool.touch(cached)
        computed = pool.allocate(len(keys) - len(cached))
        pool.cache_blocks(computed, keys[len(cached) :], keys[len(cached) - 1] if cached else ROOT, (), 1)
        pool.take_events()
        pool.free(reversed([*cached, *computed]))
        hits += len(cached)
        total += len(ids)
    return hits / max(total, 1)


def run_kvcache_bench(
    trace: str, capacity_blocks: int | None, policy: str, capacity_fraction: float | None = None, device: bool = False
) -> dict[str, Any]:
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}: expected one of {', '.join(POLICIES)}")
    return _rows(trace, load_trace(trace), capacity_blocks, capacity_fraction, [policy], device)[0]


def _rows(
    trace: str,
    requests: Sequence[tuple[float, list[int]]],
    capacity_blocks: int | None,
    capacity_fraction: float | None,
    policies: Sequence[str],
    device: bool = False,
) -> list[dict[str, Any]]:
    """One row per policy at one capacity; the bounds (ideal, Belady, reuse oracle) are computed once."""
    unique = len({i for _, ids in requests for i in ids})
    if capacity_blocks is None:
        capacity_blocks = max(1, int(unique * (capacity_fraction if capacity_fraction is not None else 0.25)))
    ideal = ideal_hit_rate(requests)
    bounds = {
        "ideal_hit_rate": round(ideal, 4),
        "belady_hit_rate": round(belady_hit_rate(requests, capacity_blocks), 4),
        "reuse_oracle_lru_hit_rate": round(reuse_oracle_lru_hit_rate(requests, capacity_blocks), 4),
        "class_oracle_lru_hit_rate": round(class_oracle_lru_hit_rate(requests, capacity_blocks), 4),
    }
    rows = []
    for policy in policies:
        started = time.perf_counter()
        hit_rate = (replay_device if device else replay)(requests, capacity_blocks, policy)
        rows.append(
            {
                "trace": Path(trace).name,  # "generated" for kvcache_trace's
                "policy": policy,
                "cache": "device" if device else "store",
                "capacity_blocks": capacity_blocks,
                "unique_blocks": unique,
                "capacity_fraction": round(capacity_blocks / unique, 4),
                "num_requests": len(requests),
                "hit_rate": round(hit_rate, 4),
                "fraction_of_ideal": round(hit_rate / ideal, 4) if ideal else None,
                **bounds,
                "seconds": round(time.perf_counter() - started, 2),  # the replay's
            }
        )
    return rows


def sweep(
    traces: Sequence[str], fractions: Sequence[float], policies: Sequence[str], device: bool = False
) -> list[dict[str, Any]]:
    rows = []
    for trace in traces:
        requests = load_trace(trace)
        for fraction in fractions:
            rows += _rows(trace, requests, None, fraction, policies, device)
    return rows


def plot(rows: Sequence[dict[str, Any]], path: str | Path) -> None:
    """Hit rate against capacity (share of unique blocks), one line per policy, one panel per trace."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = sorted({r["trace"] for r in rows})
    figure, axes = plt.subplots(1, len(traces), figsize=(6 * len(traces), 4.2), squeeze=False)
    for axis, trace in zip(axes[0], traces, strict=True):
        ours = [r for r in rows if r["trace"] == trace]
        for policy in sorted({r["policy"] for r in ours}):
            line = sorted((r["capacity_fraction"], r["hit_rate"]) for r in ours if r["policy"] == policy)
            axis.plot([x for x, _ in line], [y for _, y in line], marker="o", label=policy)
        axis.axhline(ours[0]["ideal_hit_rate"], color="grey", linestyle="--", label="unlimited (ideal)")
        axis.axvline(0.25, color="grey", linestyle=":", linewidth=0.8)
        axis.set(title=f"{trace}", xlabel="capacity (share of unique blocks)", ylabel="prefix hit rate")
        axis.grid(alpha=0.3)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
