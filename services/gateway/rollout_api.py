"""Canary rollouts in the admin API (docs/operations.md, Canary rollouts): start one, read them, abort one. The
state lives in JetStream KV (mesh.rollouts); the balancers split traffic by it and judge its steps. Guarded by the
admin key like the rest of /admin/v1/.

    POST /admin/v1/rollouts                  RolloutCreate -> 201 the rollout (its first step's weight at once)
    GET  /admin/v1/rollouts                  every rollout, oldest first
    GET  /admin/v1/rollouts/{rollout_id}     one, with its decisions
    POST /admin/v1/rollouts/{rollout_id}/abort   -> the rollout, aborted: weight 0, the canary drained
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from mesh.logging import get_logger
from mesh.pb import events_pb2
from mesh.rollouts import ABORTED, RUNNING, RolloutConflict, RolloutStore
from services.gateway.api_models.admin import RolloutCreate
from services.gateway.api_models.base import validated
from services.gateway.catalog import off_loop
from services.gateway.errors import ErrorKind, GatewayError, invalid
from services.gateway.rest import CORE_KEY, dumps, json_body
from services.gateway.tenancy.admin_api import ADMIN_PREFIX, require_admin

MAX_ABORT_TRIES = 5  # compare-and-sets lost to the balancers' decisions before giving up (each re-reads)
log = get_logger(__name__)


def rollout_json(rollout: events_pb2.Rollout) -> dict[str, Any]:
    gates = rollout.gates
    return {
        "id": rollout.rollout_id,
        "object": "rollout",
        "model": rollout.model,
        "stable_version": rollout.stable_version,
        "canary_version": rollout.canary_version,
        "state": rollout.state,
        "weight": rollout.weight,
        "steps": list(rollout.steps),
        "step_index": rollout.step_index,
        "check_interval_s": rollout.check_interval_s,
        "gates": {
            "max_ttft_p95_ratio": gates.max_ttft_p95_ratio,
            "max_itl_p95_ratio": gates.max_itl_p95_ratio,
            "max_error_rate_increase": gates.max_error_rate_increase,
            "max_cost_per_token_ratio": gates.max_cost_per_token_ratio,
            "min_samples": gates.min_samples,
            "quality_prompts": [p.text for p in gates.quality_prompts],
            "quality_max_tokens": gates.quality_max_tokens,
        },
        "quality": {"result": rollout.quality.result, "reason": rollout.quality.reason, "at_ms": rollout.quality.at_ms}
        if rollout.HasField("quality")
        else None,
        "created_ms": rollout.created_ms,
        "decisions": [
            {"at_ms": d.at_ms, "action": d.action, "weight": d.weight, "reason": d.reason} for d in rollout.decisions
        ],
    }


def new_rollout(body: RolloutCreate, now_ms: int, prompts: list[events_pb2.QualityPrompt]) -> events_pb2.Rollout:
    gates = body.gates.model_dump(exclude={"quality_prompts"})
    return events_pb2.Rollout(
        rollout_id=f"ro_{secrets.token_hex(6)}",
        model=body.model,
        stable_version=body.stable_version,
        canary_version=body.canary_version,
        steps=body.steps,
        check_interval_s=body.check_interval_s,
        gates=events_pb2.RolloutGates(**gates, quality_prompts=prompts),
        state=RUNNING,
        step_index=0,
        weight=body.steps[0],
        created_ms=now_ms,
        step_started_ms=now_ms,
        decisions=[events_pb2.RolloutDecision(at_ms=now_ms, action="start", weight=body.steps[0], reason="started")],
    )


async def quality_prompts(request: web.Request, body: RolloutCreate) -> list[events_pb2.QualityPrompt]:
    """The golden prompts as the model sees them: each a user message in its chat template (the balancers that run
    the probe have no tokenizer). A 400 naming `model` if this gateway does not serve it."""
    if not body.gates.quality_prompts:
        return []
    model = request.app[CORE_KEY].catalog.get(body.model)
    if model is None:
        raise invalid(
            "model",
            f"this gateway does not serve {body.model!r}, so it cannot render the quality probe's prompts; "
            "start the rollout where the model is served, or set gates.quality_prompts to [] for no probe",
        )
    rendered = [await off_loop(model.render_chat, [{"role": "user", "content": t}]) for t in body.gates.quality_prompts]
    return [
        events_pb2.QualityPrompt(text=t, token_ids=ids)
        for t, ids in zip(body.gates.quality_prompts, rendered, strict=True)
    ]


def _store(request: web.Request) -> RolloutStore:
    admin = require_admin(request)
    if admin.bus is None:
        raise GatewayError(ErrorKind.UNAVAILABLE, "rollouts need NATS: this gateway has no bus")
    return RolloutStore(admin.bus)


@contextlib.asynccontextmanager
async def _reachable() -> AsyncIterator[None]:
    """The rollout bucket unreachable (NATS away, no JetStream) is a 503, not a 500."""
    try:
        yield
    except (GatewayError, RolloutConflict):
        raise
    except Exception as exc:
        log.warning("rollout store unreachable", exc_info=True)
        raise GatewayError(ErrorKind.UNAVAILABLE, f"the rollout store is unreachable: {type(exc).__name__}") from exc


def _json(data: Any, status: int = 200) -> web.Response:
    return web.json_response(data, status=status, dumps=dumps)


async def create_rollout(request: web.Request) -> web.Response:
    store = _store(request)
    body = validated(RolloutCreate, await json_body(request))
    prompts = await quality_prompts(request, body)
    async with _reachable():
        running = [r for r in await store.list() if r.model == body.model and r.state == RUNNING]
        if running:
            raise GatewayError(
                ErrorKind.CONFLICT, f"model {body.model!r} has a running rollout: {running[0].rollout_id}"
            )
        rollout = new_rollout(body, int(time.time() * 1000), prompts)
        await store.create(rollout)
    log.info(
        "rollout started",
        rollout_id=rollout.rollout_id,
        model=rollout.model,
        stable_version=rollout.stable_version,
        canary_version=rollout.canary_version,
        weight=rollout.weight,
    )
    return _json(rollout_json(rollout), 201)


async def list_rollouts(request: web.Request) -> web.Response:
    store = _store(request)
    async with _reachable():
        rollouts = await store.list()
    return _json({"object": "list", "data": [rollout_json(r) for r in rollouts]})


async def _found(store: RolloutStore, rollout_id: str) -> tuple[events_pb2.Rollout, int]:
    async with _reachable():
        found = await store.get(rollout_id) if rollout_id.startswith("ro_") else None
    if found is None:
        raise GatewayError(ErrorKind.NOT_FOUND, f"no rollout {rollout_id!r}")
    return found


async def get_rollout(request: web.Request) -> web.Response:
    rollout, _ = await _found(_store(request), request.match_info["rollout_id"])
    return _json(rollout_json(rollout))


async def abort_rollout(request: web.Request) -> web.Response:
    store = _store(request)
    for _ in range(MAX_ABORT_TRIES):
        rollout, revision = await _found(store, request.match_info["rollout_id"])
        if rollout.state != RUNNING:
            raise GatewayError(ErrorKind.CONFLICT, f"rollout {rollout.rollout_id} is already {rollout.state}")
        now_ms = int(time.time() * 1000)
        rollout.state, rollout.weight = ABORTED, 0
        rollout.decisions.append(events_pb2.RolloutDecision(at_ms=now_ms, action="abort", weight=0, reason="admin"))
        try:
            async with _reachable():
                await store.update(rollout, revision)
        except RolloutConflict:  # a balancer decided meanwhile: read again
            continue
        log.info("rollout aborted", rollout_id=rollout.rollout_id, model=rollout.model)
        return _json(rollout_json(rollout))
    raise GatewayError(ErrorKind.CONFLICT, "the rollout kept changing; try again")


def add_routes(app: web.Application) -> None:
    app.router.add_post(f"{ADMIN_PREFIX}/rollouts", create_rollout)
    app.router.add_get(f"{ADMIN_PREFIX}/rollouts", list_rollouts)
    app.router.add_get(f"{ADMIN_PREFIX}/rollouts/{{rollout_id}}", get_rollout)
    app.router.add_post(f"{ADMIN_PREFIX}/rollouts/{{rollout_id}}/abort", abort_rollout)
