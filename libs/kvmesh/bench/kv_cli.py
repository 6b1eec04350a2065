"""The KV benchmarks' command lines (`kvmesh bench kvcache | kv-transfer | kv-push | kv-ttft | kv-fetch | kv-index |
kv-protection`), kept out of cli.py.
Imports here stay light: each benchmark's module is imported only when it runs."""

from __future__ import annotations

import argparse
import json
from typing import Any

COMMANDS = ("kvcache", "kv-transfer", "kv-push", "kv-ttft", "kv-fetch", "kv-index", "kv-protection")


def add_parsers(bench_commands: Any) -> None:
    from mesh.eviction.policies import DEFAULT_POLICY, POLICIES  # standard library only

    kvcache = bench_commands.add_parser(
        "kvcache", help="replay a Mooncake trace through the KV store: hit rate vs ideal"
    )
    kvcache.add_argument(
        "--trace", required=True, help="a Mooncake trace (JSON lines with hash_ids), or `generated` (kvcache_trace)"
    )
    kvcache.add_argument("--capacity-blocks", type=int, default=None, help="default: 25%% of the trace's unique blocks")
    kvcache.add_argument("--policy", default=DEFAULT_POLICY, help=" | ".join(POLICIES))
    kvcache.add_argument(
        "--sweep",
        nargs="*",
        default=None,
        metavar="TRACE",
        help="also sweep capacities x policies over these traces (and --trace)",
    )
    kvcache.add_argument("--plot", default=None, metavar="PNG", help="with --sweep: draw hit rate vs capacity")
    kvcache.add_argument(
        "--device",
        action="store_true",
        help="replay a worker's device prefix cache (engine_core's BlockPool, KVMESH_DEVICE_CACHE_POLICY) instead",
    )
    kvcache.add_argument("--json", action="store_true", help="one line of JSON")

    protection = bench_commands.add_parser(
        "kv-protection", help="recompute seconds lost when a store node dies: priced protection vs one level"
    )
    protection.add_argument("--trace", required=True, help="a Mooncake trace (JSON lines with hash_ids)")
    protection.add_argument("--nodes", type=int, default=8, help="store nodes")
    protection.add_argument("--levels", default="1+0,7+1,4+1,2+1,1+1,1+2", help="k+m levels to choose from")
    protection.add_argument("--budget", type=float, default=1.1, help="bytes stored per block byte, all blocks")
    protection.add_argument("--json", action="store_true", help="one line of JSON")

    transfer = bench_commands.add_parser("kv-transfer", help="GB/s through the KV store vs a raw TCP socket")
    transfer.add_argument("--megabytes", type=int, default=256, help="bytes moved per measurement")
    transfer.add_argument("--block-kib", type=int, default=2048, help="size of one KV block")
    transfer.add_argument(
        "--explore",
        action="store_true",
        help="also time grpc-python variants: aio/sync, protobuf/identity, message sizes, streams",
    )
    transfer.add_argument("--repeats", type=int, default=3, help="runs per measurement, best reported")
    transfer.add_argument(
        "--protection",
        choices=("tls", "mac", "none"),
        default="tls",
        help="the lane as deployed (mutual TLS, AES-GCM), authenticated only (KVMESH_LANE_ENCRYPT=0) or plain "
        "(KVMESH_INSECURE=1); raw TCP is measured either way",
    )
    transfer.add_argument("--json", action="store_true", help="one line of JSON")

    push = bench_commands.add_parser("kv-push", help="prefill's KV push to decode: the bulk lane vs Decode.PushKV")
    push.add_argument("--model", default="smollm2-135m")
    push.add_argument("--prompt-tokens", default="2000,8000", help="prompt sizes whose KV is pushed, comma separated")
    push.add_argument("--repeats", type=int, default=5, help="pushes per size and transport, median reported")
    push.add_argument("--json", action="store_true", help="one line of JSON")

    index = bench_commands.add_parser("kv-index", help="rebuild the global KV index by replaying JetStream")
    index.add_argument("--batches", type=int, default=20_000)
    index.add_argument("--blocks-per-batch", type=int, default=16)
    index.add_argument(
        "--live-batches",
        type=int,
        default=None,
        help="caches churn: each batch also removes its worker's blocks from this many batches ago",
    )
    index.add_argument("--json", action="store_true", help="one line of JSON")

    ttft = bench_commands.add_parser("kv-ttft", help="time to first token on a long shared prefix, through the store")
    ttft.add_argument("--model", default="smollm2-135m")
    ttft.add_argument("--prompt-tokens", type=int, default=2000)
    ttft.add_argument("--json", action="store_true", help="one line of JSON")

    fetch = bench_commands.add_parser(
        "kv-fetch", help="TTFT of a stored prefix by length: prefill always reads it, never does, or decides (auto)"
    )
    fetch.add_argument("--model", default="smollm2-135m")
    fetch.add_argument("--prefix-tokens", default="32,128,512,2048", help="prompt lengths, comma separated")
    fetch.add_argument("--repeats", type=int, default=5, help="prompts per length and mode, median reported")
    fetch.add_argument("--json", action="store_true", help="one line of JSON")


def run(args: argparse.Namespace) -> int:
    result: Any
    if args.bench_command == "kvcache":
        from kvmesh.bench.kvcache import plot, run_kvcache_bench, sweep
        from mesh.eviction.policies import POLICIES

        result = run_kvcache_bench(args.trace, args.capacity_blocks, args.policy, device=args.device)
        if args.sweep is not None:
            rows = sweep(
                [args.trace, *args.sweep], (0.05, 0.1, 0.15, 0.25, 0.35, 0.5, 0.75), POLICIES, device=args.device
            )
            if args.plot:
                plot(rows, args.plot)
            result = {"result": result, "sweep": rows}
    elif args.bench_command == "kv-protection":
        from kvmesh.bench.kv_protection import run_protection_bench

        result = run_protection_bench(args.trace, args.nodes, args.levels, args.budget)
    elif args.bench_command == "kv-transfer":
        from kvmesh.bench.kv_transfer import run_transfer_bench

        result = run_transfer_bench(args.megabytes, args.block_kib, args.repeats, args.protection)
        if args.explore:
            from kvmesh.bench.grpc_bulk import explore

            result = {**result, "explore": explore(min(args.megabytes, 128), args.repeats)}
    elif args.bench_command == "kv-push":
        from kvmesh.bench.kv_push import run_push_bench

        sizes = tuple(int(size) for size in args.prompt_tokens.split(","))
        result = run_push_bench(args.model, sizes, args.repeats)
    elif args.bench_command == "kv-index":
        from kvmesh.bench.kv_index import run_index_bench

        result = run_index_bench(args.batches, args.blocks_per_batch, live_batches=args.live_batches)
    elif args.bench_command == "kv-fetch":
        from kvmesh.bench.kv_fetch import run_fetch_bench

        lengths = tuple(int(length) for length in args.prefix_tokens.split(","))
        if args.repeats < 1 or min(lengths) < 1:
            raise ValueError("--repeats and every --prefix-tokens must be at least 1")
        result = run_fetch_bench(args.model, lengths, args.repeats)
    else:
        from kvmesh.bench.kv_ttft import run_ttft_bench

        result = run_ttft_bench(args.model, args.prompt_tokens)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0
