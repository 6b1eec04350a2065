"""Faults a compute worker injects into its own answers, so tests can show what the mesh does about a bad worker
(a canary rollout rolling back). Off unless KVMESH_ALLOW_FAULT_INJECTION=1: a worker given a fault setting without
it refuses to start (WorkerSettings), so a stray variable never slows or fails production traffic."""

from __future__ import annotations

import asyncio
import random


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
