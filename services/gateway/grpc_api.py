"""The Gateway gRPC service: Generate runs a chat turn exactly as the REST APIs do (chat.py: tools,
structured output, logprobs, n, images), streaming one message per event; ListModels. The key comes in
`authorization: Bearer <key>` metadata. GatewayError -> status code happens in errors.py
(ErrorKind.grpc_code); this module only converts messages."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio

from engine_core.sampling_params import SamplingParamsError
from engine_core.structured_output import StructuredOutput
from mesh.compute.convert import sampling_from_proto
from mesh.logging import REQUEST_ID_KEY, bind_request_id, get_logger
from mesh.pb import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.gateway.api_models.base import MAX_MESSAGES, validated_part
from services.gateway.api_models.openai import CHAT_MESSAGE, MAX_STOP_STRINGS
from services.gateway.auth import bearer_key
from services.gateway.chat import (
    ArgsEvent,
    CallStartEvent,
    ChatEvent,
    ChatRun,
    ChatTurn,
    FinishEvent,
    TextEvent,
    TokensEvent,
    start_chat,
)
from services.gateway.core import GatewayCore, check_scope, new_request_id
from services.gateway.errors import ErrorKind, GatewayError, invalid
from services.gateway.images import ImagePart
from services.gateway.openai_shapes import chat_message, tool_call_message
from services.gateway.schema_support import checked_grammar, json_schema_output
from services.gateway.telemetry import RequestRecord
from services.gateway.tenancy.principal import Principal
from services.gateway.tool_calls import Tool, ToolChoice, parse_tool

GENERATE_API = "grpc.generate"
log = get_logger(__name__)


def _metadata(context: grpc.aio.ServicerContext, key: str) -> str | None:
    for item_key, value in context.invocation_metadata() or ():
        if item_key == key:
            return str(value)
    return None


def _messages(request: gateway_pb2.GenerateRequest, images: list[ImagePart]) -> list[dict[str, Any]]:
    if len(request.messages) > MAX_MESSAGES:
        raise invalid("messages", f"'messages' takes at most {MAX_MESSAGES} items, got {len(request.messages)}")
    messages = []
    for index, message in enumerate(request.messages):
        param = f"messages[{index}]"
        if message.parts and message.content:
            raise invalid(f"{param}.parts", f"'{param}': give content or parts, not both")
        content: Any = (
            [_part(part, f"{param}.parts[{n}]") for n, part in enumerate(message.parts)]
            if message.parts
            else message.content
        )
        raw: dict[str, Any] = {"role": message.role, "content": content}
        if message.tool_calls:
            raw["tool_calls"] = [tool_call_message(c.id, c.name, c.arguments) for c in message.tool_calls]
        if message.tool_call_id:
            raw["tool_call_id"] = message.tool_call_id
        field = "parts" if message.parts else "content"
        try:
            checked = validated_part(CHAT_MESSAGE, raw, param)
        except GatewayError as error:  # the REST shape's `content` is this message's `parts`
            raise _renamed(error, f"{param}.content", f"{param}.{field}") from None
        messages.append(chat_message(checked, param, images, content_field=field))
    return messages


def _renamed(error: GatewayError, old: str, new: str) -> GatewayError:
    if error.param is None or not error.param.startswith(old):
        return error
    return GatewayError(error.kind, error.message.replace(old, new), new + error.param[len(old) :])


def check_sampling(sampling: common_pb2.SamplingParams) -> None:
    """A caller's SamplingParams, read as the engine reads them (mesh.compute.convert): a bad value is a 400
    naming the parameter, before routing. The grammar is not read here: response_format sets it."""
    without_grammar = common_pb2.SamplingParams()
    without_grammar.CopyFrom(sampling)
    without_grammar.ClearField("structured_output")
    try:
        sampling_from_proto(without_grammar)
    except SamplingParamsError as exc:
        raise invalid(exc.param, str(exc)) from None


def _part(part: gateway_pb2.ContentPart, param: str) -> dict[str, Any]:
    """A part in Chat Completions' shape, for the one parser of messages."""
    kind = part.WhichOneof("kind")
    if kind == "text":
        return {"type": "text", "text": part.text}
    if kind == "image":
        image = part.image
        if image.data:  # checked as bytes downstream (PNG or JPEG); the type here only labels the URL
            mime = "image/png" if image.data.startswith(b"\x89PNG") else "image/jpeg"
            return {
                "type": "image_url",
                "image_url": {"url": f"data:{mime};base64," + base64.b64encode(image.data).decode()},
            }
        return {"type": "image_url", "image_url": {"url": image.url}}
    raise invalid(param, f"'{param}' must have text or image")


