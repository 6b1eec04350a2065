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
    """2 x the weights one token multiplies by: every matrix but the embedding table; stacked routed experts
    (3-D) by num_experts_per_tok / num_experts."""
    weights = 0.0
    for name, param in model.named_parameters(remove_duplicate=False):  # a tied LM head counts as a matrix
        if param.dim() < 2 or "embed_tokens" in name:
            continue
        share = 1.0
        if param.dim() == 3 and config.moe is not None:
            share = config.moe.num_experts_per_tok / config.moe.num_experts
        weights += param.numel() * share
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
