"""Faults a compute worker injects into its own answers, so tests can show what the mesh does about a bad worker
(a canary rollout rolling back). Off unless KVMESH_ALLOW_FAULT_INJECTION=1: a worker given a fault setting without
it refuses to start (WorkerSettings), so a stray variable never slows or fails production traffic."""

from __future__ import annotations

import asyncio
import random

import torch


class InjectedFault(RuntimeError):
    """A request failed on purpose (KVMESH_FAULT_ERROR_RATE): the caller sees UNAVAILABLE and may retry elsewhere."""


class Faults:
    """What this worker adds to every request: a delay per token and a chance of failing before the first one."""

    def __init__(self, token_delay_s: float = 0.0, error_rate: float = 0.0, seed: int | None = None) -> None:
        assert token_delay_s >= 0 and 0 <= error_rate <= 1, "checked by WorkerSettings"
        self.token_delay_s = token_delay_s
        self.error_rate = error_rate
        self._rng = random.Random(seed)

    @property
    def is_on(self) -> bool:
        return self.token_delay_s > 0 or self.error_rate > 0

    def check(self) -> None:
        """Raise InjectedFault for `error_rate` of the requests."""
        if self.error_rate > 0 and self._rng.random() < self.error_rate:
            raise InjectedFault("injected fault (KVMESH_FAULT_ERROR_RATE)")

    async def delay(self, num_tokens: int) -> None:
        if self.token_delay_s > 0 and num_tokens > 0:
            await asyncio.sleep(self.token_delay_s * num_tokens)


def perturb_weights(model: torch.nn.Module, noise: float, seed: int = 0) -> int:
    """Add Gaussian noise of `noise` times each floating-point weight's own standard deviation, from a fixed seed
    (KVMESH_FAULT_WEIGHT_NOISE): the same architecture and KV layout, other weights, as a bad conversion or another
    checkpoint under the same name would be. Returns the number of tensors changed."""
    generator = torch.Generator().manual_seed(seed)
    num_changed = 0
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.is_floating_point() and tensor.numel() > 1:
                scale = noise * float(tensor.float().std())
                tensor.add_((torch.randn(tensor.shape, generator=generator) * scale).to(tensor.dtype))
                num_changed += 1
    return num_changed
