"""The gateway's view of slow decode workers (services/gateway/mesh_view.py over mesh/latency_outliers.py): which
are left out of routes, and how long a stream on one waits before it migrates. Unit level: a registry of known
workers and a clock of the test's; the migration itself is tested in test_gateway_retries_and_migration.py."""

from __future__ import annotations

import pytest

from mesh.config import SettingError, load_settings
from mesh.discovery import KnownWorker
from mesh.latency_outliers import LatencyRule
from mesh.pb import common_pb2
from services.gateway.config import GatewaySettings
from services.gateway.mesh_view import MeshView

MODEL = "deepseek-tiny"


class Workers:
    """The registry's side: decode workers serving MODEL; `failing` ones are ejected for failed checks."""

    def __init__(self, *worker_ids: str) -> None:
        self.worker_ids = list(worker_ids)
        self.failing: set[str] = set()

    def workers(self, role: int | None = None, model: str | None = None) -> list[KnownWorker]:
        info = [
            common_pb2.WorkerInfo(worker_id=w, role=common_pb2.ROLE_DECODE, models=[MODEL]) for w in self.worker_ids
        ]
        return [
            KnownWorker(i, common_pb2.WorkerLoad(), 0)
            for i in info
            if role in (None, common_pb2.ROLE_DECODE) and model in (None, MODEL) and i.worker_id not in self.failing
        ]

    def record_failure(self, worker_id: str) -> None:
        self.failing.add(worker_id)


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def view_with(workers: Workers, clock: Clock) -> MeshView:
    return MeshView(workers, LatencyRule(factor=3.0, window_s=5.0, min_samples=4, ejection_s=10.0), clock)


def report(view: MeshView, clock: Clock, gaps: dict[str, float], num_rounds: int = 5) -> None:
    """A round a second: one token gap of each worker (seconds)."""
    for _ in range(num_rounds):
        clock.now_s += 1.0
        for worker, gap_s in gaps.items():
            view.record_token_gap(MODEL, worker, gap_s, 1)


def test_a_slow_worker_leaves_the_routes_unless_it_is_the_last_one_left() -> None:
    workers, clock = Workers("d0", "d1", "d2"), Clock()
    view = view_with(workers, clock)
    clock.now_s += 1.0
    view.record_token_gap(MODEL, "d1", 0.2, 2)  # 0.1 s a token
    report(view, clock, {"d1": 0.1, "d2": 0.12, "d0": 0.5})  # over 3x the others' median (0.11) throughout
    assert view.slow_decode_ids(MODEL) == ["d0"]
    assert view.slow_decode_ids(MODEL, excluded=["d1"]) == ["d0"]  # d2 is left
    assert view.slow_decode_ids(MODEL, excluded=["d0", "d1"]) == []  # already out
    assert view.slow_decode_ids(MODEL, excluded=["d1", "d2"]) == []  # the slow one is all there is
    clock.now_s += 10.0
    assert view.slow_decode_ids(MODEL) == []  # its ejection time is over


def test_a_stream_waits_factor_times_the_pools_latency_once_its_worker_is_out() -> None:
    workers, clock = Workers("d0", "d1"), Clock()
    view = view_with(workers, clock)
    report(view, clock, {"d1": 0.1, "d0": 0.1})
    assert view.stall_limit_s(MODEL, "d0") is None  # in the routes: it is waited for
    report(view, clock, {"d1": 0.1, "d0": 0.5})
    assert view.stall_limit_s(MODEL, "d0") == pytest.approx(0.3)  # slow: 3 x d1's 0.1 s
    assert view.stall_limit_s(MODEL, "d1") is None
    workers.failing.add("d1")
    assert view.stall_limit_s(MODEL, "d1") is None  # out for failed checks, but nobody left to compare with
    workers.failing.discard("d1")
    clock.now_s += 10.0  # d0 back in the routes; d1's samples out of the window
    report(view, clock, {"d1": 0.1})
    workers.failing.add("d0")
    assert view.stall_limit_s(MODEL, "d0") == pytest.approx(0.3)  # out for failed checks (a stopped process)


def test_a_stream_on_a_worker_out_for_failed_checks_waits_the_unrouted_limit_when_nothing_compares() -> None:
    """A stopped decode worker sends no token to judge, and the pool's other workers may have too few samples to
    give a latency (little traffic): its streams then wait `unrouted_stall_s`, not until it wakes up."""
    workers, clock = Workers("d0", "d1"), Clock()
    rule = LatencyRule(factor=3.0, window_s=5.0, min_samples=4, ejection_s=10.0)
    view = MeshView(workers, rule, clock, unrouted_stall_s=7.5)
    assert view.stall_limit_s(MODEL, "d1") is None  # in the routes
    workers.failing.add("d1")
    assert view.stall_limit_s(MODEL, "d1") == 7.5  # d0 has no samples
    report(view, clock, {"d0": 0.1})
    assert view.stall_limit_s(MODEL, "d1") == pytest.approx(0.3)  # d0's latency known: 3 x 0.1 s
    workers.worker_ids.remove("d1")  # gone from the registry (left, or pruned once ejected)
    assert view.stall_limit_s(MODEL, "d1") == pytest.approx(0.3)
    clock.now_s += 10.0  # d0's samples out of the window
    assert view.stall_limit_s(MODEL, "d1") == 7.5
    off = MeshView(workers, clock=clock, unrouted_stall_s=7.5)  # no latency rule: the health checks still count
    assert (off.watches_stalls, off.stall_limit_s(MODEL, "d1"), off.stall_limit_s(MODEL, "d0")) == (True, 7.5, None)


def test_off_no_worker_is_slow_and_no_stream_leaves() -> None:
    workers, clock = Workers("d0", "d1"), Clock()
    view = MeshView(workers, clock=clock)
    report(view, clock, {"d1": 0.1, "d0": 5.0})
    workers.failing.add("d0")
    assert (view.slow_decode_ids(MODEL), view.stall_limit_s(MODEL, "d0"), view.watches_stalls) == ([], None, False)


def test_a_bad_slow_decode_setting_names_its_variable() -> None:
    env = {"KVMESH_API_KEYS": "sk-a", "KVMESH_SLOW_DECODE_FACTOR": "0.5"}
    with pytest.raises(SettingError) as raised:
        load_settings(GatewaySettings, env)
    assert str(raised.value) == "KVMESH_SLOW_DECODE_FACTOR=0.5: must be over 1 (0: never eject for latency)"
    with pytest.raises(SettingError, match=r"^KVMESH_SLOW_DECODE_MIN_SAMPLES=0: must be at least 1$"):
        load_settings(GatewaySettings, {"KVMESH_API_KEYS": "sk-a", "KVMESH_SLOW_DECODE_MIN_SAMPLES": "0"})
    settings = load_settings(GatewaySettings, {"KVMESH_API_KEYS": "sk-a", "KVMESH_SLOW_DECODE_FACTOR": "0"})
    assert settings.slow_decode == LatencyRule(factor=0, window_s=5.0, min_samples=8, ejection_s=10.0, min_itl_s=0.005)
