"""GET /v1/mesh/workers: a real gateway asks a real balancer (both on a real NATS) for the pools it sees, with
workers made present by real Announcers. Only the admin key may list them."""

from __future__ import annotations

from pathlib import Path

import aiohttp

from engine_core import model_store
from kvmesh.nats_server import EmbeddedNats, free_port
from mesh.bus import Bus
from mesh.discovery import Announcer
from mesh.pb import balancer_pb2, common_pb2
from services.balancer.config import BalancerSettings
from services.balancer.server import serve as serve_balancer
from services.gateway.catalog import ModelCatalog, load_model
from services.gateway.config import GatewaySettings
from services.gateway.mesh_workers import worker_json
from services.gateway.server import GatewayServer
from tests.services.harness import serving, wait_until

KEY = "sk-mesh-view-5e2a"
ADMIN_KEY = "sk-mesh-admin-81c0"
MODEL = "deepseek-tiny"


async def test_mesh_workers_lists_pools_with_load_kv_usage_and_cache_size(tmp_path: Path) -> None:
    catalog = ModelCatalog([load_model(str(model_store.ensure(MODEL)))])
    with EmbeddedNats() as nats:
        common = dict(nats_url=nats.url, heartbeat_interval_s=0.2, log_level="warning")
        bus = await Bus.connect(nats.url, name="fake-workers")
        loads = {
            "prefill-1": common_pb2.WorkerLoad(
                num_running=1, num_queued_prompt_tokens=300, kv_usage=0.25, num_free_kv_blocks=75, num_cached_blocks=12
            ),
            "decode-1": common_pb2.WorkerLoad(num_running=5, num_kv_tokens=640, kv_usage=0.4, num_free_kv_blocks=60),
        }
        announcers = [
            Announcer(
                bus,
                common_pb2.WorkerInfo(
                    worker_id=name,
                    role=common_pb2.ROLE_PREFILL if name.startswith("p") else common_pb2.ROLE_DECODE,
                    address=f"127.0.0.1:{port}",
                    models=[MODEL],
                    max_num_seqs=8,
                    num_kv_blocks=100,
                    block_size=16,
                    version="1.0.0" if name.startswith("p") else "1.1.0-canary",
                ),
                lambda load=load: load,
                0.2,
            )
            for (name, load), port in zip(loads.items(), (7101, 7102), strict=True)
        ]
        balancer = BalancerSettings(grpc_port=free_port(), worker_id="balancer-v", **common)
        async with serving(serve_balancer, balancer):
            gateway = GatewayServer(
                GatewaySettings(
                    http_port=0,
                    grpc_port=0,
                    api_keys=(KEY,),
                    admin_key=ADMIN_KEY,
                    state_dir=str(tmp_path),
                    models=(MODEL,),
                    **common,
                ),
                catalog=catalog,
            )
            await gateway.start()
            for announcer in announcers:
                await announcer.start()
            url = f"http://127.0.0.1:{gateway.http_port}/v1/mesh/workers"
            try:
                async with aiohttp.ClientSession() as session:
                    async with session.get(url) as response:
                        assert response.status == 401
                    async with session.get(url, headers={"Authorization": f"Bearer {KEY}"}) as response:
                        assert response.status == 403  # a tenant's key: the listing is for operators
                        assert (await response.json())["error"]["type"] == "permission_error"

                    seen: list[dict] = []  # the listing that showed both workers: asking again could find one
                    # pruned already, when a loaded machine delays heartbeats past three intervals

                    async def both_listed() -> bool:
                        async with session.get(url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as response:
                            listing = await response.json()
                            if (
                                response.status == 200
                                and listing["pools"]["prefill"]["utilization"] == 1.0
                                and all(listing["pools"][pool]["num_workers"] == 1 for pool in ("prefill", "decode"))
                            ):
                                seen.append(listing)
                            return bool(seen)

                    await wait_until(both_listed)
                    body = seen[0]
            finally:
                for announcer in announcers:
                    await announcer.stop()
                await gateway.stop()
                await bus.close()
    assert (body["object"], body["balancer"]) == ("mesh.workers", "balancer-v")
    prefill, decode = body["pools"]["prefill"], body["pools"]["decode"]
    assert (prefill["num_recommended"], prefill["target_utilization"]) == (2, 0.8)  # busy: 1 x 1.0 / 0.8
    worker = prefill["workers"][0]
    assert (worker["id"], worker["address"], worker["models"], worker["version"]) == (
        "prefill-1",
        "127.0.0.1:7101",
        [MODEL],
        "1.0.0",
    )
    assert worker["load"] == {"num_running": 1, "num_waiting": 0, "num_queued_prompt_tokens": 300, "num_kv_tokens": 0}
    assert worker["kv"] == {
        "usage": 0.25,
        "num_blocks": 100,
        "num_free_blocks": 75,
        "block_size": 16,
        "block_sizes": {MODEL: 16},  # announced none per model: the worker's one size
    }
    assert worker["cache"] == {"num_blocks": 12, "num_tokens": 192}
    assert decode["workers"][0]["version"] == "1.1.0-canary"
    assert decode["workers"][0]["load"]["num_kv_tokens"] == 640 and decode["workers"][0]["kv"]["usage"] == 0.4


def test_a_worker_lists_each_models_block_size_and_counts_cached_tokens_only_by_a_shared_one() -> None:
    """V4-Flash's engine blocks are 128 tokens beside KVMESH_BLOCK_SIZE 16: a worker serving only it counts its
    cached blocks in 128s; one serving it beside a model of 16 reports one block count for both engines, which
    no single size turns into tokens."""
    load = common_pb2.WorkerLoad(num_cached_blocks=12, num_free_kv_blocks=40)
    v4_only = common_pb2.WorkerInfo(
        worker_id="prefill-v4",
        models=["v4-flash"],
        block_size=16,
        num_kv_blocks=50,
        model_block_sizes={"v4-flash": 128},
    )
    status = balancer_pb2.WorkerStatus(worker=v4_only, load=load)
    listed = worker_json(status)
    assert (listed["kv"]["block_size"], listed["kv"]["block_sizes"]) == (16, {"v4-flash": 128})
    assert listed["cache"] == {"num_blocks": 12, "num_tokens": 1536}  # 12 x 128, not 12 x 16
    mixed = common_pb2.WorkerInfo(
        worker_id="prefill-mixed",
        models=["v4-flash", MODEL],
        block_size=16,
        num_kv_blocks=50,
        model_block_sizes={"v4-flash": 128, MODEL: 16},
    )
    listed = worker_json(balancer_pb2.WorkerStatus(worker=mixed, load=load))
    assert listed["kv"]["block_sizes"] == {"v4-flash": 128, MODEL: 16}
    assert listed["cache"] == {"num_blocks": 12, "num_tokens": None}
