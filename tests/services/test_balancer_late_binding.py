"""Late binding in the balancer service, on a real NATS: Route names the prefill worker only, BindDecode names the
decode worker by the policy when prefill's KV is ready, and a peer replica counts the binding it hears (the
policy's own picks are tested with exact values in tests/mesh/test_routing_late_binding.py)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import grpc.aio
import pytest
from prometheus_client import REGISTRY

from kvmesh.nats_server import EmbeddedNats
from mesh import rpc, tls
from mesh.access import PREFILL
from mesh.pb import balancer_pb2, balancer_pb2_grpc, common_pb2
from services.balancer.server import serve
from tests.services.harness import serving, wait_until
from tests.services.test_balancer import _lists, route_request, settings, start_worker, stop_workers


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with EmbeddedNats(store_dir=tmp_path_factory.mktemp("nats")) as nats:
        yield nats.url


def bind_request(
    request_id: str, num_kv_tokens: int, model: str = "m", exclude: tuple[str, ...] = ()
) -> balancer_pb2.BindDecodeRequest:
    return balancer_pb2.BindDecodeRequest(
        request_id=request_id,
        model=model,
        num_kv_tokens=num_kv_tokens,
        exclude_worker_ids=exclude,
    )


def count(name: str, labels: dict[str, str]) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_route_leaves_decode_to_bind_decode_whose_choice_peers_hear(nats_url: str) -> None:
    interval_s = 2.0  # reports slower than the test: only the shared binding can tell the second replica
    workers = {
        name: await start_worker(nats_url, name, role, interval_s, **load)
        for name, role, load in (
            ("p-7", common_pb2.ROLE_PREFILL, {}),
            ("d-8", common_pb2.ROLE_DECODE, {"num_kv_tokens": 100}),
            ("d-9", common_pb2.ROLE_DECODE, {}),
        )
    }
    one = settings(nats_url, "balancer-l1", "kv_aware", interval_s, decode_binding="late")
    two = settings(nats_url, "balancer-l2", "kv_aware", interval_s, decode_binding="late")
    late_before = count("kvmesh_balancer_decode_bindings_total", {"binding": "late"})
    early_before = count("kvmesh_balancer_decode_bindings_total", {"binding": "early"})
    as_prefill = rpc.Channels(tls.load_credentials(PREFILL))  # only prefill may bind
    async with serving(serve, one) as gateway_channel, serving(serve, two) as second_gateway_channel:
        for stub in map(balancer_pb2_grpc.BalancerStub, (gateway_channel, second_gateway_channel)):
            await wait_until(lambda stub=stub: _lists(stub, set(workers)), timeout_s=5)
        peers_before = count("kvmesh_balancer_peer_assignments_total", {})
        route = await balancer_pb2_grpc.BalancerStub(gateway_channel).Route(
            route_request(num_prompt_tokens=5000, request_id="big")
        )
        assert (route.prefill.worker_id, route.HasField("decode")) == ("p-7", False)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await balancer_pb2_grpc.BalancerStub(gateway_channel).BindDecode(bind_request("big", 5000))
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        first, second = (balancer_pb2_grpc.BalancerStub(as_prefill.get(f"127.0.0.1:{s.grpc_port}")) for s in (one, two))

        bound = await first.BindDecode(bind_request("big", 5000))
        assert (bound.decode.worker_id, bound.decode.address) == ("d-9", "127.0.0.1:7009")  # less KV than d-8

        async def heard() -> bool:  # both of the first replica's decisions, the route's and the binding's
            # (waiting for one more than before the binding passed when the route's came late, before the binding's)
            return count("kvmesh_balancer_peer_assignments_total", {}) >= peers_before + 2

        await wait_until(heard, timeout_s=5)
        # the peer counts big's 5,000 tokens on d-9: d-8's 100 are fewer
        assert (await second.BindDecode(bind_request("small", 10))).decode.worker_id == "d-8"
        assert (await second.BindDecode(bind_request("other", 10, exclude=("d-8",)))).decode.worker_id == "d-9"
        assert count("kvmesh_balancer_decode_bindings_total", {"binding": "late"}) - late_before == 3
        assert count("kvmesh_balancer_decode_bindings_total", {"binding": "early"}) == early_before

        with pytest.raises(grpc.aio.AioRpcError) as error:
            await first.BindDecode(bind_request("r", 10, model="other"))
        assert (error.value.code(), error.value.details()) == (
            grpc.StatusCode.UNAVAILABLE,
            "no decode worker serves model 'other'",
        )
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await first.BindDecode(bind_request("r", 10, model=""))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    await as_prefill.close()
    await stop_workers(workers)
