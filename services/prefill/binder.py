"""Late binding's balancer client: which decode worker takes a request's KV, asked (Balancer.BindDecode) as the KV
becomes ready (when the step that computes the whole prompt starts, or once the first token is sampled). The
balancers are those heard on NATS; each call starts with the next one, and one that errs or cannot be reached passes
the question to the next, as the gateway's Route does."""

from __future__ import annotations

import grpc
import grpc.aio

from mesh import rpc
from mesh.discovery import KnownWorker, WorkerRegistry
from mesh.logging import get_logger
from mesh.pb import balancer_pb2, balancer_pb2_grpc, common_pb2
from services.prefill.prefiller import BindError, DecodeTarget, PrefillJob

log = get_logger(__name__)


class BalancerBinder:
    def __init__(
        self, registry: WorkerRegistry, channels: rpc.Channels, timeout_s: float = rpc.ROUTE_TIMEOUT_S
    ) -> None:
        self.registry = registry  # read only here: the live balancers
        self.channels = channels
        self.timeout_s = timeout_s
        self._next = 0  # the balancer the next call starts with; written only by `bind`

    async def bind(self, job: PrefillJob, num_kv_tokens: int) -> DecodeTarget:
        """Raises BindError when no balancer answered with a decode worker."""
        request = balancer_pb2.BindDecodeRequest(
            request_id=job.request_id,
            model=job.model,
            num_kv_tokens=num_kv_tokens,
            canary=job.canary,
            exclude_worker_ids=job.exclude_decode_worker_ids,
        )
        errors = []
        for balancer in self._balancers():
            stub = balancer_pb2_grpc.BalancerStub(self.channels.get(balancer.info.address))
            try:
                response: balancer_pb2.BindDecodeResponse = await stub.BindDecode(
                    request, timeout=self.timeout_s, metadata=rpc.metadata(job.request_id)
                )
            except grpc.aio.AioRpcError as error:
                log.warning("bind failed", balancer=balancer.worker_id, code=error.code().name, details=error.details())
                errors.append(f"{balancer.worker_id}: {error.code().name}: {error.details() or ''}")
                continue
            decode = response.decode
            return DecodeTarget(decode.worker_id, decode.address, decode.data_address)
        why = "; ".join(errors) if errors else "no balancer is live"
        raise BindError(f"no decode worker bound for request {job.request_id!r} ({why})")

    def _balancers(self) -> list[KnownWorker]:
        live = self.registry.workers(common_pb2.ROLE_BALANCER)
        if not live:
            return []
        start = self._next % len(live)
        self._next += 1
        return live[start:] + live[:start]
