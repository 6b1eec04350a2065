"""expert_lb: the rebalancer's window and plans with exact values, then the role on a real NATS and gRPC, fed by a
fake worker's reports, and by a real engine (deepseek-tiny on 2 expert-parallel ranks) whose ExpertSync reports
its counts and applies the plans while it generates."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import grpc.aio
import numpy as np
import pytest
from prometheus_client import REGISTRY

from engine_core import EngineConfig, LLMEngine, SamplingParams, model_store
from engine_core.async_engine import AsyncEngine
from kvmesh.nats_server import EmbeddedNats, free_port
from mesh import subjects
from mesh.access import DECODE
from mesh.bus import Bus
from mesh.compute.experts import ExpertSync
from mesh.pb import expert_lb_pb2, expert_lb_pb2_grpc
from services.expert_lb.config import ExpertLBSettings
from services.expert_lb.rebalancer import ExpertRebalancer, LoadReport, ModelShape, compute
from services.expert_lb.server import serve
from tests.services.harness import serving, wait_until

SHAPE = ModelShape(num_layers=1, first_layer=1, num_experts=4, num_groups=1, num_slots=6, num_gpus=3)


def report(worker_id: str, counts: list[int], plan_version: int = 0) -> LoadReport:
    return LoadReport(worker_id, "m", SHAPE, np.array([counts]), plan_version)


# --- ExpertRebalancer ------------------------------------------------------------------------------------------


def test_plans_follow_the_window_of_every_workers_counts() -> None:
    rebalancer = ExpertRebalancer(
        window_intervals=2, num_nodes=1, policy="auto", max_moves_fraction=1.0, min_gain=0.0, replan_gain=0.05
    )
    rebalancer.record(report("w1", [6, 3, 1, 2]))
    rebalancer.record(report("w2", [2, 1, 1, 0]))
    jobs, resend = rebalancer.begin_plans()
    assert (len(jobs), resend) == (1, [])
    assert jobs[0].weight.tolist() == [[8, 4, 2, 2]]
    assert jobs[0].current.tolist() == [[0, 1, 2, 3, 0, 1]]  # what workers run before any plan
    plan = rebalancer.commit(jobs[0], compute(jobs[0]), now_ms=1000)
    assert plan is not None
    # from GPUs (0, 1) (2, 3) (0, 1): expert 1's second copy and expert 3 trade places, 6 4 6 tokens
    assert (plan.version, plan.policy, plan.phy2log.tolist()) == (1000, "global", [[0, 1, 2, 1, 0, 3]])
    assert (plan.gpu_loads.tolist(), plan.num_moved) == ([[6.0, 4.0, 6.0]], 2)
    assert rebalancer.plan("m") is plan

    jobs, _ = rebalancer.begin_plans()  # the same window: the same plan, nothing to publish
    assert rebalancer.commit(jobs[0], compute(jobs[0]), now_ms=900) is None
    rebalancer.record(report("w3", [0, 0, 0, 0], plan_version=0))  # a late worker runs the default placement
    jobs, resend = rebalancer.begin_plans()
    assert (jobs, [r.version for r in resend]) == ([], [1000])  # the window is empty now: no plan, but a resend


def test_a_changed_layout_starts_the_model_over() -> None:
    rebalancer = ExpertRebalancer(2, 1, "auto", 1.0, 0.0, 0.05)
    rebalancer.record(report("w1", [6, 3, 1, 2]))
    jobs, _ = rebalancer.begin_plans()
    rebalancer.commit(jobs[0], compute(jobs[0]), now_ms=5)
    wider = ModelShape(num_layers=1, first_layer=1, num_experts=4, num_groups=1, num_slots=8, num_gpus=4)
    rebalancer.record(LoadReport("w1", "m", wider, np.array([[1, 1, 1, 1]]), 5))
    assert rebalancer.plan("m") is None
    with pytest.raises(ValueError, match="do not match 1 layers of 4 experts"):
        rebalancer.record(LoadReport("w1", "m", wider, np.array([[1, 1, 1]]), 5))


# --- the service on a real NATS ------------------------------------------------------------------------------------

INTERVAL_S = 0.2


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with EmbeddedNats(store_dir=tmp_path_factory.mktemp("nats")) as nats:
        yield nats.url


def settings(nats_url: str, name: str) -> ExpertLBSettings:
    return ExpertLBSettings(
        nats_url=nats_url,
        grpc_port=free_port(),
        http_port=free_port(),
        worker_id=name,
        expert_plan_interval_s=INTERVAL_S,
        expert_max_moves_fraction=1.0,
    )


async def get_plan(stub: expert_lb_pb2_grpc.ExpertBalancerStub, model: str) -> expert_lb_pb2.ExpertPlan | None:
    try:
        return await stub.GetPlan(expert_lb_pb2.GetPlanRequest(model=model))
    except grpc.aio.AioRpcError as error:
        assert error.code() == grpc.StatusCode.NOT_FOUND
        return None


async def test_service_plans_from_reports_and_publishes(nats_url: str) -> None:
    moves_before = REGISTRY.get_sample_value("kvmesh_expert_moves_total", {"model": "fake-moe"}) or 0.0
    async with serving(serve, settings(nats_url, "expert-lb-test"), DECODE) as channel:
        stub = expert_lb_pb2_grpc.ExpertBalancerStub(channel)
        assert await get_plan(stub, "fake-moe") is None
        worker = await Bus.connect(nats_url, name="fake-worker")
        plans: asyncio.Queue[expert_lb_pb2.ExpertPlan] = asyncio.Queue()

        async def on_plan(plan: expert_lb_pb2.ExpertPlan, subject: str) -> None:
            plans.put_nowait(plan)

        await worker.subscribe(subjects.expert_plan("fake-moe"), expert_lb_pb2.ExpertPlan, on_plan)
        await worker.publish(
            subjects.expert_load("fake-moe"),
            expert_lb_pb2.ExpertLoad(
                worker_id="fake-worker",
                model="fake-moe",
                num_layers=1,
                num_experts=4,
                counts=[8, 4, 2, 2],
                step=1,
                first_layer=3,
                num_groups=1,
                num_physical_experts=6,
                num_gpus=3,
            ),
        )
        await worker.publish(
            subjects.expert_load("fake-moe"),
            expert_lb_pb2.ExpertLoad(
                worker_id="fake-worker", model="fake-moe", num_layers=1, num_experts=4, counts=[1, 2, 3], step=2
            ),
        )
        plan = await asyncio.wait_for(plans.get(), timeout=5)  # the malformed second report was dropped
        assert (list(plan.phy2log), plan.num_moved, plan.num_gpus, plan.policy) == ([0, 1, 2, 1, 0, 3], 2, 3, "global")
        assert list(plan.gpu_loads) == [6.0, 4.0, 6.0] and plan.balancedness[0] == pytest.approx(16 / 18)
        assert await get_plan(stub, "fake-moe") == plan
        assert REGISTRY.get_sample_value(
            "kvmesh_expert_balancedness", {"model": "fake-moe", "layer": "3"}
        ) == pytest.approx(16 / 18)
        moves = REGISTRY.get_sample_value("kvmesh_expert_moves_total", {"model": "fake-moe"})
        assert moves is not None and moves - moves_before == 2
        await worker.close()


async def test_a_worker_reports_and_applies_plans_while_it_generates(nats_url: str) -> None:
    path = str(model_store.ensure("deepseek-tiny"))
    engine = LLMEngine(
        EngineConfig(
            path, device="cpu", num_kv_blocks=64, expert_parallel_size=2, num_redundant_experts=2, served_name="tiny-ep"
        )
    )
    async_engine = AsyncEngine(engine, name="engine-tiny-ep")
    await async_engine.start()
    async with serving(serve, settings(nats_url, "expert-lb-engine"), DECODE) as channel:
        stub = expert_lb_pb2_grpc.ExpertBalancerStub(channel)
        bus = await Bus.connect(nats_url, name="worker-ep")
        sync = ExpertSync({"tiny-ep": async_engine}, bus, "worker-ep", report_steps=1)
        await sync.start()
        try:
            params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
            versions, num_tokens = set(), 0
            async for out in async_engine.generate("r", [1, 5, 9, 33, 7], params):
                num_tokens += len(out.new_token_ids)
                versions.add(sync.applied_version["tiny-ep"])
            assert num_tokens == 64  # nothing paused or dropped the request
            assert len(versions) > 1  # plans were applied while it generated

            async def converged() -> bool:  # the engine runs the plan expert_lb serves
                plan = await get_plan(stub, "tiny-ep")
                version, phy2log = await async_engine.call(lambda e: (e.experts.version, e.experts.phy2log()))  # type: ignore[union-attr]
                return (
                    plan is not None
                    and version == plan.version
                    and [x for row in phy2log for x in row] == list(plan.phy2log)
                )

            await wait_until(converged, timeout_s=10)
            plan = await get_plan(stub, "tiny-ep")
            assert plan is not None and (plan.num_physical_experts, plan.num_gpus, plan.first_layer) == (18, 2, 1)
        finally:
            await sync.stop()
            await bus.close()
            await async_engine.stop()
