"""The block size is a model's, end to end: a prefill worker announces each model's engine block size (a small
DeepSeek-V4 whose HCA ratio is 128 gets 128-token blocks, like V4-Flash; the same model at ratio 8 keeps the
configured 16), the gateway hashes a prompt's routing keys by the size the model's workers announce (so they equal
the worker's own block keys), and the balancer counts that model's cached prefix in its blocks. Workers that
disagree on a model's size: an error logged once, and that model routed without keys (by load), never by wrong
ones. One real prefill worker on a real NATS, no mesh; the routing is the real gateway and balancer code."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio
from safetensors.torch import save_file

from engine_core.kv_cache.block_hash import hash_token_blocks, root_hash
from engine_core.tiny_v4 import random_weights
from kvmesh.nats_server import EmbeddedNats
from mesh.config import load_settings
from mesh.discovery import KnownWorker
from mesh.kv_index import GlobalKVIndex
from mesh.pb import common_pb2
from mesh.routing import Router, RouteRequest
from mesh.rpc import Channels
from services.balancer.server import worker_state
from services.gateway.mesh_view import MeshView
from services.gateway.pipeline import Pipeline
from services.prefill.config import PrefillSettings
from services.prefill.server import PrefillService
from tests.engine_core.v4_helpers import SMALL_V4_CONFIG
from tests.mesh.test_routing_policies import COST  # prefill at 1,000 tokens a second, 1 ms a token moved
from tests.services.pd_harness import next_heartbeat

pytestmark = pytest.mark.asyncio(loop_scope="module")

SETTING = 16  # KVMESH_BLOCK_SIZE, the gateway's and the worker's
PROMPT = [(7 * i + 3) % 500 for i in range(300)]  # 2 blocks of 128, 18 of 16


@dataclass
class Worker:
    service: PrefillService
    info: common_pb2.WorkerInfo  # as its heartbeat announced it
    wide: str  # the model of 128-token blocks (its served name: its directory)
    narrow: str  # the model of 16-token blocks

    async def engine_keys(self, model: str, cache_salt: str | None = None) -> list[bytes]:
        """PROMPT's block keys as the worker's engine for `model` computes them (its prefix cache's keys)."""
        assert self.service.engines is not None
        return await self.service.engines.get(model).call(lambda e: e.prompt_block_hashes(PROMPT, cache_salt))


def write_v4(path: Path, hca_ratio: int) -> str:
    """tests/engine_core/v4_helpers.py's small DeepSeek-V4 with its HCA layer's ratio set to `hca_ratio`."""
    rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": hca_ratio}
    config = {**SMALL_V4_CONFIG, "compress_rates": rates}
    save_file(random_weights(config, seed=3), str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="module")
def nats_url() -> Iterator[str]:
    with EmbeddedNats() as nats:
        yield nats.url


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def worker(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Worker]:
    wide = write_v4(tmp_path_factory.mktemp("v4-hca128"), 128)
    narrow = write_v4(tmp_path_factory.mktemp("v4-hca8"), 8)
    settings = load_settings(
        PrefillSettings,
        env={},
        nats_url=nats_url,
        worker_id="prefill-bs",
        heartbeat_interval_s=0.2,
        log_level="warning",
        models=(wide, narrow),
        block_size=SETTING,
        kv_cache_memory_bytes=2 * 2**20,
        kvcache_enabled=False,
        kv_index_enabled=False,
    )
    service = await PrefillService.start(settings)
    try:
        beat = await next_heartbeat(nats_url, "prefill", "prefill-bs", lambda beat: True)
        yield Worker(service, beat.worker, wide, narrow)
    finally:
        await service.stop()


class Workers:
    """The gateway's registry side: the workers it has heard, by role and model."""

    def __init__(self, *infos: common_pb2.WorkerInfo) -> None:
        self.known = [KnownWorker(info, common_pb2.WorkerLoad(), 0) for info in infos]

    def workers(self, role: int | None = None, model: str | None = None) -> list[KnownWorker]:
        return [w for w in self.known if role in (None, w.info.role) and (model is None or model in w.info.models)]

    def record_failure(self, worker_id: str) -> None:
        raise AssertionError(f"no call fails here: {worker_id}")


def renamed(
    info: common_pb2.WorkerInfo, worker_id: str, role: common_pb2.Role = common_pb2.ROLE_PREFILL
) -> common_pb2.WorkerInfo:
    """Another worker announcing what `info` does."""
    copy = common_pb2.WorkerInfo()
    copy.CopyFrom(info)
    copy.worker_id, copy.role = worker_id, role
    return copy


def gateway(*infos: common_pb2.WorkerInfo) -> Pipeline:
    return Pipeline(Channels(None), MeshView(Workers(*infos)), SETTING, 0)


async def test_the_registration_carries_each_models_engine_block_size(worker: Worker) -> None:
    assert dict(worker.info.model_block_sizes) == {worker.wide: 128, worker.narrow: 16}
    assert worker.info.block_size == SETTING  # the old field: the setting, for readers of an older build


async def test_the_gateways_keys_are_the_workers_keys_and_its_cached_prefix_routes_to_it(worker: Worker) -> None:
    other = renamed(worker.info, "prefill-other")
    pipeline = gateway(worker.info, other, renamed(worker.info, "decode-bs", common_pb2.ROLE_DECODE))
    wide_keys = pipeline.block_keys(worker.wide, PROMPT)
    assert wide_keys == await worker.engine_keys(worker.wide)
    assert len(wide_keys) == 2  # 300 tokens: 2 blocks of 128 (by the setting's 16 they would be 18, all misses)
    assert pipeline.block_keys(worker.wide, PROMPT, cache_salt="s") == await worker.engine_keys(worker.wide, "s")
    narrow_keys = pipeline.block_keys(worker.narrow, PROMPT)  # a model of 16: the keys of before, unchanged
    assert narrow_keys == await worker.engine_keys(worker.narrow)
    assert narrow_keys == hash_token_blocks(root_hash(worker.narrow), PROMPT, SETTING)
    assert len(narrow_keys) == 18

    # the balancer: the worker's KV events put its keys in the index; the gateway's keys find them, in 128s
    index = GlobalKVIndex()
    index.add(worker.info.worker_id, await worker.engine_keys(worker.wide))
    states = [worker_state(KnownWorker(i, common_pb2.WorkerLoad(), 0), worker.wide) for i in (other, worker.info)]
    decode = [worker_state(KnownWorker(renamed(worker.info, "decode-bs"), common_pb2.WorkerLoad(), 0), worker.wide)]
    route, _ = Router("kvmesh", index, COST).route(
        RouteRequest(worker.wide, tuple(wide_keys), len(PROMPT), "r-1", frozenset()), states, decode, 0.0
    )
    assert (route.prefill_worker_id, route.num_cached_tokens) == ("prefill-bs", 256)


async def test_workers_that_disagree_route_without_keys_and_say_so_once(
    worker: Worker, capsys: pytest.CaptureFixture[str]
) -> None:
    other = renamed(worker.info, "prefill-other")
    other.model_block_sizes[worker.wide] = 64
    pipeline = gateway(worker.info, other)
    capsys.readouterr()
    assert pipeline.block_keys(worker.wide, PROMPT) == []
    assert pipeline.block_keys(worker.wide, PROMPT) == []
    logged = capsys.readouterr().err
    assert logged.count("workers disagree on a model's block size") == 1, logged
    assert "prefill-other" in logged and worker.wide in logged
    assert pipeline.block_keys(worker.narrow, PROMPT) == await worker.engine_keys(worker.narrow)  # others unharmed


async def test_a_worker_of_an_older_build_and_no_worker_fall_back_to_the_one_block_size(worker: Worker) -> None:
    old = renamed(worker.info, "prefill-old")
    old.ClearField("model_block_sizes")
    old.block_size = 128
    assert gateway(old).block_keys(worker.wide, PROMPT) == await worker.engine_keys(worker.wide)
    assert gateway().block_keys(worker.wide, PROMPT) == hash_token_blocks(root_hash(worker.wide), PROMPT, SETTING)
