"""A prompt chunk's attention over its cached context in every layer: the gather + SDPA/GEMMs path against the C++
kernel that reads the paged cache in place (`paged_chunk`; the figures in docs/engine.md).

    PYTHONPATH=libs:. python bench/chunk_kernel.py [--contexts 256 2000 7900] [--queries 1 8 16 32]
        [--threads 2] [--rounds 7]

SmolLM2-135M's attention shapes (9 query heads, 3 KV heads, head size 64), float32, 30 layers each with a cache of
its own (so each layer reads its context from memory, as in a step where the linear weights come between), the
context's blocks of 16 scattered over the cache. For each context (cached tokens) and chunk length, both paths run
all 30 layers in turn, `rounds` rounds alternated; the medians of each one's time and their ratio. One JSON line per
case on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from devices.cpu import CpuOps

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_LAYERS = 9, 3, 64, 16, 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 2000, 7900])
    parser.add_argument("--queries", type=int, nargs="+", default=[1, 8, 16, 32])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    kernel_ops, gather_ops = CpuOps(), CpuOps()
    if not kernel_ops.use_decode_kernel():
        raise SystemExit("the C++ kernels could not be built here (g++ and ninja are needed)")
    num_blocks = -(-(max(args.contexts) + max(args.queries)) // BLOCK_SIZE) + 1
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    caches = [(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)) for _ in range(NUM_LAYERS)]
    for num_cached in args.contexts:
        for num_new in args.queries:
            block_ids = torch.randperm(num_blocks, generator=gen)[: -(-(num_cached + num_new) // BLOCK_SIZE)]
            q = torch.randn(num_new, NUM_HEADS, HEAD_DIM, generator=gen)

            times: dict[str, list[float]] = {"gather": [], "kernel": []}
            for _ in range(args.rounds):
                for name, ops in (("gather", gather_ops), ("kernel", kernel_ops)):
                    began = time.perf_counter()
                    for k_cache, v_cache in caches:
                        ops.cached_prefill_attention(q, k_cache, v_cache, block_ids, num_cached, 0.125)
                    times[name].append((time.perf_counter() - began) * 1e3)
            gather_ms, kernel_ms = (statistics.median(times[name]) for name in ("gather", "kernel"))
            print(
                json.dumps(
                    {
                        "cached_tokens": num_cached,
                        "chunk_tokens": num_new,
                        "threads": args.threads,
                        "layers": NUM_LAYERS,
                        "gather_ms": round(gather_ms, 2),
                        "kernel_ms": round(kernel_ms, 2),
                        "gather_over_kernel": round(gather_ms / kernel_ms, 2),
                        "load_avg_1m": round(os.getloadavg()[0], 2),
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
