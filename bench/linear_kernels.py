"""The decode step's linear layers on a CPU, three ways, at the batch sizes decode runs: torch's `F.linear` (MKL's
sgemm, what the engine calls today), oneDNN with the weight reordered once ahead (`torch.ops.mkldnn
._reorder_linear_weight` + `_linear_pointwise`, what inductor's CPU freezing uses) and MKL with the weight packed
once (`torch.ops.mkl._mkl_reorder_linear_weight` + `_mkl_linear`, packed for one batch size); and the int8 layer
(`engine_core.quantization.Int8Linear`, whole: smoothing, per-token quantization, kernel, rescale) through each of
its kernels, fbgemm's dynamic linear and oneDNN's qlinear (where the engine's probe takes it). One JSON object
on stdout.

    PYTHONPATH=libs .venv/bin/python bench/linear_kernels.py [--batches 1 8 32] [--threads 1] [--calls 40] [--rounds 5]

Shapes are SmolLM2-135M's (hidden 576, fused q/k/v 960, MLP 1536 with gate and up fused, tied 49,152-token head);
`per_step_ms` sums one step's worth (30 layers of the four, and the head once). Times are process CPU per call
(time.process_time), median over interleaved rounds, so a loaded machine moves them less than wall time; float32
weights; `max_abs_diff` is against `F.linear` on the same input (the kernels sum in another order: not bit-equal;
the int8 layers also round).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine_core.quantization import Int8Linear, can_use_onednn, int8_kernel

HIDDEN, QKV, MLP, VOCAB, LAYERS = 576, 960, 1536, 49152, 30
SHAPES = {  # name: (in, out, times a step)
    "qkv": (HIDDEN, QKV, LAYERS),
    "o": (HIDDEN, HIDDEN, LAYERS),
    "gate_up": (HIDDEN, 2 * MLP, LAYERS),
    "down": (MLP, HIDDEN, LAYERS),
    "head": (HIDDEN, VOCAB, 1),
}


def cpu_ms(call: Callable[[], object], num_calls: int) -> float:
    call()
    began = time.process_time()
    for _ in range(num_calls):
        call()
    return (time.process_time() - began) / num_calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    # oneDNN's int8 only where the engine's probe takes it: on a CPU where oneDNN falls back to its reference
    # matmul (an AMD EPYC with VNNI and no AMX) one step's calls take minutes, and this bench never ended
    int8_kernels = ["fbgemm", "onednn"] if can_use_onednn() and int8_kernel() == "onednn" else ["fbgemm"]
    results = []
    for batch in args.batches:
        per_step = dict.fromkeys(["linear", "onednn_packed", "mkl_packed", *(f"int8_{k}" for k in int8_kernels)], 0.0)
        shapes = {}
        for name, (k, n, times) in SHAPES.items():
            weight = torch.randn(n, k) * 0.05
            x = torch.randn(batch, k)
            onednn_weight = torch.ops.mkldnn._reorder_linear_weight(weight, None)
            mkl_weight = torch.ops.mkl._mkl_reorder_linear_weight(weight, batch)
            kernels = {
                "linear": functools.partial(F.linear, x, weight),
                "onednn_packed": functools.partial(
                    torch.ops.mkldnn._linear_pointwise, x, onednn_weight, None, "none", [], ""
                ),
                "mkl_packed": functools.partial(torch.ops.mkl._mkl_linear, x, mkl_weight, weight, None, batch),
            }
            linear = nn.Linear(k, n, bias=False)
            linear.weight.data = weight
            input_range = torch.randn(256, k).abs().amax(dim=0)  # (k,): the calibration pass's max |x_j|
            for kernel in int8_kernels:
                kernels[f"int8_{kernel}"] = functools.partial(Int8Linear.from_linear(linear, input_range, kernel), x)
            reference = kernels["linear"]()
            samples: dict[str, list[float]] = {kernel: [] for kernel in kernels}
            for _ in range(args.rounds):
                for kernel, call in kernels.items():
                    samples[kernel].append(cpu_ms(call, args.calls))
            medians = {kernel: statistics.median(values) for kernel, values in samples.items()}
            for kernel, value in medians.items():
                per_step[kernel] += value * times
            shapes[name] = {
                "in": k,
                "out": n,
                "ms": {kernel: round(value, 4) for kernel, value in medians.items()},
                "max_abs_diff": {
                    kernel: float((call() - reference).abs().max())
                    for kernel, call in kernels.items()
                    if kernel != "linear"
                },
            }
        results.append(
            {
                "batch": batch,
                "per_step_ms": {kernel: round(value, 2) for kernel, value in per_step.items()},
                "speedup_vs_linear": {
                    kernel: round(per_step["linear"] / value, 3) for kernel, value in per_step.items() if value > 0
                },
                "shapes": shapes,
            }
        )
    print(
        json.dumps(
            {"threads": args.threads, "torch": torch.__version__, "int8_kernels": int8_kernels, "by_batch": results}
        )
    )


if __name__ == "__main__":
    main()
