"""Check the cuda device module's kernels against the cpu reference on a real GPU, then time them.

    PYTHONPATH=libs python bench/gpu_check.py            # a CUDA machine; under 5 minutes on an H200
    PYTHONPATH=libs python bench/gpu_check.py --dry-run  # anywhere: Triton's interpreter, tiny shapes, fp32

Checks run every kernel next to `CpuOps` on the same tensors (bf16 and fp32; the dry run has fp32 only, as the
interpreter cannot tl.dot bf16). Timings: decode attention (GQA at SmolLM2 shapes, MLA at DeepSeek-V3 shapes)
as bytes of KV read per second and their share of the device's peak, the fused MoE in TFLOP/s, rms_norm in
bytes per second. Writes one JSON report ($OUT/gpu_check.json when $OUT is set, else bench/out/gpu_check.json),
prints it, and exits 1 when a check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # read when devices.cuda decorates its kernels, so before that import
sys.path.insert(0, str(ROOT / "libs"))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402

from devices.base import DecodeBatch  # noqa: E402
from devices.cpu import CpuOps  # noqa: E402
from devices.cuda import CudaOps, attention  # noqa: E402
from devices.cuda.configs import OPS  # noqa: E402

Row = dict[str, Any]
MoeInputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]

# HBM bandwidth in bytes/s by device name; the first entry whose key is in the name wins
PEAK_BANDWIDTH = (
    ("H200", 4.8e12),
    ("H100 PCIe", 2.0e12),
    ("H100 NVL", 3.9e12),
    ("H100", 3.35e12),  # SXM ("NVIDIA H100 80GB HBM3")
    ("GB200", 8.0e12),
    ("B200", 8.0e12),
    ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB PCIe", 1.935e12),
    ("A100", 1.555e12),
)
TOLERANCE = {torch.float32: 2e-4, torch.bfloat16: 2e-2}  # atol and rtol of torch.allclose


@dataclass(frozen=True)
class Profile:
    """The shapes of one run: `FULL` on a GPU, `DRY` in the interpreter."""

    dtypes: tuple[torch.dtype, ...]
    gqa: tuple[int, int, int]  # H, K, D
    mha: tuple[int, int, int]  # H == K
    mla: tuple[int, int, int]  # H, R, P
    moe: tuple[int, int, int, int]  # E, Hd, I, k
    block_size: int
    check_contexts: tuple[int, ...]  # one sequence each, block ids shuffled
    check_moe_tokens: tuple[int, ...]
    bench_batches: tuple[int, ...]
    bench_contexts: tuple[int, ...]
    bench_moe_tokens: tuple[int, ...]
    bench_norm: tuple[tuple[int, int], ...]  # (T, Hd)
    budget_s: float  # benchmarks left when this much time has passed are skipped


FULL = Profile(
    dtypes=(torch.bfloat16, torch.float32), gqa=(9, 3, 64), mha=(8, 8, 128), mla=(128, 512, 64),
    moe=(64, 2048, 1408, 6), block_size=16, check_contexts=(1, 16, 700, 3000), check_moe_tokens=(1, 37, 600),
    bench_batches=(1, 4, 16, 64), bench_contexts=(1024, 4096, 16384, 32768), bench_moe_tokens=(1, 16, 256, 4096),
    bench_norm=((1, 7168), (256, 7168), (8192, 7168), (8192, 576)), budget_s=240.0,
)  # fmt: skip
DRY = Profile(
    dtypes=(torch.float32,), gqa=(9, 3, 64), mha=(4, 4, 32), mla=(16, 64, 16), moe=(16, 64, 48, 4), block_size=16,
    check_contexts=(1, 16, 70), check_moe_tokens=(1, 37), bench_batches=(1, 2), bench_contexts=(64, 200),
    bench_moe_tokens=(1, 37), bench_norm=((8, 576),), budget_s=240.0,
)  # fmt: skip


# -- inputs --------------------------------------------------------------------------------------------------------


def randn(*shape: int, dtype: torch.dtype, device: torch.device, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=device) * scale).to(dtype)


def make_batch(ops: CudaOps | CpuOps, contexts: list[int], block_size: int, num_blocks: int) -> DecodeBatch:
    """Sequences of the given lengths on distinct, shuffled blocks of a cache of `num_blocks`."""
    device = ops.torch_device
    max_blocks = triton.cdiv(max(contexts), block_size)
    tables = torch.randperm(num_blocks, device=device)[: len(contexts) * max_blocks].view(len(contexts), -1)
    lens = torch.tensor(contexts, dtype=torch.int32, device=device)
    return ops.prepare_decode(tables.int(), lens, block_size)


def same_batch(ref: CpuOps, batch: DecodeBatch) -> DecodeBatch:
    return ref.prepare_decode(batch.block_tables, batch.context_lens, batch.block_size)


def moe_inputs(num_tokens: int, shape: tuple[int, int, int, int], dtype: torch.dtype,
               device: torch.device) -> MoeInputs:  # fmt: skip
    """DeepSeek-like routing: top-k of softmaxed random logits; some experts get no tokens when T is small."""
    num_experts, hidden, inter, top_k = shape
    logits = torch.randn(num_tokens, num_experts, device=device)
    topk_weights, topk_ids = logits.softmax(-1).topk(top_k, dim=-1)  # (T, k)
    x = randn(num_tokens, hidden, dtype=dtype, device=device)
    w_gate_up = randn(num_experts, 2 * inter, hidden, dtype=dtype, device=device, scale=hidden**-0.5)
    w_down = randn(num_experts, hidden, inter, dtype=dtype, device=device, scale=inter**-0.5)
    return x, w_gate_up, w_down, topk_ids.int(), topk_weights


# -- checks --------------------------------------------------------------------------------------------------------


def compare(name: str, dtype: torch.dtype, run: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> Row:
    """One check: `run` returns (kernel output, reference); never raises, so one failure leaves the report whole."""
    row: Row = {"check": name, "dtype": str(dtype).removeprefix("torch.")}
    try:
        out, expected = run()
        err = (out.float() - expected.float()).abs()
        row["max_abs_err"] = float(err.max()) if err.numel() else 0.0
        tol = TOLERANCE[dtype]
        row["ok"] = bool(torch.allclose(out.float(), expected.float(), atol=tol, rtol=tol))
    except Exception as exc:  # a compile error or a bad launch is a failed check, reported
        row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:500])
    return row


def check_norms(ops: CudaOps, ref: CpuOps, prof: Profile, dtype: torch.dtype) -> list[Row]:
    dev, rows = ops.torch_device, []
    for num_tokens, hidden in prof.bench_norm[:2]:
        x, w = randn(num_tokens, hidden, dtype=dtype, device=dev), randn(hidden, dtype=dtype, device=dev)
        rows.append(compare(f"rms_norm T={num_tokens} Hd={hidden}", dtype,
                            lambda x=x, w=w: (ops.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))))  # fmt: skip
    y = randn(33, 2 * prof.moe[2], dtype=dtype, device=dev, scale=3.0)
    rows.append(compare(f"silu_and_mul I={prof.moe[2]}", dtype, lambda: (ops.silu_and_mul(y), ref.silu_and_mul(y))))
    return rows


def check_gqa(ops: CudaOps, ref: CpuOps, prof: Profile, dtype: torch.dtype, heads: tuple[int, int, int]) -> list[Row]:
    num_heads, num_kv_heads, head_size = heads
    dev, contexts = ops.torch_device, list(prof.check_contexts)
    num_blocks = len(contexts) * triton.cdiv(max(contexts), prof.block_size) + 7
    batch = make_batch(ops, contexts, prof.block_size, num_blocks)
    q = randn(len(contexts), num_heads, head_size, dtype=dtype, device=dev)
    k = randn(num_blocks, prof.block_size, num_kv_heads, head_size, dtype=dtype, device=dev)
    v = randn(num_blocks, prof.block_size, num_kv_heads, head_size, dtype=dtype, device=dev)
    scale, name = head_size**-0.5, f"gqa H={num_heads} K={num_kv_heads} D={head_size}"
    expected = ref.paged_decode_attention(q, k, v, same_batch(ref, batch), scale)
    forced = attention.SplitPlan(4, triton.cdiv(triton.cdiv(max(contexts), 4), 64) * 64)  # 64: any block_n

    def split() -> torch.Tensor:
        lens, tables = batch.context_lens, batch.block_tables
        cfg, reduce_cfg = ops.config("gqa_decode"), ops.config("attn_reduce")
        return attention.paged_decode(q, k, v, tables, lens, prof.block_size, scale, forced, cfg, reduce_cfg)

    return [
        compare(name, dtype, lambda: (ops.paged_decode_attention(q, k, v, batch, scale), expected)),
        compare(name + " split-K x4", dtype, lambda: (split(), expected)),
    ]


def check_mla(ops: CudaOps, ref: CpuOps, prof: Profile, dtype: torch.dtype) -> list[Row]:
    num_heads, rank, rope_dim = prof.mla
    dev, contexts = ops.torch_device, list(prof.check_contexts)
    num_blocks = len(contexts) * triton.cdiv(max(contexts), prof.block_size) + 7
    batch = make_batch(ops, contexts, prof.block_size, num_blocks)
    q_latent = randn(len(contexts), num_heads, rank, dtype=dtype, device=dev, scale=rank**-0.25)
    q_rope = randn(len(contexts), num_heads, rope_dim, dtype=dtype, device=dev)
    kv = randn(num_blocks, prof.block_size, rank + rope_dim, dtype=dtype, device=dev)
    scale, name = (rank + rope_dim) ** -0.5, f"mla H={num_heads} R={rank} P={rope_dim}"
    expected = ref.mla_decode_attention(q_latent, q_rope, kv, same_batch(ref, batch), scale)
    forced = attention.SplitPlan(4, triton.cdiv(triton.cdiv(max(contexts), 4), 64) * 64)

    def split() -> torch.Tensor:
        lens, tables = batch.context_lens, batch.block_tables
        cfg, reduce_cfg = ops.config("mla_decode"), ops.config("attn_reduce")
        return attention.mla_decode(q_latent, q_rope, kv, tables, lens, prof.block_size, scale, forced, cfg,
                                    reduce_cfg)  # fmt: skip

    return [
        compare(name, dtype, lambda: (ops.mla_decode_attention(q_latent, q_rope, kv, batch, scale), expected)),
        compare(name + " split-K x4", dtype, lambda: (split(), expected)),
    ]


def check_moe(ops: CudaOps, ref: CpuOps, prof: Profile, dtype: torch.dtype) -> list[Row]:
    rows = []
    for num_tokens in prof.check_moe_tokens:
        inputs = moe_inputs(num_tokens, prof.moe, dtype, ops.torch_device)
        name = "moe E={} Hd={} I={} k={}".format(*prof.moe) + f" T={num_tokens}"
        rows.append(compare(name, dtype, lambda inputs=inputs: (ops.moe_experts(*inputs), ref.moe_experts(*inputs))))
    return rows


def run_checks(ops: CudaOps, ref: CpuOps, prof: Profile) -> list[Row]:
    rows = []
    for dtype in prof.dtypes:
        torch.manual_seed(0)
        rows += check_norms(ops, ref, prof, dtype)
        rows += check_gqa(ops, ref, prof, dtype, prof.gqa) + check_gqa(ops, ref, prof, dtype, prof.mha)
        rows += check_mla(ops, ref, prof, dtype) + check_moe(ops, ref, prof, dtype)
    return rows


# -- timings -------------------------------------------------------------------------------------------------------


def time_ms(fn: Callable[[], object], on_gpu: bool) -> float:
    """Median milliseconds of `fn`; the interpreter run times one call after a warm-up call."""
    if on_gpu:
        return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def rate_row(row: Row, ms: float, num_bytes: int, peak: float | None) -> Row:
    bandwidth = num_bytes / (ms * 1e-3)
    share = round(bandwidth / peak, 4) if peak else None
    return row | {"ms": round(ms, 5), "bytes": num_bytes, "bytes_per_s": bandwidth, "share_of_peak": share}


class Clock:
    """The benchmarks' time budget, so the whole run stays within its limit on any GPU."""

    def __init__(self, budget_s: float) -> None:
        self.deadline = time.monotonic() + budget_s

    def out_of_time(self) -> bool:
        return time.monotonic() > self.deadline


