"""`kvmesh bench scale --gpus N --json`: a deployment of N GPUs sized from issue 19's seed figures and from
kvmesh's own per-event and per-block costs, measured here (scale_measure.py) unless passed as flags.

Every input of the model (scale_model.DEFAULTS) has a flag of its name (`--kv-bytes-per-token`, `--route-us`, ...);
a flag's value is reported as kind `given`. `--measure-lane` replaces the lane's quoted figure by a short run of
`kvmesh bench kv-transfer` (a kvcache node in its own process, TLS lane, 64 MiB): seconds, not milliseconds.
The JSON has `inputs` (value, kind, source of each) and `figures` (scale_model.size); docs/scale.md reads it.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from kvmesh.bench.scale_model import DEFAULTS, MEASURED, Input, size


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_parser(bench_commands: Any) -> None:
    scale = bench_commands.add_parser(
        "scale", help="size a deployment of N GPUs from the seed's figures and kvmesh's measured costs"
    )
    scale.add_argument("--gpus", type=int, default=1000)
    scale.add_argument("--repeats", type=int, default=3, help="rounds per measurement, median kept")
    scale.add_argument("--index-keys", type=int, default=4000, help="keys in the index measurements")
    scale.add_argument("--measure-lane", action="store_true", help="measure lane GB/s with kv-transfer (seconds)")
    for name, spec in DEFAULTS.items():
        default = "measured here" if spec.kind == "measured" else f"{spec.value:g} ({spec.kind})"
        scale.add_argument(
            _flag(name),
            dest=name,
            type=float,
            default=None,
            help=f"{spec.source}; default {default}".replace("%", "%%"),
        )
    scale.add_argument("--json", action="store_true", help="one line of JSON")


def inputs_from(args: argparse.Namespace) -> dict[str, Input]:
    """The model's inputs: flags first (given), then what this process measures, then DEFAULTS."""
    given = {name: getattr(args, name) for name in DEFAULTS if getattr(args, name, None) is not None}
    inputs = {name: Input(value, "given", _flag(name)) for name, value in given.items()}
    to_measure = [name for name in MEASURED if name not in given]
    if to_measure:
        from kvmesh.bench.scale_measure import measure

        prompt_tokens = int(given.get("prompt_tokens", DEFAULTS["prompt_tokens"].value))
        keys_per_batch = int(given.get("keys_per_batch", DEFAULTS["keys_per_batch"].value))
        measured = measure(prompt_tokens, keys_per_batch, args.index_keys, args.repeats)
        inputs |= {name: Input(measured[name], "measured", DEFAULTS[name].source) for name in to_measure}
    if args.measure_lane and "lane_gbytes_per_s" not in given:
        from kvmesh.bench.kv_transfer import run_transfer_bench

        lane = run_transfer_bench(64, 2048, 1, "tls")["store_gbps"]
        inputs["lane_gbytes_per_s"] = Input(lane, "measured", "kv-transfer here: TLS lane, 64 MiB of 2 MiB blocks")
    return {name: inputs.get(name, spec) for name, spec in DEFAULTS.items()}


def run_scale_bench(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    inputs = inputs_from(args)
    measure_s = time.perf_counter() - started
    return {
        "gpus": args.gpus,
        "inputs": {name: {"value": i.value, "kind": i.kind, "source": i.source} for name, i in inputs.items()},
        "figures": size(args.gpus, {name: i.value for name, i in inputs.items()}),
        "measure_seconds": round(measure_s, 2),
        "load_average_1m": round(os.getloadavg()[0], 2),  # measured costs are slower on a busy machine
    }


def run(args: argparse.Namespace) -> int:
    print(json.dumps(run_scale_bench(args), indent=None if args.json else 2))
    return 0
