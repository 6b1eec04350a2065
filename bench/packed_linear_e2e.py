"""`kvmesh bench engine`'s workloads end to end with `EngineConfig.cpu_packed_linear` on and off, in one process,
against transformers' batched `generate` on the same weights. Prints one JSON object on stdout.

    PYTHONPATH=libs:. .venv/bin/python bench/packed_linear_e2e.py [--model smollm2-135m] [--concurrency 1 8 32]
        [--repeats 3] [--threads N]

Each round runs packed, plain and transformers once on the same seeded workload (kvmesh.bench.engine's default:
prompts of 32-256 tokens, outputs of 16-64, greedy, ignore_eos), interleaved so a burst of load elsewhere hits all
three alike; medians over rounds, after one warm-up of each. Wall seconds as `kvmesh bench engine` reports them,
and process CPU seconds beside them (on a loaded machine the CPU time moves less than the wall time).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from engine_core import model_store
from kvmesh.bench.engine import DEFAULT, SAMPLING, HFSystem, OurSystem, Run, Workload, make_workload
from kvmesh.bench.engine import PROMPT_TEXT as TEXT


def timed(call: Callable[[], Run]) -> tuple[Run, float]:
    began = time.process_time()
    run = call()
    return run, time.process_time() - began


def bench(systems: dict[str, Callable[[Workload], Run]], workload: Workload, repeats: int) -> dict[str, Any]:
    wall: dict[str, list[float]] = {name: [] for name in systems}
    cpu: dict[str, list[float]] = {name: [] for name in systems}
    decode: dict[str, list[float]] = {name: [] for name in systems}
    for _ in range(repeats):
        for name, system in systems.items():
            run, cpu_s = timed(lambda system=system: system(workload))  # type: ignore[misc]
            wall[name].append(run.seconds)
            cpu[name].append(cpu_s)
            decode[name].append(run.decode_tokens / run.decode_seconds)
    med = {name: statistics.median(values) for name, values in wall.items()}
    med_cpu = {name: statistics.median(values) for name, values in cpu.items()}
    return {
        "num_requests": workload.num_requests,
        "num_output_tokens": workload.num_output_tokens,
        "median_wall_s": {name: round(value, 3) for name, value in med.items()},
        "median_cpu_s": {name: round(value, 3) for name, value in med_cpu.items()},
        "median_decode_tok_s": {name: round(statistics.median(v), 1) for name, v in decode.items()},
        "vs_hf_batched": {name: round(med["hf_batched"] / med[name], 3) for name in ("packed", "plain")},
        "packed_vs_plain": round(med["plain"] / med["packed"], 3),
        "packed_vs_plain_cpu": round(med_cpu["plain"] / med_cpu["packed"], 3),
        "wall_s": {name: [round(v, 3) for v in values] for name, values in wall.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = replace(DEFAULT, concurrencies=tuple(args.concurrency), repeats=args.repeats)
    load_before = os.getloadavg()
    packed = OurSystem(args.model, "cpu", config, {"cpu_packed_linear": True})
    plain = OurSystem(args.model, "cpu", config, {"cpu_packed_linear": False})
    hf = HFSystem(model_store.resolve(args.model), torch.device("cpu"), torch.float32, SAMPLING["greedy"])
    tokenizer = packed.llm.tokenizer
    source = None if tokenizer is None else tokenizer.encode(TEXT, add_special_tokens=False)
    vocab = packed.llm.engine.model_config.vocab_size
    systems = {"packed": packed.e2e, "plain": plain.e2e, "hf_batched": hf.batched_e2e}
    warmup = make_workload(2, config, source, vocab, random.Random(f"{args.seed}:warmup"))
    for system in systems.values():
        system(warmup)
    results = {}
    for concurrency in config.concurrencies:
        workload = make_workload(concurrency, config, source, vocab, random.Random(f"{args.seed}:{concurrency}"))
        results[str(concurrency)] = bench(systems, workload, config.repeats)
    print(
        json.dumps(
            {
                "model": args.model,
                "torch_threads": torch.get_num_threads(),
                "repeats": config.repeats,
                "results": results,
                "load_avg": [list(load_before), list(os.getloadavg())],
            }
        )
    )


if __name__ == "__main__":
    main()