def bench_gqa(ops: CudaOps, prof: Profile, peak: float | None, clock: Clock) -> list[Row]:
    num_heads, num_kv_heads, head_size = prof.gqa
    dtype, dev, rows = prof.dtypes[0], ops.torch_device, []
    num_blocks = max(prof.bench_batches) * max(prof.bench_contexts) // prof.block_size + 1
    k = randn(num_blocks, prof.block_size, num_kv_heads, head_size, dtype=dtype, device=dev)
    v = randn(num_blocks, prof.block_size, num_kv_heads, head_size, dtype=dtype, device=dev)
    cfg = ops.config("gqa_decode")
    for num_seqs in prof.bench_batches:
        for context in prof.bench_contexts:
            if clock.out_of_time():
                rows.append({"batch": num_seqs, "context": context, "skipped": "time budget"})
                continue
            batch = make_batch(ops, [context] * num_seqs, prof.block_size, num_blocks)
            q = randn(num_seqs, num_heads, head_size, dtype=dtype, device=dev)
            ms = time_ms(partial(ops.paged_decode_attention, q, k, v, batch, head_size**-0.5), dev.type == "cuda")
            splits = attention.plan_splits(num_seqs * num_kv_heads, context, ops.num_sms, cfg).num_splits
            kv_bytes = 2 * num_seqs * context * num_kv_heads * head_size * k.element_size()
            rows.append(rate_row({"batch": num_seqs, "context": context, "num_splits": splits}, ms, kv_bytes, peak))
    return rows