def _prompt(
    request: gateway_pb2.GenerateRequest, images: list[ImagePart]
) -> tuple[list[dict[str, Any]], str | list[int] | None, str]:
    """(messages, raw prompt, the field it came from) from exactly one of messages, prompt, prompt_token_ids."""
    given = [
        name
        for name, present in (
            ("messages", bool(request.messages)),
            ("prompt", bool(request.prompt)),
            ("prompt_token_ids", bool(request.prompt_token_ids)),
        )
        if present
    ]
    if len(given) != 1:
        raise invalid("messages", "give exactly one of messages, prompt and prompt_token_ids")
    if given[0] == "messages":
        return _messages(request, images), None, "messages"
    if given[0] == "prompt":
        return [], request.prompt, "prompt"
    return [], list(request.prompt_token_ids), "prompt_token_ids"


def _tools(request: gateway_pb2.GenerateRequest) -> tuple[Tool, ...]:
    tools = []
    for index, tool in enumerate(request.tools):
        try:
            parameters = json.loads(tool.parameters_json) if tool.parameters_json else None
        except ValueError:
            raise invalid(f"tools[{index}].parameters_json", "tool parameters must be JSON text") from None
        tools.append(parse_tool(tool.name, tool.description, parameters, f"tools[{index}]"))
    return tuple(tools)


def _tool_choice(choice: str, has_tools: bool) -> ToolChoice:
    if not choice:
        return ToolChoice("auto" if has_tools else "none")
    return ToolChoice(choice) if choice in ("none", "auto", "required") else ToolChoice("named", choice)


def _response_format(request: gateway_pb2.GenerateRequest) -> StructuredOutput | None:
    if not request.HasField("response_format"):
        return None
    kind = request.response_format.WhichOneof("kind")
    if kind == "json_object":
        return StructuredOutput("json_object", "")
    if kind == "json_schema":
        try:
            schema = json.loads(request.response_format.json_schema)
        except ValueError:
            raise invalid("response_format.json_schema", "the schema must be JSON text") from None
        return json_schema_output(schema, "response_format.json_schema")
    if kind == "regex":
        return checked_grammar("regex", request.response_format.regex, "response_format.regex")
    return None


def to_turn(core: GatewayCore, request: gateway_pb2.GenerateRequest) -> ChatTurn:
    core.catalog.require(request.model)
    images: list[ImagePart] = []
    messages, prompt, prompt_param = _prompt(request, images)
    sampling = request.sampling if request.HasField("sampling") else common_pb2.SamplingParams()
    check_sampling(sampling)
    if len(request.stop) > MAX_STOP_STRINGS:
        raise invalid("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(request.stop)}")
    tools = _tools(request)
    logprobs = sampling.HasField("logprobs")
    wire = common_pb2.SamplingParams()
    wire.CopyFrom(sampling)
    wire.ClearField("logprobs")  # start_chat sets it from the turn
    wire.ClearField("structured_output")  # only response_format sets a grammar here: it is checked first
    return ChatTurn(
        model=request.model,
        messages=messages,
        sampling=wire,
        max_tokens_param="sampling.max_tokens",
        stop=tuple(request.stop),
        tools=tools,
        tool_choice=_tool_choice(request.tool_choice, bool(tools)),
        parallel_tool_calls=request.parallel_tool_calls if request.HasField("parallel_tool_calls") else True,
        response_format=_response_format(request),
        n=request.n or 1,
        logprobs=logprobs,
        top_logprobs=sampling.logprobs if logprobs else 0,
        cache_salt=request.cache_salt,
        traffic_class=request.traffic_class,
        prompt_param=prompt_param,
        prompt=prompt,
        images=tuple(images),
    )


