"""Launch configurations of every cuda kernel: one table, keyed by op and compute capability.

Values were chosen from the shapes the kernels see, not tuned on hardware yet; `bench/gpu_check.py` measures
them. Hopper (9, 0) and Blackwell (10, 0) have 228 KB of shared memory per SM, so their GEMM tiles are larger and
pipelined deeper; `None` is the default for other GPUs and for the Triton interpreter, where fewer, larger
programs run faster (every program is a Python loop there).
"""

from __future__ import annotations

from dataclasses import dataclass

Capability = tuple[int, int]

HOPPER: Capability = (9, 0)
BLACKWELL: Capability = (10, 0)


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes and launch options; each op reads the fields it names in its row of `_TABLE`."""

    num_warps: int = 4
    num_stages: int = 2
    block_m: int = 16  # MoE: (token, slot) pairs per program; MLA: query heads per program
    block_n: int = 32  # attention: cached tokens per step; MoE: output columns per program; norms: columns
    block_k: int = 32  # MoE: reduction step
    split_tokens: int = 0  # attention: fewest tokens worth a split-K partition of their own
    max_splits: int = 1  # attention: most split-K partitions per sequence

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"LaunchConfig.{name}={value}: tl.dot tiles must be powers of two >= 16")


_TABLE: dict[tuple[str, Capability | None], LaunchConfig] = {
    # one program per row; block_n is the column chunk of silu_and_mul (rms_norm takes the whole row)
    ("rms_norm", None): LaunchConfig(num_warps=4),
    ("rms_norm", HOPPER): LaunchConfig(num_warps=8),
    ("rms_norm", BLACKWELL): LaunchConfig(num_warps=8),
    ("silu_and_mul", None): LaunchConfig(block_n=1024, num_warps=4),
    ("silu_and_mul", HOPPER): LaunchConfig(block_n=2048, num_warps=8),
    ("silu_and_mul", BLACKWELL): LaunchConfig(block_n=2048, num_warps=8),
    # GQA decode: one program per (sequence, kv head[, split]); memory bound, so deeper pipelines help
    ("gqa_decode", None): LaunchConfig(block_n=32, split_tokens=256, max_splits=16),
    ("gqa_decode", HOPPER): LaunchConfig(block_n=64, num_stages=3, split_tokens=512, max_splits=32),
    ("gqa_decode", BLACKWELL): LaunchConfig(block_n=64, num_stages=3, split_tokens=512, max_splits=32),
    # MLA decode: block_m heads share each loaded (block_n, R+P) tile; at R=512 a 16x512 fp32 accumulator
    # already takes 64 registers a thread at 4 warps, so heads per program stay at 16
    ("mla_decode", None): LaunchConfig(block_m=16, block_n=16, split_tokens=128, max_splits=16),
    ("mla_decode", HOPPER): LaunchConfig(block_m=16, block_n=32, num_stages=2, split_tokens=256, max_splits=32),
    ("mla_decode", BLACKWELL): LaunchConfig(block_m=16, block_n=32, num_stages=3, split_tokens=256, max_splits=32),
    # the split-K combine: one program per (sequence, head), block_n columns at a time
    ("attn_reduce", None): LaunchConfig(block_n=64, num_warps=2),
    ("attn_reduce", HOPPER): LaunchConfig(block_n=128, num_warps=4),
    ("attn_reduce", BLACKWELL): LaunchConfig(block_n=128, num_warps=4),
    # fused MoE grouped GEMMs: "small" when experts see few rows each (decode), "large" otherwise (prefill);
    # the first GEMM holds two (block_m, block_n) accumulators (gate and up), so block_n counts once for each
    ("moe_small", None): LaunchConfig(block_m=16, block_n=32, block_k=32),
    ("moe_small", HOPPER): LaunchConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4),
    ("moe_small", BLACKWELL): LaunchConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4),
    ("moe_large", None): LaunchConfig(block_m=32, block_n=32, block_k=32),
    ("moe_large", HOPPER): LaunchConfig(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=4),
    ("moe_large", BLACKWELL): LaunchConfig(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3),
}

OPS = tuple(sorted({op for op, _ in _TABLE}))


def get_config(op: str, capability: Capability | None) -> LaunchConfig:
    """The row for `op` on `capability`, or the op's default row when that capability has none."""
    if (op, None) not in _TABLE:
        raise KeyError(f"no launch config for op {op!r}: expected one of {', '.join(OPS)}")
    return _TABLE.get((op, capability)) or _TABLE[(op, None)]
