"""The contract between the engine and a device family.

The engine asks a `DeviceOps` object for every op whose best implementation depends on the accelerator
(attention over the paged KV cache, normalisation, the MoE expert computation). It never branches on the
device itself. `CpuOps` is the reference implementation; other families subclass it and override what
they accelerate, so an op a family does not override still runs (as plain torch on that device).

Shapes use these letters:
  T  tokens in the flattened batch         B  sequences (decode: one query token each)
  H  query heads                            K  KV heads (GQA)          D  head size
  N  blocks in the cache                    S  block size (tokens per block)
  M  max blocks per sequence                L  context length
  R  MLA latent rank (kv_lora_rank)         P  MLA rope dims (qk_rope_head_dim)
  E  experts                                I  expert intermediate size      k  experts per token
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class DecodeBatch:
    """Where each decode sequence's context lives in the paged cache; built once per step, used by every layer.

    `extra` holds whatever a device family precomputes from the block tables (the cpu module: segments of rows
    attended together, their gather indices and masks) so that the per-layer calls do no index arithmetic.
    """

    block_tables: torch.Tensor  # (B, M) int32: block ids per sequence, padded with 0
    context_lens: torch.Tensor  # (B,) int32: tokens of context per sequence, the new token included
    block_size: int
    extra: Any = None


class DeviceOps(ABC):
    """Ops every device family provides. `CpuOps` implements all of them; other families override some."""

    name: str = ""

    def __init__(self, torch_device: torch.device) -> None:
        self.torch_device = torch_device

    def synchronize(self) -> None:  # noqa: B027 - a deliberate default no-op, not a forgotten @abstractmethod
        """Wait for queued device work (a no-op where ops are synchronous)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.torch_device})"

    # -- normalisation and activations -------------------------------------------------------------
    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x (T, Hd) -> x / rms(x) * weight, computed in fp32 and returned in x's dtype."""

    @abstractmethod
    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """(T, 2I) -> (T, I): silu(x[:, :I]) * x[:, I:]."""

    # -- attention over the paged KV cache ----------------------------------------------------------
    @abstractmethod
    def prepare_decode(self, block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int) -> DecodeBatch:
        """Precompute what the decode attention calls of one step share (called once per step). Rows may come in
        any order; the model runner orders them longest context first, which lets the cpu module attend rows of
        similar lengths together instead of padding every row to the longest."""

    @abstractmethod
    def paged_decode_attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: DecodeBatch, scale: float
    ) -> torch.Tensor:
        """GQA decode: q (B, H, D); k_cache, v_cache (N, S, K, D) -> (B, H, D)."""

    @abstractmethod
    def mla_decode_attention(
        self, q_latent: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor, batch: DecodeBatch, scale: float
    ) -> torch.Tensor:
        """MLA decode in the absorbed form: q_latent (B, H, R), q_rope (B, H, P), kv_cache (N, S, R+P) -> (B, H, R).

        Scores are q_latent . latent + q_rope . rope over each cached token; the output is the
        softmax-weighted sum of the latents (the caller projects it to values per head).
        """

    @abstractmethod
    def gather_cache(
        self, cache: torch.Tensor, block_ids: torch.Tensor, num_tokens: int, role: str | None = None
    ) -> torch.Tensor:
        """The first `num_tokens` entries of one sequence: cache (N, S, *F), block_ids (m,) -> (num_tokens, *F).

        With a `role` ("k", "v", "latent") the result may be a view of a buffer the module reuses for that role:
        valid until the next gather or decode attention of the same role."""

    @abstractmethod
    def prefill_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_cached: int, scale: float
    ) -> torch.Tensor:
        """Causal attention of one sequence's new tokens over its whole context.

        q (Lq, H, D) are the tokens at positions num_cached .. num_cached+Lq-1; k (L, K, D) and v (L, K, Dv)
        cover positions 0 .. L-1 with L = num_cached + Lq. Returns (Lq, H, Dv).
        """

    def cached_prefill_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_ids: torch.Tensor,
        num_cached: int,
        scale: float,
    ) -> torch.Tensor:
        """`prefill_attention` of one sequence whose context is in the paged cache (a chunk after earlier chunks
        or prefix hits): q (Lq, H, D) at positions num_cached ..; k_cache (N, S, K, D), v_cache (N, S, K, Dv)
        with the new tokens' entries already written; block_ids (m,) its blocks. Returns (Lq, H, Dv). Here: the
        context gathered, then `prefill_attention`; a module may read the cache in place instead."""
        num_total = num_cached + q.shape[0]
        k = self.gather_cache(k_cache, block_ids, num_total, role="k")
        v = self.gather_cache(v_cache, block_ids, num_total, role="v")
        return self.prefill_attention(q, k, v, num_cached, scale)

    # -- mixture of experts -------------------------------------------------------------------------
    @abstractmethod
    def moe_experts(
        self,
        x: torch.Tensor,
        w_gate_up: torch.Tensor,
        w_down: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
    ) -> torch.Tensor:
        """Routed experts: x (T, Hd); w_gate_up (E, 2I, Hd); w_down (E, Hd, I); topk_ids (T, k) int;
        topk_weights (T, k) fp32 -> (T, Hd) = sum_j w_j * down_e(silu(gate_e(x)) * up_e(x)) with e = topk_ids[:, j].
        """
