"""OpenAI's Responses API (/v1/responses): input items -> a ChatTurn, events -> output items, streamed as
named events with increasing `sequence_number`. `previous_response_id` continues a stored conversation
(response_store.py, NATS JetStream KV); `store: false` keeps nothing.

A stream is: response.created, response.in_progress, then per output item output_item.added, for a message
content_part.added, output_text.delta..., output_text.done, content_part.done, for a function call
function_call_arguments.delta..., function_call_arguments.done, then output_item.done; and last
response.completed (or response.incomplete when max_output_tokens cut it short).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from engine_core.structured_output import StructuredOutput
from services.gateway.api_models.base import validated
from services.gateway.api_models.openai import JsonObjectFormat
from services.gateway.api_models.responses import (
    RESPONSE_ID,
    AssistantInput,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    InputMessage,
    InstructionMessage,
    JsonSchemaTextFormat,
    ResponsesRequest,
)
from services.gateway.api_models.sampling import to_wire
from services.gateway.chat import (
    ArgsEvent,
    CallEndEvent,
    CallStartEvent,
    ChatRun,
    ChatTurn,
    FinishEvent,
    TextEvent,
    collect,
)
from services.gateway.errors import ErrorKind, GatewayError
from services.gateway.images import ImagePart, check_text
from services.gateway.openai_shapes import content_text, tool_call_message, tool_choice_of
from services.gateway.pipeline import Usage
from services.gateway.rest import (
    PRINCIPAL,
    STORE_KEY,
    admitted,
    dumps,
    json_body,
    served_headers,
    start_turn,
    stream_response,
)
from services.gateway.schema_support import json_schema_output
from services.gateway.tenancy.principal import DEFAULT_TENANT
from services.gateway.tool_calls import parse_tool

RESPONSES_PATH = "/v1/responses"
RESPONSES_API = "responses"
INPUT_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


def _new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(16)


@dataclass(frozen=True)
class Conversation:
    """A stored conversation: chat messages (an image stands in the text as IMAGE_MARKER) and its images' URLs,
    in the order of their markers."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    image_urls: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ResponseRequest:
    turn: ChatTurn
    new_messages: list[dict[str, Any]]  # this request's input, as chat messages (stored for follow-ups)
    history: list[dict[str, Any]]  # the stored conversation it continues
    instructions: str | None
    stream: bool
    store: bool
    previous_response_id: str | None
    echo: dict[str, Any] = field(default_factory=dict)  # request fields the response object repeats


def _input_messages(raw: str | list[InputItem], images: list[ImagePart]) -> list[dict[str, Any]]:
    if isinstance(raw, str):
        check_text(raw, "input")
        return [{"role": "user", "content": raw}]
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(raw):
        param = f"input[{index}]"
        if isinstance(item, (InputMessage, InstructionMessage, AssistantInput)):
            content = content_text(item.content, f"{param}.content", images)
            messages.append({"role": INPUT_ROLES[item.role], "content": content})
        elif isinstance(item, FunctionCallItem):
            if not messages or messages[-1]["role"] != "assistant":
                messages.append({"role": "assistant", "content": ""})
            call = tool_call_message(item.call_id, item.name, item.arguments)
            messages[-1].setdefault("tool_calls", []).append(call)
        else:
            assert isinstance(item, FunctionCallOutputItem), "other roles are refused when checked"
            check_text(item.output, f"{param}.output")
            messages.append({"role": "tool", "content": item.output, "tool_call_id": item.call_id})
    return messages


def _text_format(request: ResponsesRequest) -> StructuredOutput | None:
    fmt = request.text.format
    if isinstance(fmt, JsonSchemaTextFormat):
        return json_schema_output(fmt.schema_, "text.format.schema")
    return StructuredOutput("json_object", "") if isinstance(fmt, JsonObjectFormat) else None


