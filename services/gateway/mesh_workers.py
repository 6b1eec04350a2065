"""GET /v1/mesh/workers (the admin key required: a tenant's key gets 403): each pool's workers with their load, KV usage
and prefix-cache size, and the pool size the balancer recommends, as a balancer sees them (Balancer.ListWorkers;
the first balancer that answers).

    {"object": "mesh.workers", "balancer": "balancer-1",
     "pools": {"prefill": {"num_workers": 2, "num_recommended": 3, "utilization": 0.91, "target_utilization": 0.8,
                           "workers": [{"id": ..., "address": ..., "models": [...], "last_seen_ms": ...,
                                        "load": {"num_running": ..., "num_waiting": ...,
                                                 "num_queued_prompt_tokens": ..., "num_kv_tokens": ...},
                                        "kv": {"usage": 0.42, "num_blocks": ..., "num_free_blocks": ...,
                                               "block_size": 16, "block_sizes": {"deepseek-tiny": 16}},
                                        "cache": {"num_blocks": ..., "num_tokens": ...}}]},
               "decode": {...}}}

`kv.block_sizes` is each served model's tokens per block (its engine's: DeepSeek-V4's is a multiple of its compress
ratios); `kv.block_size` is the worker's KVMESH_BLOCK_SIZE, kept for older readers, and is a model's only when the
worker announces none per model. The block counts are over all the worker's engines, so `cache.num_tokens` is
`cache.num_blocks` x the block size its models share, and null when their block sizes differ: the load reports
one count, not one per model, and any single figure would be a guess.
"""

from __future__ import annotations

from typing import Any

import grpc
import grpc.aio
from aiohttp import web

from mesh import rpc
from mesh.discovery import ROLE_NAMES, model_block_size, worker_block_size
from mesh.logging import get_logger
from mesh.pb import balancer_pb2, balancer_pb2_grpc, common_pb2
from services.gateway.errors import ErrorKind, GatewayError
from services.gateway.rest import CORE_KEY
from services.gateway.tenancy.admin_api import require_admin

MESH_WORKERS_PATH = "/v1/mesh/workers"
log = get_logger(__name__)


def worker_json(status: balancer_pb2.WorkerStatus) -> dict[str, Any]:
    info, load = status.worker, status.load
    return {
        "id": info.worker_id,
        "address": info.address,
        "models": list(info.models),
        "version": info.version,
        "last_seen_ms": status.last_seen_ms,
        "load": {
            "num_running": load.num_running,
            "num_waiting": load.num_waiting,
            "num_queued_prompt_tokens": load.num_queued_prompt_tokens,
            "num_kv_tokens": load.num_kv_tokens,
        },
        "kv": {
            "usage": round(load.kv_usage, 4),
            "num_blocks": info.num_kv_blocks,
            "num_free_blocks": load.num_free_kv_blocks,
            "block_size": info.block_size,
            "block_sizes": {model: model_block_size(info, model) for model in info.models},
        },
        "cache": {"num_blocks": load.num_cached_blocks, "num_tokens": num_cached_tokens(info, load)},
    }


def num_cached_tokens(info: common_pb2.WorkerInfo, load: common_pb2.WorkerLoad) -> int | None:
    block_size = worker_block_size(info)
    return None if block_size is None else load.num_cached_blocks * block_size


def mesh_json(response: balancer_pb2.ListWorkersResponse, balancer_id: str) -> dict[str, Any]:
    pools: dict[str, dict[str, Any]] = {}
    for status in response.pools:
        pools[status.pool] = {
            "num_workers": status.num_workers,
            "num_recommended": status.num_recommended,
            "utilization": round(status.utilization, 4),
            "target_utilization": status.target_utilization,
            "workers": [],
        }
    for worker in response.workers:
        name = ROLE_NAMES.get(worker.worker.role, "unknown")
        pools.setdefault(name, {"num_workers": 0, "workers": []})["workers"].append(worker_json(worker))
    for listed in pools.values():
        listed["num_workers"] = len(listed["workers"])
    return {"object": "mesh.workers", "balancer": balancer_id, "pools": pools}


async def list_mesh_workers(request: web.Request) -> web.Response:
    require_admin(request)
    core = request.app[CORE_KEY]
    for balancer in core.mesh.balancers():
        stub = balancer_pb2_grpc.BalancerStub(core.pipeline.channels.get(balancer.info.address))
        try:
            response = await stub.ListWorkers(balancer_pb2.ListWorkersRequest(), timeout=rpc.ROUTE_TIMEOUT_S)
        except grpc.aio.AioRpcError as error:
            log.warning("list workers failed", balancer=balancer.worker_id, code=error.code().name)
            continue
        return web.json_response(mesh_json(response, balancer.worker_id))
    raise GatewayError(ErrorKind.UNAVAILABLE, "no balancer answered; retry shortly")
