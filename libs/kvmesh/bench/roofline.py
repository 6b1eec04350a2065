"""The decode roofline of `kvmesh bench engine`: the machine's matrix-multiply rate, measured in the same run,
over the model's FLOPs per generated token.

A decode step is almost all matrix multiplies (70% of a batch-32 step in issue 20's profile, the rest shrinking
as the engine improves), so the tokens/s a machine could reach is its GEMM rate divided by the FLOPs one token
needs: 2 per weight of every matrix the token passes through (the LM head included, the embedding lookup not;
routed experts by the share a token uses). Attention's score and value products are left out: at the bench's
contexts (up to ~320 tokens) they add under 5% to SmolLM2-135M's count.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from engine_core.config import ModelConfig

GEMM_SIZE = 1024  # a square fp32 GEMM: large enough to run at the library's full rate, 2 GFLOP a call
GEMM_REPEATS = 5


def gemm_gflops(size: int = GEMM_SIZE, repeats: int = GEMM_REPEATS) -> float:
    """The best of `repeats` timed (size x size) @ (size x size) float32 products, in GFLOP/s, with this process's
    torch threads (the engine's). The best, not the median: the roofline is what the machine can do."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)  # warm-up: thread pool, packing buffers
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        seconds.append(time.perf_counter() - start)
    return 2 * size**3 / min(seconds) / 1e9


def flops_per_token(model: torch.nn.Module, config: ModelConfig) -> int:
    """2 x the weights one token multiplies by: every linear layer (float or int8: anything with in_features and
    out_features, the LM head included; the embedding table is a lookup), and stacked routed experts (3-D
    parameters) by num_experts_per_tok / num_experts."""
    weights = 0.0
    for module in model.modules():
        in_features, out_features = getattr(module, "in_features", None), getattr(module, "out_features", None)
        if isinstance(in_features, int) and isinstance(out_features, int):
            weights += in_features * out_features
    if config.moe is not None:
        share = config.moe.num_experts_per_tok / config.moe.num_experts
        weights += sum(p.numel() * share for p in model.parameters() if p.dim() == 3)
    return int(2 * weights)


def measure(model: torch.nn.Module, config: ModelConfig) -> dict[str, Any]:
    rates = [gemm_gflops() for _ in range(2)]
    flops = flops_per_token(model, config)
    best = max(rates)
    return {
        "gemm_gflops": round(best, 2),
        "gemm_gflops_runs": [round(r, 2) for r in rates],
        "gemm": f"float32 {GEMM_SIZE}x{GEMM_SIZE}x{GEMM_SIZE}, best of {GEMM_REPEATS} calls, best of 2 rounds",
        "model_gflop_per_token": round(flops / 1e9, 4),
        "roofline_tok_s": round(best * 1e9 / flops, 1),
        "median_gemm_gflops": round(statistics.median(rates), 2),
    }
