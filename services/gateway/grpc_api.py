"""The Gateway gRPC service: Generate streams one generation through the same pipeline as the REST API;
ListModels. The key comes in `authorization: Bearer <key>` metadata. GatewayError -> status code happens in
errors.py (ErrorKind.grpc_code); this module only converts messages."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import grpc.aio

from mesh.logging import REQUEST_ID_KEY, bind_request_id, get_logger
from mesh.pb import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.gateway.auth import bearer_key
from services.gateway.catalog import ServedModel
from services.gateway.core import GatewayCore, new_request_id
from services.gateway.errors import ErrorKind, GatewayError, invalid
from services.gateway.openai_api import MAX_STOP_STRINGS, ROLES
from services.gateway.pipeline import Delta, Generation, GenerationStream
from services.gateway.sampling import check_wire
from services.gateway.telemetry import RequestRecord

GENERATE_API = "grpc.generate"
log = get_logger(__name__)


def _metadata(context: grpc.aio.ServicerContext, key: str) -> str | None:
    for item_key, value in context.invocation_metadata() or ():
        if item_key == key:
            return str(value)
    return None


def _prompt(request: gateway_pb2.GenerateRequest, model: ServedModel) -> tuple[list[int], str]:
    """(prompt token ids, the field they came from) from exactly one of messages, prompt, prompt_token_ids."""
    given = [name for name, present in (("messages", bool(request.messages)), ("prompt", bool(request.prompt)),
                                        ("prompt_token_ids", bool(request.prompt_token_ids))) if present]
    if len(given) != 1:
        raise invalid("messages", "give exactly one of messages, prompt and prompt_token_ids")
    if given[0] == "messages":
        messages = []
        for index, message in enumerate(request.messages):
            if message.role not in ROLES:
                raise invalid(f"messages[{index}].role", "role must be one of system, developer, user, assistant")
            messages.append({"role": ROLES[message.role], "content": message.content})
        return model.render_chat(messages), "messages"
    if given[0] == "prompt":
        return model.encode_prompt(request.prompt), "prompt"
    token_ids = list(request.prompt_token_ids)
    model.check_token_ids(token_ids, "prompt_token_ids")
    return token_ids, "prompt_token_ids"


def to_generation(core: GatewayCore, request: gateway_pb2.GenerateRequest, request_id: str) -> Generation:
    model = core.catalog.require(request.model)
    token_ids, prompt_param = _prompt(request, model)
    sampling = request.sampling if request.HasField("sampling") else common_pb2.SamplingParams()
    check_wire(sampling)
    if len(request.stop) > MAX_STOP_STRINGS:
        raise invalid("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(request.stop)}")
    return core.generation(request_id, model, token_ids, sampling, list(request.stop), request.cache_salt,
                           request.traffic_class, prompt_param, "sampling.max_tokens")


def _response(request_id: str, stream: GenerationStream, delta: Delta) -> gateway_pb2.GenerateResponse:
    response = gateway_pb2.GenerateResponse(
        request_id=request_id, text=delta.text, token_ids=delta.token_ids,
        finish_reason=delta.finish_reason,  # type: ignore[arg-type]
        prefill_worker=stream.placement.prefill_worker, decode_worker=stream.placement.decode_worker)
    if delta.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
        usage = stream.usage
        response.usage.CopyFrom(gateway_pb2.Usage(prompt_tokens=usage.prompt_tokens,
                                                  completion_tokens=usage.completion_tokens,
                                                  cached_tokens=usage.cached_tokens))
    return response


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, core: GatewayCore) -> None:
        self.core = core

    def _authenticate(self, context: grpc.aio.ServicerContext) -> None:
        if not self.core.keys.is_valid(bearer_key(_metadata(context, "authorization"))):
            raise GatewayError(ErrorKind.INVALID_API_KEY, "missing or incorrect API key in 'authorization' metadata")

    async def Generate(self, request: gateway_pb2.GenerateRequest,  # type: ignore[override]
                       context: grpc.aio.ServicerContext) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        request_id = new_request_id(_metadata(context, REQUEST_ID_KEY))
        record = RequestRecord(GENERATE_API, request_id)
        with bind_request_id(request_id):
            try:
                self._authenticate(context)
                if self.core.catalog.get(request.model) is not None:
                    record.admit(request.model)
                with self.core.track():
                    stream = await self.core.pipeline.start(to_generation(self.core, request, request_id),
                                                            self.core.deadline())
                    record.stream = stream
                    try:
                        async for delta in stream.deltas():
                            record.on_tokens(len(delta.token_ids))
                            if delta.text or delta.token_ids or delta.finish_reason:
                                yield _response(request_id, stream, delta)
                    finally:
                        stream.close()
                record.finish(grpc.StatusCode.OK.name)
            except GatewayError as error:
                record.finish(error.kind.grpc_code.name)
                context.set_trailing_metadata(((REQUEST_ID_KEY, request_id),))
                await context.abort(error.kind.grpc_code, error.message)
            except asyncio.CancelledError:
                record.finish(grpc.StatusCode.CANCELLED.name)
                raise
            except Exception:
                log.exception("generate failed")
                record.finish(grpc.StatusCode.INTERNAL.name)
                await context.abort(grpc.StatusCode.INTERNAL, "internal error")

    async def ListModels(self, request: gateway_pb2.ListModelsRequest,  # type: ignore[override]
                         context: grpc.aio.ServicerContext) -> gateway_pb2.ListModelsResponse:
        try:
            self._authenticate(context)
        except GatewayError as error:
            await context.abort(error.kind.grpc_code, error.message)
        return gateway_pb2.ListModelsResponse(models=[
            gateway_pb2.ModelCard(id=model.name, max_model_len=model.context_len)
            for model in self.core.served_models()])
