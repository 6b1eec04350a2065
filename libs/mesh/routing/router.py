"""Router: one balancer replica's decisions. It owns a LoadView (the only writer) and a policy pair (prefill,
decode), reads the global KV index, and turns each pick into an Assignment that it applies at once and that its
peers apply when they hear it (`apply`).

    router = Router("kvmesh", index, balancer_id="balancer-1")
    route, assignment = router.route(request, prefill_workers, decode_workers, now_s=time.time())
    router.apply(peer_assignment)                  # a peer's decision, heard on NATS
    router.update(worker_state)                    # a heartbeat (route() also takes newer reports it is given)
    router.observe_finished(decode_id, request_id, t, kv, n)  # a request left a decode worker
    router.splits[model] = Split(model, "2.0", weight=5)  # a rollout's step: 5% of conversations to version 2.0

Late binding (`decode_binding="late"`): `route` picks the prefill worker only (the Route's and the Assignment's
decode worker are ""), and `bind_decode` picks the decode worker when the request's KV is ready, with the same
decode policy and view, as a second Assignment (its prefill worker "") that peers apply like any other:

    router = Router("kvmesh", index, decode_binding="late")
    route, assignment = router.route(request, prefill_workers, decode_workers, now_s)   # decode_worker_id ""
    decode_id, bound = router.bind_decode(kv_request, decode_workers, now_s)  # at prefill's end
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mesh.routing.canary import Split, is_canary_request, side, side_of
from mesh.routing.context import CacheIndex, PickContext
from mesh.routing.cost import CostModel
from mesh.routing.decode import DecodePolicy, DeepSeekDecode, LeastKVDecode, LeastRequestsDecode, RoundRobinDecode
from mesh.routing.kvmesh import KvmeshDecode, KvmeshPrefill
from mesh.routing.prefill import (
    CacheAwarePrefill,
    DeepSeekPrefill,
    KvAwarePrefill,
    LeastLoadPrefill,
    PrefillPolicy,
    RoundRobinPrefill,
)
from mesh.routing.state import Assignment, NoWorkerError, Route, RouteRequest, WorkerState
from mesh.routing.view import LoadView


@dataclass(frozen=True)
class PolicySpec:
    prefill: Callable[[], PrefillPolicy]
    decode: Callable[[], DecodePolicy]
    description: str
    optimistic_cache: bool = False  # counts blocks sent to a worker as cached there before its KV events say so


POLICIES: dict[str, PolicySpec] = {
    "round_robin": PolicySpec(RoundRobinPrefill, RoundRobinDecode, "next worker in turn, both pools"),
    "least_load": PolicySpec(LeastLoadPrefill, LeastRequestsDecode, "fewest queued prompt tokens; fewest requests"),
    "cache_aware": PolicySpec(
        CacheAwarePrefill, LeastRequestsDecode, "SGLang: approximate prefix tree with a load guard; fewest requests"
    ),
    "kv_aware": PolicySpec(KvAwarePrefill, LeastKVDecode, "Dynamo: uncached blocks credited by tier; fewest KV blocks"),
    "deepseek": PolicySpec(
        DeepSeekPrefill, DeepSeekDecode, "context-length buckets by compute quota; request count + KV length"
    ),
    "kvmesh": PolicySpec(
        KvmeshPrefill, KvmeshDecode, "predicted TTFT with bounded imbalance; predicted KV growth", optimistic_cache=True
    ),
}
DEFAULT_POLICY = "kvmesh"


def check_policy(name: str) -> str:
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}: expected one of {', '.join(POLICIES)}")
    return name


DECODE_BINDINGS = ("early", "late")  # early: decode chosen with prefill, at the arrival; late: when the KV is ready


def check_decode_binding(name: str) -> str:
    if name not in DECODE_BINDINGS:
        raise ValueError(f"unknown decode binding {name!r}: expected one of {', '.join(DECODE_BINDINGS)}")
    return name


class Router:
    def __init__(
        self,
        policy: str,
        index: CacheIndex,
        cost: CostModel | None = None,
        balancer_id: str = "",
        decode_binding: str = "early",
    ) -> None:
        spec = POLICIES[check_policy(policy)]
        self.policy = policy
        self.decode_binding = check_decode_binding(decode_binding)
        self.index = index  # read only here
        self.balancer_id = balancer_id
        self.view = LoadView(cost or CostModel())
        self.prefill_policy = spec.prefill()
        self.decode_policy = spec.decode()
        self.optimistic_cache = spec.optimistic_cache
        self.num_routes = 0
        self.splits: dict[str, Split] = {}  # model -> its rollout's split; written only by the rollout follower

    def route(
        self, request: RouteRequest, prefill: Sequence[WorkerState], decode: Sequence[WorkerState], now_s: float
    ) -> tuple[Route, Assignment]:
        """The pair for `request` from the pools serving its model (in worker-id order); NoWorkerError when a pool
        has nobody left. With late binding the decode worker is "" (`bind_decode` names it when the KV is ready),
        but the decode pool must still have somebody: a request no decode worker could take is not computed."""
        if request.num_prompt_tokens < 0:
            raise ValueError(f"num_prompt_tokens must not be negative, got {request.num_prompt_tokens}")
        prefill_pool = self._pool(request, prefill, "prefill")
        decode_pool = self._pool(request, decode, "decode")
        for worker in (*prefill_pool, *decode_pool):
            self.view.update(worker)
        ctx = PickContext(request, now_s, self.view, self.index, include_pending=self.optimistic_cache)
        pick = self.prefill_policy.pick(ctx, prefill_pool)
        arrival_s = now_s + pick.predicted_ttft_s + self.view.cost.transfer_s(request.num_prompt_tokens)
        decode_id = ""
        if self.decode_binding == "early":
            decode_id = self.decode_policy.pick(request, decode_pool, self.view, now_s, arrival_s)
        estimate = next(ctx.estimate(w) for w in prefill_pool if w.worker_id == pick.worker_id)
        assignment = Assignment(
            self.balancer_id,
            request.request_id,
            now_s,
            pick.worker_id,
            decode_id,
            request.num_prompt_tokens,
            estimate.num_uncached_tokens,
            estimate.prefill_s,
            arrival_s,
            request.block_hashes,
        )
        self._apply(assignment)
        self.num_routes += 1
        split = self.splits.get(request.model)
        is_canary = split is not None and is_canary_request(split, request)
        return Route(pick.worker_id, decode_id, pick.num_cached_tokens, pick.predicted_ttft_s, is_canary), assignment

    def bind_decode(
        self, request: RouteRequest, decode: Sequence[WorkerState], now_s: float, is_canary: bool = False
    ) -> tuple[str, Assignment]:
        """Late binding: the decode worker for a request whose KV is ready now (`request.num_prompt_tokens`: its KV
        tokens), by the same decode policy `route` uses early, its KV expected there after the transfer. Choosing
        now, the policy knows every request routed after this one whose KV got there sooner (docs/balancer.md).
        During a rollout the decode worker is on the side the route chose (`is_canary`: Route.is_canary).
        NoWorkerError when the pool has nobody left."""
        if request.num_prompt_tokens < 0:
            raise ValueError(f"num_prompt_tokens must not be negative, got {request.num_prompt_tokens}")
        split = self.splits.get(request.model)
        if split is not None:
            decode = side(split, is_canary, request, decode) or decode  # empty: _eligible names the pool
        pool = self._eligible(request, decode, "decode")
        for worker in pool:
            self.view.update(worker)
        arrival_s = now_s + self.view.cost.transfer_s(request.num_prompt_tokens)
        decode_id = self.decode_policy.pick(request, pool, self.view, now_s, arrival_s)
        assignment = Assignment(
            self.balancer_id, request.request_id, now_s, "", decode_id, request.num_prompt_tokens, 0, 0.0, arrival_s
        )
        self._apply(assignment)
        return decode_id, assignment

    def apply(self, assignment: Assignment) -> None:
        """A peer replica's decision; this router's own (same balancer id) were applied when made."""
        if assignment.balancer_id != self.balancer_id:
            self._apply(assignment)

    def update(self, state: WorkerState) -> None:
        self.view.update(state)

    def forget(self, worker_id: str) -> None:
        """The worker left its pool."""
        self.view.forget(worker_id)
        self.prefill_policy.forget(worker_id)

    def observe_output(self, num_output_tokens: int) -> None:
        """A request finished that never reached a decode worker (one output token: prefill's)."""
        self.decode_policy.observe_output(num_output_tokens)

    def observe_finished(
        self, decode_worker_id: str, request_id: str, finished_s: float, num_kv_tokens: int, num_output_tokens: int
    ) -> None:
        """A request left its decode worker (the decode workers' feed): its KV is free, its length known."""
        self.view.finish(decode_worker_id, request_id, finished_s, num_kv_tokens)
        self.decode_policy.observe_output(num_output_tokens)

    def _apply(self, assignment: Assignment) -> None:
        self.view.assign(assignment)
        if assignment.prefill_worker_id:  # "": a late binding's decode half
            self.prefill_policy.observe(assignment, self.view.report(assignment.prefill_worker_id))

    def _pool(self, request: RouteRequest, pool: Sequence[WorkerState], name: str) -> list[WorkerState]:
        """The workers of `pool` this request may go to: its side of the model's rollout split, less the excluded."""
        split = self.splits.get(request.model)
        if split is not None:
            pool = side_of(split, request, pool) or pool  # empty: _eligible names the pool
        return self._eligible(request, pool, name)

    @staticmethod
    def _eligible(request: RouteRequest, pool: Sequence[WorkerState], name: str) -> list[WorkerState]:
        workers = [w for w in pool if w.worker_id not in request.exclude_worker_ids]
        if not workers:
            raise NoWorkerError(name, request.model, len(pool) - len(workers))
        return workers
