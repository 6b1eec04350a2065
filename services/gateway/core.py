"""What both front ends (REST and gRPC) share: keys, models, the mesh view, the pipeline, and the checks that
turn a tokenized prompt into a Generation. Built once by server.py; read-only afterwards."""

from __future__ import annotations

import contextlib
import re
import secrets
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from mesh.pb import common_pb2, encoder_pb2
from mesh.rpc import ServiceError
from mesh.service import Lifecycle
from services.gateway.auth import KeyRing
from services.gateway.catalog import ModelCatalog, ServedModel
from services.gateway.errors import ErrorKind, GatewayError
from services.gateway.image_encoding import ImageEncoding
from services.gateway.mesh_view import MeshView
from services.gateway.output_limits import OutputLimits
from services.gateway.pipeline import Deadline, Generation, Pipeline
from services.gateway.tenancy.cache_salt import request_cache_salt
from services.gateway.tenancy.ledger import UsagePublisher
from services.gateway.tenancy.limit_counters import Demand
from services.gateway.tenancy.limits import Limiter, Reservation
from services.gateway.tenancy.principal import Principal
from services.gateway.tenancy.store import KeyStore

NO_OUTPUT_LIMITS = OutputLimits()
_CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


def new_request_id(client_request_id: str | None = None) -> str:
    """The id the mesh knows a request by. A client's id is kept as a prefix, made unique, so two requests
    sent with the same id never collide in a worker."""
    if client_request_id and _CLIENT_REQUEST_ID.fullmatch(client_request_id):
        return f"{client_request_id}-{secrets.token_hex(4)}"
    return uuid.uuid4().hex


def echoed_request_id(client_request_id: str | None, request_id: str) -> str:
    """What the response's x-request-id says: the client's own id if it sent a usable one."""
    if client_request_id and _CLIENT_REQUEST_ID.fullmatch(client_request_id):
        return client_request_id
    return request_id


def check_scope(principal: Principal | None, api: str, model: str | None = None) -> None:
    """A key scoped to some APIs or models: a 403 naming the field for any other."""
    if principal is None:
        return
    if not principal.may_use_api(api):
        raise GatewayError(ErrorKind.PERMISSION_DENIED, f"this key may not call the {api} API")
    if model is not None and not principal.may_use_model(model):
        raise GatewayError(ErrorKind.PERMISSION_DENIED, f"model: this key may not use the model {model!r}", "model")


@dataclass(frozen=True)
class GatewayCore:
    keys: KeyRing
    catalog: ModelCatalog
    mesh: MeshView
    pipeline: Pipeline
    lifecycle: Lifecycle
    request_timeout_s: float
    images: ImageEncoding | None = None  # None: images are refused
    key_store: KeyStore | None = None  # tenants' keys (tenancy/store.py); None: only KVMESH_API_KEYS
    limiter: Limiter | None = None  # None: no limits are enforced (embedding, unit tests)
    ledger: UsagePublisher | None = None  # None: no usage records (embedding, unit tests)
    cache_secret: bytes = b""  # the server secret, keying tenants' KV roots (tenancy/cache_salt.py)
    worker_id: str = ""  # this gateway's, for the x-kvmesh-gateway-worker header (replicas share a port)
    output_limits: OutputLimits = NO_OUTPUT_LIMITS  # default and maximum output lengths (none: the context's)

    async def authenticate(self, key: str | None) -> Principal | None:
        """Who presents `key`; None for a missing, unknown, expired or revoked key (one answer for all: the
        reply never tells a guesser which). KVMESH_API_KEYS first (the default tenant), then tenants' keys."""
        principal = self.keys.resolve(key)
        if principal is None and self.key_store is not None:
            principal = await self.key_store.resolve(key)
        return principal

    def cache_salt(self, principal: Principal | None, client_salt: str) -> str:
        """The cache_salt a request carries into the mesh: its tenant's KV root (tenancy/cache_salt.py)."""
        return request_cache_salt(self.cache_secret, principal, client_salt)

    async def reserve(self, principal: Principal | None, demand: Demand) -> Reservation | None:
        """Hold the request's tokens against its principal's limits (tenancy/limits.py); None: nothing to hold."""
        if self.limiter is None or principal is None:
            return None
        return await self.limiter.reserve(principal, demand)

    def served_models(self) -> list[ServedModel]:
        """Models this gateway can tokenize that have a live prefill and a live decode worker."""
        return [self.catalog.require(name) for name in self.mesh.served_models(self.catalog.names)]

    def is_ready(self) -> bool:
        return not self.lifecycle.draining and self.mesh.is_ready(self.catalog.names)

    def deadline(self) -> Deadline:
        return Deadline(self.request_timeout_s)

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        """Count the request as in flight (for a graceful stop); refused while draining."""
        try:
            with self.lifecycle.track():
                yield
        except ServiceError as exc:
            raise GatewayError(ErrorKind.UNAVAILABLE, str(exc)) from None

    def generation(
        self,
        request_id: str,
        model: ServedModel,
        prompt_token_ids: list[int],
        sampling: common_pb2.SamplingParams,
        stop: Sequence[str],
        cache_salt: str,
        traffic_class: str,
        prompt_param: str,
        max_tokens_param: str,
        images: tuple[encoder_pb2.PromptImage, ...] = (),
        api_max_tokens: int | None = None,
        block_keys: tuple[bytes, ...] | None = None,
    ) -> Generation:
        """The last checks before the mesh: the output length within the server's bounds (a default where the client
        set none), the prompt and max_tokens fit the context, and workers exist."""
        room = model.context_len - len(prompt_token_ids)
        self.output_limits.apply(model.name, room, sampling, max_tokens_param, api_max_tokens)
        max_tokens = sampling.max_tokens if sampling.HasField("max_tokens") else None
        model.check_lengths(len(prompt_token_ids), max_tokens, prompt_param, max_tokens_param)
        if not self.mesh.is_served(model.name):
            raise GatewayError(ErrorKind.UNAVAILABLE, f"no workers serve {model.name!r} right now; retry shortly")
        return Generation(
            request_id=request_id,
            model=model,
            prompt_token_ids=prompt_token_ids,
            sampling=sampling,
            stop=tuple(stop),
            cache_salt=cache_salt,
            traffic_class=traffic_class,
            images=images,
            block_keys=block_keys,
        )
