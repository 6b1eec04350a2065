"""DeepSeek-V4's hyper-connections (several residual streams) and its MoE (hash-routed or scored).

Hyper-connections (mHC): the residual is N streams; before each sub-layer a small fp32 projection of the normed
streams gives "pre" weights (collapse the streams into the sub-layer's input), "post" weights (spread its output
over the streams) and a "comb" matrix, made doubly stochastic by Sinkhorn iterations, that mixes the streams.

MoE: every layer routes each token to k of E experts plus one shared expert; both use a SwiGLU whose gate and up
are clamped. Scored layers pick the top k by score (sqrt(softplus) of the router logits) plus a correction bias;
hash layers take the experts from a fixed token-id table. Either way the chosen scores, normalised and scaled,
weight the experts.

Shapes: T tokens, N streams, Hd hidden, E experts, k experts per token, I expert width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine_core.config import ModelConfig, V4Config
from engine_core.models.deepseek_v4.functional import unweighted_rms_norm
from engine_core.models.experts import ExpertCounters, PhysicalExperts

DENSE_MAX_WORK_RATIO = 4  # V4MoE runs every expert on every token when E <= this * k (V4MoE._all_experts)


class HyperConnection(nn.Module):
    def __init__(self, config: ModelConfig, v4: V4Config) -> None:
        super().__init__()
        n = v4.hc_mult
        self.hc_mult, self.iters, self.hc_eps, self.eps = n, v4.hc_sinkhorn_iters, v4.hc_eps, config.rms_norm_eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * config.hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.empty((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32))  # of pre, post, comb

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams (T, N, Hd) -> post (T, N), comb (T, N, N), both fp32, and the collapsed input (T, Hd)."""
        n = self.hc_mult
        mixes = F.linear(unweighted_rms_norm(streams.flatten(1).float(), self.eps), self.fn)  # (T, (2 + N) N)
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_scale, post_scale, comb_scale = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_scale + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_scale + post_b)
        comb = torch.softmax(comb_w.view(-1, n, n) * comb_scale + comb_b.view(n, n), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = (pre[..., None] * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed


def mix_streams(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """streams (T, N, Hd), a sub-layer's output (T, Hd) -> the new streams: out spread by post, plus the old
    streams mixed by comb (stream j feeds stream k with weight comb[j, k])."""
    dtype = streams.dtype
    return post.to(dtype)[..., None] * out[:, None, :] + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


class HyperHead(nn.Module):
    """Collapses the streams once after the last layer."""

    def __init__(self, config: ModelConfig, v4: V4Config) -> None:
        super().__init__()
        self.hc_eps, self.eps = v4.hc_eps, config.rms_norm_eps
        self.fn = nn.Parameter(torch.empty(v4.hc_mult, v4.hc_mult * config.hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.empty(v4.hc_mult, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(1, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mixes = F.linear(unweighted_rms_norm(streams.flatten(1).float(), self.eps), self.fn)  # (T, N)
        pre = torch.sigmoid(mixes * self.scale + self.base) + self.hc_eps
        return (pre[..., None] * streams).sum(dim=1).to(streams.dtype)


def clamped_swiglu(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """(..., 2I) -> (..., I): silu(min(gate, limit)) * clamp(up, -limit, limit)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class SharedExpert(nn.Module):
    def __init__(self, hidden_size: int, width: int, limit: float) -> None:
        super().__init__()
        self.w13 = nn.Linear(hidden_size, 2 * width, bias=False)  # gate (w1) and up (w3), fused
        self.w2 = nn.Linear(width, hidden_size, bias=False)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(clamped_swiglu(self.w13(x), self.limit))


class ExpertRouter(nn.Module):
    def __init__(self, config: ModelConfig, v4: V4Config, is_hash: bool) -> None:
        super().__init__()
        self.v4, self.is_hash = v4, is_hash
        self.weight = nn.Parameter(torch.empty(v4.num_experts, config.hidden_size))
        if is_hash:  # token id -> its k experts, fixed at training
            table = torch.empty(config.vocab_size, v4.num_experts_per_tok, dtype=torch.long)
            self.tid2eid = nn.Parameter(table, requires_grad=False)
        else:
            self.bias = nn.Parameter(torch.empty(v4.num_experts, dtype=torch.float32))  # score correction

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, Hd), input_ids (T,) -> expert ids (T, k) int64, weights (T, k)."""
        logits = F.linear(x, self.weight)  # (T, E)
        scores = F.softplus(logits).sqrt() if self.v4.scoring_func == "sqrtsoftplus" else logits.sigmoid()
        if self.is_hash:
            expert_ids = self.tid2eid[input_ids].long()
        else:
            expert_ids = torch.topk(scores + self.bias, self.v4.num_experts_per_tok, dim=-1, sorted=False).indices
        weights = scores.gather(1, expert_ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return expert_ids, weights * self.v4.routed_scaling_factor


class V4MoE(nn.Module):
    """As DeepseekMoE (deepseek_v3): the logical experts' weights load from checkpoints; under expert parallelism
    the engine sets `placement` (copies in slot order) and `counters`, only between steps
    (engine_core.expert_parallel). Hash-routed layers are counted and placed like scored ones."""

    def __init__(self, config: ModelConfig, v4: V4Config, layer: int) -> None:
        super().__init__()
        e, i, hd = v4.num_experts, v4.moe_intermediate_size, config.hidden_size
        self.gate = ExpertRouter(config, v4, v4.is_hash_moe[layer])
        self.w_gate_up = nn.Parameter(torch.empty(e, 2 * i, hd), requires_grad=False)  # (E, 2I, Hd): w1 then w3
        self.w_down = nn.Parameter(torch.empty(e, hd, i), requires_grad=False)  # (E, Hd, I): w2
        self.shared_experts = SharedExpert(hd, i, v4.swiglu_limit)
        self.limit = v4.swiglu_limit
        self.placement: PhysicalExperts | None = None  # None: the logical experts are the slots, on one rank
        self.counters: ExpertCounters | None = None
        self.num_routed_tokens = 0  # every token so far: rotates tokens over an expert's replicas

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        expert_ids, weights = self.gate(x, input_ids)  # (T, k) logical
        placement = self.placement
        slot_ids = None if placement is None else placement.dispatch(expert_ids, self.num_routed_tokens)  # (T, k)
        if placement is None and self.w_gate_up.shape[0] <= DENSE_MAX_WORK_RATIO * expert_ids.shape[1]:
            out = self._all_experts(x, expert_ids, weights)
            self.num_routed_tokens += x.shape[0]
            if self.counters is not None:
                self.counters.record(expert_ids, slot_ids)
            return out + self.shared_experts(x)
        out = torch.zeros_like(x)
        for expert in expert_ids.unique().tolist():  # logical order whatever the placement: the same sums
            tokens, slot = torch.where(expert_ids == expert)
            if placement is None or slot_ids is None:
                self._add_expert(out, x, weights, tokens, slot, self.w_gate_up[expert], self.w_down[expert])
                continue
            homes = slot_ids[tokens, slot]  # the replica each of these tokens uses (identical weights)
            for home in homes.unique().tolist():
                pick = homes == home
                w_gate_up, w_down = placement.w_gate_up[home], placement.w_down[home]
                self._add_expert(out, x, weights, tokens[pick], slot[pick], w_gate_up, w_down)
        self.num_routed_tokens += x.shape[0]
        if self.counters is not None:
            self.counters.record(expert_ids, slot_ids)
        return out + self.shared_experts(x)

    def _all_experts(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Every expert on every token, then each token's k picked and summed: a handful of large operations in
        place of a dozen per expert used, for models whose E/k is at most DENSE_MAX_WORK_RATIO (the dense work is
        E/k times the routed work: deepseek-v4-tiny's 16/4, not V4-Flash's 256/6). Sums run in logical-expert
        order, as `_add_expert`'s accumulation does."""
        e, t = self.w_gate_up.shape[0], x.shape[0]
        gate_up = F.linear(x, self.w_gate_up.flatten(0, 1)).view(t, e, -1).transpose(0, 1)  # (E, T, 2I)
        routed = torch.bmm(clamped_swiglu(gate_up, self.limit), self.w_down.transpose(1, 2))  # (E, T, Hd)
        order = expert_ids.argsort(dim=1, stable=True)
        ids, w = expert_ids.gather(1, order), weights.gather(1, order)  # (T, k), ascending expert ids
        picked = routed.transpose(0, 1)[torch.arange(t, device=x.device)[:, None], ids]  # (T, k, Hd)
        picked = (picked * w[..., None]).to(x.dtype)
        out = picked[:, 0]
        for slot in range(1, picked.shape[1]):
            out = out + picked[:, slot]
        return out

    def _add_expert(
        self,
        out: torch.Tensor,
        x: torch.Tensor,
        weights: torch.Tensor,
        tokens: torch.Tensor,
        slot: torch.Tensor,
        w_gate_up: torch.Tensor,
        w_down: torch.Tensor,
    ) -> None:
        """out[tokens] += weight * expert(x[tokens]), for the tokens that chose it in `slot` of their k."""
        hidden = clamped_swiglu(F.linear(x[tokens], w_gate_up), self.limit)
        routed = F.linear(hidden, w_down) * weights[tokens, slot, None]
        out.index_add_(0, tokens, routed.to(out.dtype))
