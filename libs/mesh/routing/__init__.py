"""Routing: the balancer's policies, one implementation each, shared by the live balancer (services/balancer) and
the trace-driven simulator (`kvmesh bench route`).

    cost.py      CostModel: prefill, fetch, transfer and decode step times (DeepSeek-V3 on H800 by default)
    state.py     WorkerState (a worker's report), RouteRequest, PrefillPick, Route, Assignment (a decision's delta)
    view.py      LoadView: reports + optimistic accounting of assignments until the next report
    context.py   PickContext: one request's cached prefix per worker (global KV index) and predicted prefill time
    prefill.py   round_robin, least_load, cache_aware (SGLang), kv_aware (Dynamo), deepseek prefill policies
    decode.py    the baselines' decode policies
    kvmesh.py    the default policy: predicted TTFT with bounded imbalance; predicted KV growth
    router.py    Router (one balancer replica), POLICIES (the names), early or late decode binding
    encoder.py   pick_encoder: the encoder pool's policy
    capacity.py  recommended replica counts per pool from observed load
    canary.py    Split: a rollout's share of conversations for a canary version, sticky per conversation
"""

from mesh.routing.canary import Split
from mesh.routing.cost import CostModel
from mesh.routing.router import DECODE_BINDINGS, DEFAULT_POLICY, POLICIES, Router, check_decode_binding, check_policy
from mesh.routing.state import Assignment, NoWorkerError, PrefillPick, Route, RouteRequest, WorkerState
from mesh.routing.view import LoadView

__all__ = [
    "DECODE_BINDINGS",
    "DEFAULT_POLICY",
    "POLICIES",
    "Assignment",
    "CostModel",
    "LoadView",
    "NoWorkerError",
    "PrefillPick",
    "Route",
    "RouteRequest",
    "Router",
    "Split",
    "WorkerState",
    "check_decode_binding",
    "check_policy",
]
