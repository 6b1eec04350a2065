"""`kvmesh bench route`'s command line, kept out of cli.py (the simulator is imported only when it runs)."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

DEFAULT_PLOT_DIR = "bench/out/route"


def add_parser(bench_commands: Any) -> None:
    route = bench_commands.add_parser(
        "route", help="routing policies on a trace in the simulator: hit rate, balance, TTFT, TPOT, goodput"
    )
    route.add_argument(
        "--trace",
        required=True,
        help="Mooncake JSON lines (hash_ids; FAST25-release/traces/ in kvcache-ai/Mooncake on GitHub) or an Azure "
        "LLM inference CSV (data/ in Azure/AzurePublicDataset on GitHub)",
    )
    route.add_argument("--prefill-workers", type=int, default=8)
    route.add_argument("--decode-workers", type=int, default=8)
    route.add_argument("--policy", default="kvmesh", help="a policy name, or all (side by side, with plots)")
    route.add_argument("--load", type=float, default=0.8, help="offered prefill work / the prefill pool's capacity")
    route.add_argument(
        "--load-basis",
        default="ideal",
        choices=("ideal", "prompt"),
        help="offered work: prompts less an unlimited cache's hits (ideal), or whole prompts",
    )
    route.add_argument("--limit", type=int, default=None, help="the first N requests only")
    route.add_argument("--cache-tokens", type=int, default=3_000_000, help="KV cache per prefill worker")
    route.add_argument("--eviction", default="lru", help="the prefill caches' eviction: lru | s3fifo | lfuda")
    route.add_argument("--scale", type=float, default=1.0, help="multiplies every compute time of the cost model")
    route.add_argument(
        "--prefill-tokens-per-s",
        type=float,
        default=None,
        help="a prefill worker's uncached tokens/s at context depth 0 (default: DeepSeek-V3 on H800)",
    )
    route.add_argument(
        "--decode-step-s",
        type=float,
        default=None,
        help="a decode step's time without attention (default: DeepSeek-V3 on H800)",
    )
    route.add_argument(
        "--calibrate",
        default=None,
        metavar="ENGINE_JSON",
        help="take both from `kvmesh bench engine --json` output: this engine on this machine",
    )
    route.add_argument("--replicas", type=int, default=1, help="balancer replicas (requests go to them in turn)")
    route.add_argument("--no-share", action="store_true", help="replicas do not share their assignments")
    route.add_argument("--share-delay-s", type=float, default=0.005, help="how late a peer's assignment is heard")
    route.add_argument("--heartbeat-s", type=float, default=1.0, help="how often workers report their load")
    route.add_argument(
        "--seed", type=int, default=0, help="0: heartbeats evenly staggered; else each worker's phase drawn from it"
    )
    route.add_argument(
        "--decode-binding",
        default="early",
        choices=("early", "late"),
        help="choose the decode worker at the arrival (early) or when the KV is ready, at prefill's end (late)",
    )
    route.add_argument("--ttft-slo-s", type=float, default=2.0, help="TTFT target for goodput")
    route.add_argument("--tpot-slo-s", type=float, default=0.1, help="TPOT target for goodput")
    route.add_argument(
        "--plot-dir", default=None, help=f"write PNG plots here (with --policy all: default {DEFAULT_PLOT_DIR})"
    )
    route.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="policies run in parallel")
    route.add_argument("--json", action="store_true", help="one line of JSON")


def calibration(path: str) -> dict[str, float]:
    """The cost model's rates from a `kvmesh bench engine --json` report: the best batched prefill rate of our
    engine over the concurrencies it ran, and the decode step at its largest batch (a step makes one token per
    running request, so step time = batch / decode tokens/s)."""
    with open(path) as file:
        report = json.load(file)
    try:
        runs = {int(c): r["ours"] for c, r in report["results"].items()}
        largest = max(runs)
        prefill = max(r["prefill_tok_s"] for r in runs.values() if r["prefill_tok_s"])
        step_s = largest / runs[largest]["decode_tok_s"]
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        raise ValueError(f"--calibrate {path}: not a `kvmesh bench engine --json` report ({exc!r})") from exc
    return {"prefill_tokens_per_s": float(prefill), "decode_step_base_s": step_s}


def cost_model(args: argparse.Namespace) -> Any:
    from mesh.routing import CostModel

    overrides: dict[str, Any] = calibration(args.calibrate) if args.calibrate else {}
    overrides.update(
        {
            name: value
            for name, value in (
                ("prefill_tokens_per_s", args.prefill_tokens_per_s),
                ("decode_step_base_s", args.decode_step_s),
            )
            if value is not None
        }
    )
    return CostModel(scale=args.scale, **overrides)


def run(args: argparse.Namespace) -> int:
    from kvmesh.bench.route import BenchConfig, run_route_bench
    from kvmesh.bench.route_sim import SimConfig

    for name in ("prefill_workers", "decode_workers", "replicas", "cache_tokens", "jobs"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    sim = SimConfig(
        num_prefill=args.prefill_workers,
        num_decode=args.decode_workers,
        cache_tokens=args.cache_tokens,
        eviction=args.eviction,
        heartbeat_s=args.heartbeat_s,
        num_replicas=args.replicas,
        share=not args.no_share,
        share_delay_s=args.share_delay_s,
        seed=args.seed,
        decode_binding=args.decode_binding,
        cost=cost_model(args),
    )
    config = BenchConfig(
        trace=args.trace,
        limit=args.limit,
        load=args.load,
        load_basis=args.load_basis,
        ttft_slo_s=args.ttft_slo_s,
        tpot_slo_s=args.tpot_slo_s,
        sim=sim,
    )
    plot_dir = args.plot_dir or (DEFAULT_PLOT_DIR if args.policy == "all" else None)
    result = run_route_bench(args.policy, config, plot_dir=plot_dir, jobs=args.jobs)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0
