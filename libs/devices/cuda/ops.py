"""`CudaOps`: the Triton kernels behind the `DeviceOps` contract. Each method checks its inputs, picks the launch
config for this GPU and launches; ops without a kernel here (prefill attention, gather_cache) run as the cpu
module's torch code on the CUDA device.

On `torch.device("cpu")` the same kernels run in Triton's interpreter (TRITON_INTERPRET=1), which is how CI
checks them on machines without a GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton

from devices.base import DecodeBatch
from devices.cpu import CpuOps
from devices.cuda import attention, moe, norm
from devices.cuda.configs import Capability, LaunchConfig, get_config

# the interpreter has no SMs; this stands in so split-K is chosen (and tested) the way a small GPU would choose it
_INTERPRETER_NUM_SMS = 8
# experts averaging at most this many (token, slot) pairs run the small-tile MoE config (decode batches)
_MOE_SMALL_ROWS = 32


@dataclass(frozen=True)
class CudaDecodeInfo:
    """What `prepare_decode` computes once per step for every layer's decode attention."""

    max_context_len: int  # longest context in the batch: sizes the split-K partitions


class CudaOps(CpuOps):
    name = "cuda"

    def __init__(self, torch_device: torch.device | None = None) -> None:
        super().__init__(torch_device or torch.device("cuda"))
        self.capability: Capability | None = None
        self.num_sms = _INTERPRETER_NUM_SMS
        if self.torch_device.type == "cuda":
            self.capability = torch.cuda.get_device_capability(self.torch_device)
            self.num_sms = torch.cuda.get_device_properties(self.torch_device).multi_processor_count
        elif not _interpreting():
            raise ValueError(f"CudaOps on {self.torch_device} needs Triton's interpreter: set TRITON_INTERPRET=1")

    def config(self, op: str) -> LaunchConfig:
        return get_config(op, self.capability)

    def synchronize(self) -> None:
        if self.torch_device.type == "cuda":
            torch.cuda.synchronize(self.torch_device)

    # -- normalisation and activations -------------------------------------------------------------
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        _check(x.dim() == 2 and weight.shape == (x.shape[1],), "rms_norm: x (T, Hd) and weight (Hd,)", x, weight)
        return norm.rms_norm(_rows(x), weight.contiguous(), eps, self.config("rms_norm"))

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        _check(x.dim() == 2 and x.shape[1] % 2 == 0, "silu_and_mul: x (T, 2I)", x)
        return norm.silu_and_mul(_rows(x), self.config("silu_and_mul"))

    # -- attention over the paged KV cache ----------------------------------------------------------
    def prepare_decode(self, block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int) -> DecodeBatch:
        # one host sync a step (the longest context), shared by every layer's split-K plan
        max_len = int(context_lens.max().item()) if context_lens.numel() else 0
        tables = block_tables.to(torch.int32).contiguous()  # (B, M)
        lens = context_lens.to(torch.int32).contiguous()  # (B,)
        return DecodeBatch(tables, lens, block_size, CudaDecodeInfo(max_len))

    def paged_decode_attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: DecodeBatch, scale: float
    ) -> torch.Tensor:
        _check(_gqa_shapes_ok(q, k_cache, v_cache), "paged_decode_attention: q (B, H, D), k_cache (N, S, K, D), "
               "v_cache (N, S, K, Dv) of one dtype, K dividing H", q, k_cache, v_cache)  # fmt: skip
        cfg = self.config("gqa_decode")
        plan = attention.plan_splits(q.shape[0] * k_cache.shape[2], _info(batch).max_context_len, self.num_sms, cfg)
        return attention.paged_decode(
            _rows(q), _rows(k_cache), _rows(v_cache), batch.block_tables, batch.context_lens, batch.block_size,
            scale, plan, cfg, self.config("attn_reduce"),
        )  # fmt: skip

    def mla_decode_attention(
        self, q_latent: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor, batch: DecodeBatch, scale: float
    ) -> torch.Tensor:
        _check(_mla_shapes_ok(q_latent, q_rope, kv_cache), "mla_decode_attention: q_latent (B, H, R), "
               "q_rope (B, H, P), kv_cache (N, S, R+P) of one dtype", q_latent, q_rope, kv_cache)  # fmt: skip
        cfg = self.config("mla_decode")
        num_programs = q_latent.shape[0] * triton.cdiv(q_latent.shape[1], cfg.block_m)
        plan = attention.plan_splits(num_programs, _info(batch).max_context_len, self.num_sms, cfg)
        return attention.mla_decode(
            _rows(q_latent), _rows(q_rope), _rows(kv_cache), batch.block_tables, batch.context_lens,
            batch.block_size, scale, plan, cfg, self.config("attn_reduce"),
        )  # fmt: skip

    # -- mixture of experts -------------------------------------------------------------------------
    def moe_experts(
        self,
        x: torch.Tensor,
        w_gate_up: torch.Tensor,
        w_down: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
    ) -> torch.Tensor:
        _check(_moe_shapes_ok(x, w_gate_up, w_down, topk_ids, topk_weights), "moe_experts: x (T, Hd), "
               "w_gate_up (E, 2I, Hd), w_down (E, Hd, I) of one dtype; topk_ids, topk_weights (T, k)",
               x, w_gate_up, w_down, topk_ids, topk_weights)  # fmt: skip
        rows_per_expert = topk_ids.numel() / w_down.shape[0]
        cfg = self.config("moe_small" if rows_per_expert <= _MOE_SMALL_ROWS else "moe_large")
        return moe.moe_experts(_rows(x), _rows(w_gate_up), _rows(w_down), topk_ids, topk_weights, cfg)