def bench_mla(ops: CudaOps, prof: Profile, peak: float | None, clock: Clock) -> list[Row]:
    num_heads, rank, rope_dim = prof.mla
    dtype, dev, rows = prof.dtypes[0], ops.torch_device, []
    num_blocks = max(prof.bench_batches) * max(prof.bench_contexts) // prof.block_size + 1
    kv = randn(num_blocks, prof.block_size, rank + rope_dim, dtype=dtype, device=dev)
    cfg = ops.config("mla_decode")
    for num_seqs in prof.bench_batches:
        for context in prof.bench_contexts:
            if clock.out_of_time():
                rows.append({"batch": num_seqs, "context": context, "skipped": "time budget"})
                continue
            batch = make_batch(ops, [context] * num_seqs, prof.block_size, num_blocks)
            q_latent = randn(num_seqs, num_heads, rank, dtype=dtype, device=dev, scale=rank**-0.25)
            q_rope = randn(num_seqs, num_heads, rope_dim, dtype=dtype, device=dev)
            scale = (rank + rope_dim) ** -0.5
            ms = time_ms(partial(ops.mla_decode_attention, q_latent, q_rope, kv, batch, scale), dev.type == "cuda")
            programs = num_seqs * triton.cdiv(num_heads, cfg.block_m)
            splits = attention.plan_splits(programs, context, ops.num_sms, cfg).num_splits
            kv_bytes = num_seqs * context * (rank + rope_dim) * kv.element_size()  # each entry counted once
            rows.append(rate_row({"batch": num_seqs, "context": context, "num_splits": splits}, ms, kv_bytes, peak))
    return rows


