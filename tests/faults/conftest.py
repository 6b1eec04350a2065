"""One mesh of real processes for every fault test (`kvmesh up`'s launcher, an embedded NATS, deepseek-tiny):
two replicas of each role a request passes through, one KV store, the expert rebalancer; and a steady load of
streamed chats, with and without an image, that runs from the first fault test to the last. Module-scoped: the
one module that uses it releases its processes when it ends, not at the end of the session."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kvmesh.bench.fault_run import MODEL, FaultSuite, mesh_plan_args
from kvmesh.bench.load import Load
from kvmesh.up import Mesh
from tests.integration.conftest import API_KEY, start_mesh


@pytest.fixture(scope="module")
def fault_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    log_path = tmp_path_factory.mktemp("faults") / "mesh.log"
    plan = mesh_plan_args()
    mesh = start_mesh(log_path, env_extra=plan.pop("env"), **plan)
    yield mesh
    mesh.stop()


@pytest.fixture(scope="module")
def load(fault_mesh: Mesh) -> Iterator[Load]:
    load = Load(fault_mesh.base_url, API_KEY, MODEL, concurrency=3, kinds=("chat", "image"), max_tokens=12).start()
    time.sleep(2.0)  # a baseline before the first fault
    yield load
    load.stop()


@pytest.fixture(scope="module")
def suite(fault_mesh: Mesh, load: Load) -> FaultSuite:
    return FaultSuite(fault_mesh, load, API_KEY, observe_s=2.0, probe_tokens=12)