def _interpreting() -> bool:
    # read the variable itself: triton.knobs, which caches it, only exists from Triton 3.4
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on", "y")


def _info(batch: DecodeBatch) -> CudaDecodeInfo:
    if not isinstance(batch.extra, CudaDecodeInfo):
        raise TypeError("decode attention needs the DecodeBatch that CudaOps.prepare_decode built")
    return batch.extra


def _rows(t: torch.Tensor) -> torch.Tensor:
    """`t` with a unit-stride last dim, the one layout the kernels assume (other strides are passed)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _check(ok: bool, expected: str, *tensors: torch.Tensor) -> None:
    """Raise a ValueError naming the expected shapes and what came instead, unless `ok`."""
    if not ok:
        shapes = ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in tensors)
        raise ValueError(f"{expected}; got {shapes}")


def _same_dtype(*tensors: torch.Tensor) -> bool:
    """The kernels feed these tensors to one tl.dot, which needs one dtype."""
    return len({t.dtype for t in tensors}) == 1


def _gqa_shapes_ok(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.dim() != 4 or not _same_dtype(q, k_cache, v_cache):
        return False
    num_kv_heads = k_cache.shape[2]
    return (v_cache.shape[:3] == k_cache.shape[:3] and k_cache.shape[3] == q.shape[2] and num_kv_heads > 0
            and q.shape[1] % num_kv_heads == 0)  # fmt: skip


def _mla_shapes_ok(q_latent: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    if q_latent.dim() != 3 or q_rope.dim() != 3 or kv_cache.dim() != 3:
        return False
    return (q_rope.shape[:2] == q_latent.shape[:2] and kv_cache.shape[2] == q_latent.shape[2] + q_rope.shape[2]
            and _same_dtype(q_latent, q_rope, kv_cache))  # fmt: skip


def _moe_shapes_ok(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_ids: torch.Tensor,
                   topk_weights: torch.Tensor) -> bool:  # fmt: skip
    if x.dim() != 2 or w_down.dim() != 3 or topk_ids.dim() != 2 or not _same_dtype(x, w_gate_up, w_down):
        return False
    num_experts, hidden, inter = w_down.shape
    return (x.shape[1] == hidden and w_gate_up.shape == (num_experts, 2 * inter, hidden)
            and topk_weights.shape == topk_ids.shape and topk_ids.shape[0] == x.shape[0])  # fmt: skip