def _response(request_id: str, run: ChatRun, event: ChatEvent) -> gateway_pb2.GenerateResponse | None:
    placement = run.choices[event.choice].stream.placement
    response = gateway_pb2.GenerateResponse(
        request_id=request_id,
        index=event.choice,
        prefill_worker=placement.prefill_worker,
        decode_worker=placement.decode_worker,
    )
    if isinstance(event, TokensEvent):
        response.token_ids.extend(event.token_ids)
        response.logprobs.extend(event.raw_logprobs)
    elif isinstance(event, TextEvent):
        response.text = event.text
    elif isinstance(event, CallStartEvent):
        response.tool_calls.append(gateway_pb2.ToolCallDelta(index=event.call_index, id=event.call_id, name=event.name))
    elif isinstance(event, ArgsEvent):
        response.tool_calls.append(gateway_pb2.ToolCallDelta(index=event.call_index, arguments=event.delta))
    elif isinstance(event, FinishEvent):
        response.finish = event.finish_reason
        response.finish_reason = (
            common_pb2.FINISH_REASON_LENGTH if event.finish_reason == "length" else common_pb2.FINISH_REASON_STOP
        )
        usage = run.usage
        response.usage.CopyFrom(
            gateway_pb2.Usage(
                prompt_tokens=usage.prompt_tokens,
                completion_tokens=usage.completion_tokens,
                cached_tokens=usage.cached_tokens,
            )
        )
    else:
        return None
    return response


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, core: GatewayCore) -> None:
        self.core = core

    async def _authenticate(self, context: grpc.aio.ServicerContext, model: str | None = None) -> Principal:
        principal = await self.core.authenticate(bearer_key(_metadata(context, "authorization")))
        if principal is None:
            raise GatewayError(ErrorKind.INVALID_API_KEY, "missing or incorrect API key in 'authorization' metadata")
        check_scope(principal, "grpc", model if self.core.catalog.get(model or "") is not None else None)
        return principal

    async def Generate(
        self,
        request: gateway_pb2.GenerateRequest,  # type: ignore[override]
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        request_id = new_request_id(_metadata(context, REQUEST_ID_KEY))
        record = RequestRecord(GENERATE_API, request_id, ledger=self.core.ledger)
        with bind_request_id(request_id):
            try:
                record.principal = await self._authenticate(context, request.model)
                if self.core.catalog.get(request.model) is not None:
                    record.admit(request.model)
                with self.core.track():
                    turn = to_turn(self.core, request)
                    run = await start_chat(self.core, turn, request_id, record.on_tokens, record.principal)
                    record.start(run)
                    try:
                        async for event in run.events():
                            response = _response(request_id, run, event)
                            if response is not None:
                                yield response
                    finally:
                        run.close()
                record.finish(grpc.StatusCode.OK.name)
                facts = run.reservation.facts if run.reservation is not None else None
                if facts is not None:  # what is left of the caller's limits, as the REST APIs' headers say
                    context.set_trailing_metadata(tuple(facts.openai_headers().items()))
            except GatewayError as error:
                record.finish(error.kind.grpc_code.name)
                context.set_trailing_metadata(((REQUEST_ID_KEY, request_id), *error.http_headers().items()))
                await context.abort(error.kind.grpc_code, error.message_naming_param)
            except asyncio.CancelledError:
                record.finish(grpc.StatusCode.CANCELLED.name)
                raise
            except Exception:
                log.exception("generate failed")
                record.finish(grpc.StatusCode.INTERNAL.name)
                await context.abort(grpc.StatusCode.INTERNAL, "internal error")

    async def ListModels(
        self,
        request: gateway_pb2.ListModelsRequest,  # type: ignore[override]
        context: grpc.aio.ServicerContext,
    ) -> gateway_pb2.ListModelsResponse:
        try:
            await self._authenticate(context)
        except GatewayError as error:
            await context.abort(error.kind.grpc_code, error.message)
        return gateway_pb2.ListModelsResponse(
            models=[
                gateway_pb2.ModelCard(id=model.name, max_model_len=model.context_len)
                for model in self.core.served_models()
            ]
        )
