"""Traces for `kvmesh bench route`: Mooncake JSON lines (timestamp ms, input_length, output_length, hash_ids of
512-token blocks) and Azure LLM inference CSVs (TIMESTAMP, ContextTokens, GeneratedTokens; no prefix hashes, so every
block is its own). The full traces: FAST25-release/traces/ in kvcache-ai/Mooncake and data/ in
Azure/AzurePublicDataset (both on GitHub); tests/data/mooncake holds the first 300 requests of one."""

from __future__ import annotations

import csv
import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    num_prompt_tokens: int
    num_output_tokens: int
    block_hashes: tuple[bytes, ...]  # one key per full 512-token block of the prompt


def block_key(hash_id: int) -> bytes:
    return hash_id.to_bytes(8, "little", signed=True)


def load_trace(path: str | Path, limit: int | None = None, spread: bool = True) -> list[TraceRequest]:
    """The trace's requests in arrival order, arrivals relative to the first (at most `limit` of them).

    Full blocks only, as a live prefill keys them (engine_core's `hash_token_blocks`) and `kvmesh bench kvcache`
    replays them: a Mooncake hash_id is one 512-token block, the last covering `input_length % 512` tokens when
    that is not 0; no cache ever holds that one, so it is dropped (a prompt under 512 tokens has no block).

    `spread`: requests that share a timestamp arrive evenly spaced, in trace order, until the next distinct
    timestamp. Mooncake's conversation trace stamps arrivals in 3-second buckets (~10 requests per bucket at
    the same millisecond); replayed as is, every bucket would be one burst that no real client sends."""
    path = Path(path)
    requests = _load_azure(path, limit) if path.suffix == ".csv" else _load_mooncake(path, limit)
    if not requests:
        raise ValueError(f"{path}: no requests")
    start = requests[0].arrival_s
    requests = [replace(r, arrival_s=r.arrival_s - start) for r in requests]
    return spread_bursts(requests) if spread else requests


def spread_bursts(requests: Sequence[TraceRequest]) -> list[TraceRequest]:
    stamps = sorted({r.arrival_s for r in requests})
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    last_gap = sorted(gaps)[len(gaps) // 2] if gaps else 0.0  # the last bucket spreads over a typical gap
    next_stamp = dict(zip(stamps, [*stamps[1:], stamps[-1] + last_gap], strict=True))
    group_sizes: dict[float, int] = {}
    for request in requests:
        group_sizes[request.arrival_s] = group_sizes.get(request.arrival_s, 0) + 1
    seen: dict[float, int] = {}
    spread = []
    for request in requests:
        stamp, size = request.arrival_s, group_sizes[request.arrival_s]
        k = seen[stamp] = seen.get(stamp, -1) + 1
        spread.append(replace(request, arrival_s=stamp + (next_stamp[stamp] - stamp) * k / size))
    return spread


def _load_mooncake(path: Path, limit: int | None) -> list[TraceRequest]:
    requests: list[TraceRequest] = []
    with open(path) as file:
        for line in file:
            if limit is not None and len(requests) >= limit:
                break
            if line.strip():
                record = json.loads(line)
                num_prompt = int(record["input_length"])
                requests.append(
                    TraceRequest(
                        record["timestamp"] / 1000.0,
                        num_prompt,
                        int(record["output_length"]),
                        tuple(block_key(i) for i in record["hash_ids"][: num_prompt // MOONCAKE_BLOCK_TOKENS]),
                    )
                )
    requests.sort(key=lambda r: r.arrival_s)  # stable: equal timestamps keep the trace's order
    return requests


def _load_azure(path: Path, limit: int | None) -> list[TraceRequest]:
    requests: list[TraceRequest] = []
    next_id = -1  # negative ids: unique blocks, never shared
    with open(path, newline="") as file:
        for row in csv.DictReader(file):
            if limit is not None and len(requests) >= limit:
                break
            num_prompt = int(row["ContextTokens"])
            num_blocks = num_prompt // MOONCAKE_BLOCK_TOKENS
            keys = tuple(block_key(next_id - n) for n in range(num_blocks))
            next_id -= num_blocks
            stamp = datetime.fromisoformat(row["TIMESTAMP"].strip()[:26])
            requests.append(TraceRequest(stamp.timestamp(), num_prompt, int(row["GeneratedTokens"]), keys))
    return requests


def ideal_hit_rate(requests: Sequence[TraceRequest]) -> float:
    """Share of prompt blocks an unlimited single cache holds when they arrive (keys chain, so a block seen
    before means its prefix was seen too): what no router over finite caches can beat."""
    seen: set[bytes] = set()
    hits = total = 0
    for request in requests:
        for key in request.block_hashes:
            hits += key in seen
            seen.add(key)
        total += len(request.block_hashes)
    return hits / max(total, 1)


def ideal_leading_hits(requests: Sequence[TraceRequest]) -> list[int]:
    """Per request, the leading blocks an unlimited single cache holds."""
    seen: set[bytes] = set()
    hits = []
    for request in requests:
        keys = request.block_hashes
        hits.append(next((n for n, key in enumerate(keys) if key not in seen), len(keys)))
        seen.update(keys)
    return hits


def rescaled(requests: Sequence[TraceRequest], factor: float) -> list[TraceRequest]:
    return [replace(r, arrival_s=r.arrival_s * factor) for r in requests]