def parse_response_request(
    request: ResponsesRequest, body: dict[str, Any], history: Conversation | None = None
) -> ResponseRequest:
    """The checked body (`body` as sent, for the fields the response repeats), continuing `history`: the stored
    conversation of its previous_response_id."""
    history = history or Conversation()
    # the stored conversation's images first: their markers come first in the prompt
    images = [ImagePart(f"previous_response_id (its image {n})", url) for n, url in enumerate(history.image_urls)]
    new_messages = _input_messages(request.input, images)
    if request.instructions:
        check_text(request.instructions, "instructions")
    tools = tuple(
        parse_tool(tool.name, tool.description, tool.parameters, f"tools[{index}]")
        for index, tool in enumerate(request.tools)
    )
    sampling = to_wire(request, request.max_output_tokens, "max_output_tokens")
    system = [{"role": "system", "content": request.instructions}] if request.instructions else []
    turn = ChatTurn(
        model=request.model,
        messages=system + history.messages + new_messages,
        sampling=sampling,
        max_tokens_param="max_output_tokens",
        tools=tools,
        tool_choice=tool_choice_of(request.tool_choice, bool(tools)),
        parallel_tool_calls=request.parallel_tool_calls,
        response_format=_text_format(request),
        cache_salt=request.cache_salt,
        prompt_param="input",
        images=tuple(images),
    )
    # the fields the response object repeats, as the client sent them
    fmt = (body.get("text") or {}).get("format")
    echo = {
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "parallel_tool_calls": request.parallel_tool_calls,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "text": {"format": {"type": "text"} if fmt is None else fmt},
        "tool_choice": body.get("tool_choice", "auto" if tools else "none"),
        "tools": body.get("tools") or [],
        "metadata": request.metadata,
        "user": request.user,
    }
    return ResponseRequest(
        turn,
        new_messages,
        history.messages,
        request.instructions,
        stream=request.stream,
        store=request.store,
        previous_response_id=request.previous_response_id,
        echo=echo,
    )


# ---- the response object -------------------------------------------------------------------------------


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = (
        [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" else []
    )
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def response_object(
    response_id: str, created: int, req: ResponseRequest, status: str, output: list[dict[str, Any]], usage: Usage | None
) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "model": req.turn.model,
        "output": output,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "store": req.store,
        "truncation": "disabled",
        "usage": usage_body(usage) if usage is not None else None,
        **req.echo,
    }


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The output items as chat messages, for the stored conversation."""
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    for item in output:
        if item["type"] == "message":
            message["content"] += "".join(part["text"] for part in item["content"])
        else:
            message.setdefault("tool_calls", []).append(
                tool_call_message(item["call_id"], item["name"], item["arguments"])
            )
    return [message]


# ---- handlers --------------------------------------------------------------------------------------------


def _tenant(request: web.Request) -> str:
    """Whose stored responses the request may see: its principal's tenant."""
    principal = request.get(PRINCIPAL)
    return principal.tenant_id if principal is not None else DEFAULT_TENANT


async def _history(request: web.Request, previous: str | None) -> Conversation:
    if previous is None:
        return Conversation()
    record = await request.app[STORE_KEY].get(previous, _tenant(request))
    if record is None:
        raise GatewayError(ErrorKind.NOT_FOUND, f"no stored response {previous!r}", "previous_response_id")
    return Conversation(list(record["messages"]), list(record.get("image_urls", [])))


async def create_response(request: web.Request) -> web.StreamResponse:
    async with admitted(request, RESPONSES_API) as record:
        body = await json_body(request)
        checked = validated(ResponsesRequest, body)
        req = parse_response_request(checked, body, await _history(request, checked.previous_response_id))
        run = await start_turn(request, req.turn, record)
        response_id, created = _new_id("resp_"), int(time.time())
        try:
            if req.stream:
                events = ResponseEvents(request, req, run, response_id, created)
                return await stream_response(request, run, record, events.frames(), events.error_frame)
            [result] = await collect(run)
            output = ([message_item(_new_id("msg_"), result.text, "completed")] if result.text else []) + [
                call_item(_new_id("fc_"), c.call_id, c.name, c.arguments, "completed") for c in result.calls
            ]
            status = "incomplete" if result.finish_reason == "length" else "completed"
            obj = response_object(response_id, created, req, status, output, run.usage)
            await _store(request, req, obj)
            record.finish(200)
            return web.json_response(obj, headers=served_headers(request, run), dumps=dumps)
        finally:
            run.close()


async def _store(request: web.Request, req: ResponseRequest, obj: dict[str, Any]) -> None:
    if req.store:
        messages = req.history + req.new_messages + output_messages(obj["output"])
        image_urls = [image.url for image in req.turn.images]  # the conversation's, stored ones first
        stored = {"response": obj, "messages": messages, "image_urls": image_urls}
        await request.app[STORE_KEY].put(obj["id"], stored, _tenant(request))


