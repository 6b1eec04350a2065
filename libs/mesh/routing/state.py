"""What a routing policy reads and what it decides: worker reports, requests, picks and assignments.

A `WorkerState` is one worker as its last heartbeat described it (live: the WorkerRegistry; in the simulator: a
simulated worker). An `Assignment` is one decision as a load delta: the router that made it applies it at once,
and its peer replicas apply it when they hear it (NATS `kvmesh.balancer.assign`), so replicas do not all pick the
same idle worker between two heartbeats.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerState:
    worker_id: str
    reported_s: float  # when this report was heard, on the router's clock: assignments before it are in it
    block_size: int = 16
    max_num_seqs: int = 1
    num_kv_blocks: int = 0  # capacity (prefill: its prefix cache; decode: the KV its requests may hold)
    num_running: int = 0
    num_waiting: int = 0
    num_queued_prompt_tokens: int = 0  # prefill: prompt tokens admitted but not yet computed
    num_kv_tokens: int = 0  # decode: KV held by running requests
    kv_usage: float = 0.0  # share of its KV blocks held by requests, over all its engines (WorkerLoad.kv_usage)
    num_cached_blocks: int = 0  # prefill: size of its prefix cache
    version: str = ""  # the build it runs (WorkerInfo.version): a rollout splits traffic by it

    @property
    def num_kv_capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size


@dataclass(frozen=True)
class RouteRequest:
    model: str
    block_hashes: tuple[bytes, ...]  # the prompt's full-block keys (the worker's block size)
    num_prompt_tokens: int
    request_id: str = ""
    exclude_worker_ids: frozenset[str] = frozenset()
    tenant: str = ""  # with the first block key, keeps a conversation on one side of a rollout's split


@dataclass(frozen=True)
class PrefillPick:
    """A prefill policy's answer; the tokens are what the router will account on that worker."""

    worker_id: str
    num_cached_tokens: int  # the prefix it is expected to hold (device tier) or fetch (store tiers)
    predicted_s: float  # predicted prefill time (fetch + compute), not counting the queue ahead of it (real seconds)
    predicted_ttft_s: float  # the queue ahead of it, plus predicted_s


@dataclass(frozen=True)
class Route:
    prefill_worker_id: str
    decode_worker_id: str
    num_cached_tokens: int
    predicted_ttft_s: float
    is_canary: bool = False  # on a rollout's canary side (late binding carries it to Router.bind_decode)


@dataclass(frozen=True)
class Assignment:
    """One routing decision as a load delta (what replicas share)."""

    balancer_id: str
    request_id: str
    assigned_s: float
    prefill_worker_id: str  # "": a late binding's decode half (Router.bind_decode)
    decode_worker_id: str  # "": a route with late binding (its decode worker is bound when the KV is ready)
    num_prompt_tokens: int
    num_uncached_tokens: int  # what the prefill worker will compute
    prefill_s: float  # its predicted prefill time, in the cost model's seconds (each replica applies its time scale)
    decode_arrival_s: float  # when its KV is expected at the decode worker (prefill queue + prefill + transfer)
    block_hashes: tuple[bytes, ...] = ()


class NoWorkerError(Exception):
    """No live worker of a pool serves the model (the balancer answers UNAVAILABLE)."""

    def __init__(self, pool: str, model: str, num_excluded: int) -> None:
        excluded = f" ({num_excluded} excluded)" if num_excluded else ""
        super().__init__(f"no {pool} worker serves model {model!r}{excluded}")
        self.pool = pool
        self.model = model
