"""Row-wise kernels: RMS norm and the SwiGLU activation. Memory bound; one pass over each row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from devices.cuda.configs import LaunchConfig


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_out, num_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    x32 = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, axis=0) / num_cols + eps)
    # round to x's dtype before the weight, as the reference does, so bf16 results match bit for bit
    normed = (x32 * inv_rms).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, num_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < num_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + num_cols + cols, mask=mask, other=0.0).to(tl.float32)
    gate32 = gate.to(tl.float32)
    # two roundings, like torch's silu(gate) * up in x's dtype
    act = (gate32 / (1.0 + tl.exp(-gate32))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, cfg: LaunchConfig) -> torch.Tensor:
    """x (T, Hd), weight (Hd,) -> (T, Hd) in the dtype torch gives `weight * x` (x's dtype when they agree)."""
    num_rows, num_cols = x.shape
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)  # (T, Hd)
    if num_rows == 0:
        return out
    block = triton.next_power_of_2(num_cols)
    num_warps = min(cfg.num_warps, max(1, block // 256))  # at least 8 elements a thread; short rows need few warps
    _rms_norm_kernel[(num_rows,)](
        x, weight, out, x.stride(0), out.stride(0), num_cols, eps, BLOCK=block, num_warps=num_warps
    )  # fmt: skip
    return out


def silu_and_mul(x: torch.Tensor, cfg: LaunchConfig) -> torch.Tensor:
    """(T, 2I) -> (T, I): silu(gate) * up."""
    num_rows, num_cols = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_rows, num_cols), dtype=x.dtype, device=x.device)  # (T, I)
    if num_rows == 0 or num_cols == 0:
        return out
    block = min(cfg.block_n, triton.next_power_of_2(num_cols))
    grid = (num_rows, triton.cdiv(num_cols, block))
    _silu_and_mul_kernel[grid](x, out, x.stride(0), out.stride(0), num_cols, BLOCK=block, num_warps=cfg.num_warps)
    return out