def bench_moe(ops: CudaOps, prof: Profile, peak: float | None, clock: Clock) -> list[Row]:
    _num_experts, hidden, inter, top_k = prof.moe
    rows = []
    for num_tokens in prof.bench_moe_tokens:
        if clock.out_of_time():
            rows.append({"tokens": num_tokens, "skipped": "time budget"})
            continue
        inputs = moe_inputs(num_tokens, prof.moe, prof.dtypes[0], ops.torch_device)
        ms = time_ms(partial(ops.moe_experts, *inputs), ops.torch_device.type == "cuda")
        flops = 6 * num_tokens * top_k * hidden * inter  # 2 flops a MAC over 2I*Hd + Hd*I weights per pair
        used = int(inputs[3].unique().numel())
        weight_bytes = used * 3 * inter * hidden * inputs[0].element_size()  # what decode batches are bound by
        row = {"tokens": num_tokens, "experts_used": used, "tflop_per_s": flops / (ms * 1e-3) / 1e12}
        rows.append(rate_row(row, ms, weight_bytes, peak))
    return rows


def bench_norm(ops: CudaOps, prof: Profile, peak: float | None, clock: Clock) -> list[Row]:
    rows = []
    for num_tokens, hidden in prof.bench_norm:
        if clock.out_of_time():
            rows.append({"tokens": num_tokens, "hidden": hidden, "skipped": "time budget"})
            continue
        x = randn(num_tokens, hidden, dtype=prof.dtypes[0], device=ops.torch_device)
        w = randn(hidden, dtype=prof.dtypes[0], device=ops.torch_device)
        ms = time_ms(partial(ops.rms_norm, x, w, 1e-6), ops.torch_device.type == "cuda")
        num_bytes = (2 * num_tokens + 1) * hidden * x.element_size()  # read x and w, write the output
        rows.append(rate_row({"tokens": num_tokens, "hidden": hidden}, ms, num_bytes, peak))
    return rows