async def get_response(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    is_id = RESPONSE_ID.fullmatch(response_id)
    record = await request.app[STORE_KEY].get(response_id, _tenant(request)) if is_id else None
    if record is None:
        raise GatewayError(ErrorKind.NOT_FOUND, f"no stored response {response_id!r}")
    return web.json_response(record["response"], dumps=dumps)


async def delete_response(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    if not (RESPONSE_ID.fullmatch(response_id) and await request.app[STORE_KEY].delete(response_id, _tenant(request))):
        raise GatewayError(ErrorKind.NOT_FOUND, f"no stored response {response_id!r}")
    return web.json_response({"id": response_id, "object": "response", "deleted": True})


class ResponseEvents:
    """One streamed response: its output items as they form, and the event sequence. Only `frames` writes."""

    def __init__(
        self, request: web.Request, req: ResponseRequest, run: ChatRun, response_id: str, created: int
    ) -> None:
        self.request, self.req, self.run = request, req, run
        self.response_id, self.created = response_id, created
        self.output: list[dict[str, Any]] = []  # finished items
        self._sequence = 0
        self._message: tuple[str, list[str]] | None = None  # the open message item: id, texts

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return f"event: {kind}\ndata: {dumps(data)}\n\n".encode()

    def error_frame(self, error: GatewayError) -> bytes:
        _, _, error_type, code = error.kind.value
        return self._event(
            "error",
            code=code,
            message=error.message,
            param=error.param,
            error={"type": error_type, "code": code, "message": error.message, "param": error.param},
        )

    def _obj(self, status: str, usage: Usage | None = None) -> dict[str, Any]:
        return response_object(self.response_id, self.created, self.req, status, list(self.output), usage)

    def _close_message(self) -> list[bytes]:
        if self._message is None:
            return []
        item_id, texts = self._message
        self._message = None
        text, index = "".join(texts), len(self.output)
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        item = message_item(item_id, text, "completed")
        self.output.append(item)
        return [
            self._event(
                "response.output_text.done",
                item_id=item_id,
                output_index=index,
                content_index=0,
                text=text,
                logprobs=[],
            ),
            self._event("response.content_part.done", item_id=item_id, output_index=index, content_index=0, part=part),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    async def frames(self) -> AsyncIterator[bytes]:
        yield self._event("response.created", response=self._obj("in_progress"))
        yield self._event("response.in_progress", response=self._obj("in_progress"))
        status = "completed"
        calls: dict[int, str] = {}  # call index -> item id
        async for event in self.run.events():
            index = len(self.output)
            if isinstance(event, TextEvent):
                if self._message is None:
                    self._message = (_new_id("msg_"), [])
                    yield self._event(
                        "response.output_item.added",
                        output_index=index,
                        item=message_item(self._message[0], "", "in_progress"),
                    )
                    yield self._event(
                        "response.content_part.added",
                        item_id=self._message[0],
                        output_index=index,
                        content_index=0,
                        part={"type": "output_text", "text": "", "annotations": []},
                    )
                self._message[1].append(event.text)
                yield self._event(
                    "response.output_text.delta",
                    item_id=self._message[0],
                    output_index=index,
                    content_index=0,
                    delta=event.text,
                    logprobs=[],
                )
            elif isinstance(event, CallStartEvent):
                for frame in self._close_message():
                    yield frame
                calls[event.call_index] = item_id = _new_id("fc_")
                yield self._event(
                    "response.output_item.added",
                    output_index=len(self.output),
                    item=call_item(item_id, event.call_id, event.name, "", "in_progress"),
                )
            elif isinstance(event, ArgsEvent):
                yield self._event(
                    "response.function_call_arguments.delta",
                    item_id=calls[event.call_index],
                    output_index=index,
                    delta=event.delta,
                )
            elif isinstance(event, CallEndEvent):
                item = call_item(calls[event.call_index], event.call_id, event.name, event.arguments, "completed")
                yield self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=event.name,
                    arguments=event.arguments,
                )
                self.output.append(item)
                yield self._event("response.output_item.done", output_index=index, item=item)
            elif isinstance(event, FinishEvent):
                status = "incomplete" if event.finish_reason == "length" else "completed"
        for frame in self._close_message():
            yield frame
        obj = self._obj(status, self.run.usage)
        await _store(self.request, self.req, obj)
        yield self._event(f"response.{status}", response=obj)
