"""One layer's prefill attention over cached context, SDPA against grouped GEMMs (the figures in docs/engine.md).

    PYTHONPATH=libs:. python bench/prefill_attention.py [--queries 1 8 32 256] [--contexts 512 2048 8192]
        [--threads 1 2] [--rounds 7]

SmolLM2-135M's attention shapes (9 query heads, 3 KV heads, head size 64), float32. For each thread count, number
of new queries Lq and context L (Lq of them new, L - Lq cached): `sdpa_prefill_attention` (SDPA with a boolean
mask) and `chunk_attention` (two GEMMs per KV head) alternated call by call for `rounds` rounds; the medians of
each one's per-call time and their ratio. Also the KV gather that precedes a chunk's attention (one of k or v,
from blocks of 16 scattered over the cache): a fresh tensor (`CpuOps.gather_cache`) against `index_select` into a
kept buffer. One JSON line per case on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch

from devices.cpu import chunk_attention, sdpa_prefill_attention

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def per_call_s(fn: Callable[[], object], reps: int) -> tuple[float, float]:
    """(wall, process CPU) seconds per call of `reps` calls."""
    began, began_cpu = time.perf_counter(), time.process_time()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - began) / reps, (time.process_time() - began_cpu) / reps


def compare(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, dict[str, float]]:
    """Median per-call wall and CPU ms of each fn, timed in turn round after round (~10 ms of calls per fn each).
    On a machine others share, CPU time at 1 thread is the steadier figure."""
    reps = {name: max(1, int(0.01 / per_call_s(fn, 1)[0])) for name, fn in fns.items()}  # also the warm-up
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(per_call_s(fn, reps[name]))
    return {
        name: {
            "wall_ms": round(statistics.median(w for w, _ in t) * 1e3, 4),
            "cpu_ms": round(statistics.median(c for _, c in t) * 1e3, 4),
        }
        for name, t in times.items()
    }


def attention_case(num_new: int, num_total: int, rounds: int) -> dict[str, object]:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(num_new, NUM_HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(num_total, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(num_total, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    num_cached, scale = num_total - num_new, HEAD_DIM**-0.5
    ms = compare(
        {
            "sdpa": lambda: sdpa_prefill_attention(q, k, v, num_cached, scale),
            "gemm": lambda: chunk_attention(q, k, v, num_cached, scale),
        },
        rounds,
    )
    diff = (chunk_attention(q, k, v, num_cached, scale) - sdpa_prefill_attention(q, k, v, num_cached, scale)).abs()
    ratio = {kind: round(ms["sdpa"][kind] / ms["gemm"][kind], 2) for kind in ("wall_ms", "cpu_ms")}
    return {"ms": ms, "sdpa_over_gemm": ratio, "max_abs_diff": float(diff.max())}


def gather_case(num_total: int, rounds: int) -> dict[str, object]:
    num_blocks = -(-num_total // BLOCK_SIZE)
    cache = torch.randn(4 * num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    block_ids = torch.randperm(cache.shape[0], generator=torch.Generator().manual_seed(0))[:num_blocks]
    buffer = torch.empty(num_blocks, *cache.shape[1:])
    ms = compare(
        {
            "fresh": lambda: cache[block_ids].flatten(0, 1)[:num_total],
            "kept_buffer": lambda: torch.index_select(cache, 0, block_ids, out=buffer).flatten(0, 1)[:num_total],
        },
        rounds,
    )
    ratio = {kind: round(ms["fresh"][kind] / ms["kept_buffer"][kind], 2) for kind in ("wall_ms", "cpu_ms")}
    return {"ms": ms, "fresh_over_kept": ratio}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--queries", type=int, nargs="+", default=[1, 8, 32, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    for threads in args.threads:
        torch.set_num_threads(threads)
        for num_total in args.contexts:
            for num_new in args.queries:
                case = {"threads": threads, "queries": num_new, "context": num_total}
                case |= attention_case(num_new, num_total, args.rounds)
                print(json.dumps(case | {"load_avg_1m": round(os.getloadavg()[0], 2)}), flush=True)
            case = {"threads": threads, "gather_context": num_total} | gather_case(num_total, args.rounds)
            print(json.dumps(case | {"load_avg_1m": round(os.getloadavg()[0], 2)}), flush=True)


if __name__ == "__main__":
    main()