# -- report --------------------------------------------------------------------------------------------------------


def device_info(ops: CudaOps) -> Row:
    on_gpu = ops.torch_device.type == "cuda"
    name = torch.cuda.get_device_name(ops.torch_device) if on_gpu else "triton interpreter (cpu)"
    peak = next((bw for key, bw in PEAK_BANDWIDTH if key in name), None) if on_gpu else None
    return {
        "device": name, "capability": ops.capability, "num_sms": ops.num_sms, "peak_bytes_per_s": peak,
        "torch": torch.__version__, "triton": triton.__version__,
        "configs": {op: asdict(ops.config(op)) for op in OPS},
    }  # fmt: skip


def run(prof: Profile, device: torch.device) -> Row:
    start = time.monotonic()
    ops, ref = CudaOps(device), CpuOps(device)
    report = device_info(ops) | {"dry_run": device.type != "cuda"}
    report["checks"] = run_checks(ops, ref, prof)
    report["all_checks_passed"] = all(row["ok"] for row in report["checks"])
    clock, peak = Clock(prof.budget_s - (time.monotonic() - start)), report["peak_bytes_per_s"]
    torch.manual_seed(0)
    report["gqa_decode"] = {"shape": "H={} K={} D={}".format(*prof.gqa), "rows": bench_gqa(ops, prof, peak, clock)}
    report["mla_decode"] = {"shape": "H={} R={} P={}".format(*prof.mla), "rows": bench_mla(ops, prof, peak, clock)}
    report["moe"] = {"shape": "E={} Hd={} I={} k={}".format(*prof.moe), "rows": bench_moe(ops, prof, peak, clock)}
    report["rms_norm"] = {"rows": bench_norm(ops, prof, peak, clock)}
    report["elapsed_s"] = round(time.monotonic() - start, 1)
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="interpreter on the CPU, tiny shapes")
    parser.add_argument("--out", type=Path, help="the JSON report's path (default: $OUT or bench/out)")
    args = parser.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --dry-run to exercise this script in Triton's interpreter")
    report = run(DRY if args.dry_run else FULL, torch.device("cpu" if args.dry_run else "cuda"))
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "bench" / "out"
    path = args.out or out_dir / "gpu_check.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(report, indent=1, default=str)
    path.write_text(text + "\n")
    print(text)
    print(f"gpu_check: wrote {path}", file=sys.stderr)
    return 0 if report["all_checks_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
