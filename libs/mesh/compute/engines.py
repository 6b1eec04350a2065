"""One engine per served model, each on its own thread (engine_core.AsyncEngine).

`ModelEngines` is built once at start and read-only afterwards; each engine's state is written only by its
own thread. What the event loop reads directly here is immutable after loading: layouts and context limits.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import torch

from engine_core import EngineStats, LLMEngine
from engine_core.async_engine import AsyncEngine, KVEventHook
from mesh.bus import Bus
from mesh.compute.experts import ExpertSync
from mesh.compute.faults import perturb_weights
from mesh.compute.settings import WorkerSettings
from mesh.kv_blocks import KVLayout
from mesh.logging import get_logger
from mesh.rpc import UnknownModelError

log = get_logger(__name__)


class ModelEngines:
    def __init__(self, engines: dict[str, AsyncEngine]) -> None:
        self._engines = engines
        self._expert_sync: ExpertSync | None = None  # set once at start (start_expert_sync)

    @classmethod
    async def load(
        cls, settings: WorkerSettings, kv_event_hook: Callable[[str], KVEventHook | None] = lambda model: None
    ) -> ModelEngines:
        """Build and start an engine for each configured model (`kv_event_hook(model)` gives its KV event hook)."""
        torch.set_num_threads(settings.torch_threads)
        loop = asyncio.get_running_loop()
        engines: dict[str, AsyncEngine] = {}
        try:
            for model in settings.models:
                # loading reads weights from disk: off the event loop, which may already serve NATS
                engine = await loop.run_in_executor(None, LLMEngine, settings.engine_config(model))
                if settings.fault_weight_noise > 0:  # testing only (KVMESH_ALLOW_FAULT_INJECTION)
                    num_changed = await loop.run_in_executor(
                        None, perturb_weights, engine.runner.model, settings.fault_weight_noise
                    )
                    log.warning(
                        "weights perturbed", model=model, noise=settings.fault_weight_noise, tensors=num_changed
                    )
                engines[model] = AsyncEngine(engine, kv_event_hook(model), name=f"engine-{model}")
                await engines[model].start()
        except BaseException:
            await cls(engines).stop()
            raise
        return cls(engines)

    async def start_expert_sync(self, bus: Bus | None, worker_id: str, report_steps: int) -> None:
        """Expert load reports and plans for the MoE models (mesh.compute.experts); off when report_steps is 0."""
        if report_steps > 0 and bus is not None:
            self._expert_sync = ExpertSync(self._engines, bus, worker_id, report_steps)
            await self._expert_sync.start()

    async def stop(self) -> None:
        if self._expert_sync is not None:
            await self._expert_sync.stop()
        for engine in self._engines.values():
            await engine.stop()

    @property
    def models(self) -> list[str]:
        return list(self._engines)

    def get(self, model: str) -> AsyncEngine:
        engine = self._engines.get(model)
        if engine is None:
            raise UnknownModelError(f"model {model!r} is not served here (serving: {', '.join(self._engines)})")
        return engine

    def layout(self, model: str) -> KVLayout:
        return self.get(model).kv_layout

    @property
    def block_sizes(self) -> dict[str, int]:
        """Each model's tokens per block, its engine's (the model's own: DeepSeek-V4's a multiple of its compress
        ratios), announced so routing keys are hashed by it."""
        return {model: engine.kv_layout.block_size for model, engine in self._engines.items()}

    def max_model_len(self, model: str) -> int:
        return self.get(model).max_model_len

    def items(self) -> Iterator[tuple[str, AsyncEngine]]:
        return iter(self._engines.items())

    def stats(self) -> dict[str, EngineStats]:
        """Each engine's latest stats (replaced whole by its thread after each step, so safe to read here)."""
        return {model: engine.stats for model, engine in self._engines.items()}

    @property
    def num_kv_blocks(self) -> int:
        return sum(s.num_kv_blocks for s in self.stats().values())
