"""A chat turn, whichever API it came through (Chat Completions, Responses, Anthropic Messages, gRPC):
render the prompt (tools in the model's own format), pick the grammar (tool calls or response_format), start
n generations and turn their tokens into events: text, tool calls and their argument deltas, logprobs, finish.

Front ends build a ChatTurn, call `start_chat`, and shape the events into their wire format; they never see
tokens or grammars. One ChatRun's state is written only by its own `events()`.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import jsonschema

from engine_core.structured_output import StructuredOutput
from mesh.compute.convert import structured_to_proto
from mesh.logging import get_logger
from mesh.pb import common_pb2, encoder_pb2
from services.gateway.catalog import ServedModel, off_loop
from services.gateway.core import GatewayCore
from services.gateway.errors import ErrorKind, GatewayError, invalid
from services.gateway.image_encoding import place_images
from services.gateway.images import ImagePart, check_accepts_images
from services.gateway.pipeline import (
    NOT_FINISHED,
    Deadline,
    Delta,
    Generation,
    GenerationStream,
    Pipeline,
    Placement,
    Usage,
)
from services.gateway.tenancy.limit_counters import Demand
from services.gateway.tenancy.limits import Reservation
from services.gateway.tenancy.principal import Principal
from services.gateway.tool_calls import (
    AUTO_TOOLS,
    ParsedArgs,
    ParsedCallEnd,
    ParsedCallStart,
    ParsedText,
    Tool,
    ToolCallParser,
    ToolChoice,
    check_tools,
    new_call_id,
)

log = get_logger(__name__)
MAX_N = 8  # choices per request: each is a full generation


@dataclass(frozen=True)
class ChatTurn:
    model: str
    messages: list[dict[str, Any]]  # role, content (text), and tool_calls / tool_call_id where they apply
    sampling: common_pb2.SamplingParams  # everything but the grammar and logprobs, which start_chat sets
    max_tokens_param: str  # the client's name for max_tokens, for errors
    api_max_tokens: int | None = None  # the API's own default where the client set none (completions: 16)
    stop: tuple[str, ...] = ()
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = AUTO_TOOLS
    parallel_tool_calls: bool = True
    response_format: StructuredOutput | None = None
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    cache_salt: str = ""  # vLLM's extension: enters every block key, so differently salted prompts never share KV
    traffic_class: str = ""  # the KV store's TTL class (agent | chat | ...); empty: agent with tools, else chat
    prompt_param: str = "messages"
    prompt: str | list[int] | None = None  # a raw prompt (legacy completions) instead of messages
    images: tuple[ImagePart, ...] = ()  # image_url parts in order; each one's marker is in its message's content


@dataclass(frozen=True)
class TokenInfo:
    token: str
    logprob: float
    token_bytes: bytes
    top: list[tuple[str, float, bytes]]  # the most likely tokens at this position, most likely first


# ---- events (choice: which of the n) ---------------------------------------------------------------------


@dataclass(frozen=True)
class TextEvent:
    choice: int
    text: str


@dataclass(frozen=True)
class TokensEvent:
    """The tokens behind the next events (before a stop string cut them), with logprobs when asked for."""

    choice: int
    token_ids: list[int]
    raw_logprobs: list[common_pb2.TokenLogprob]
    tokens: list[TokenInfo]  # described for the APIs: empty unless logprobs were asked for


@dataclass(frozen=True)
class CallStartEvent:
    choice: int
    call_index: int
    call_id: str
    name: str


@dataclass(frozen=True)
class ArgsEvent:
    choice: int
    call_index: int
    call_id: str
    delta: str


@dataclass(frozen=True)
class CallEndEvent:
    choice: int
    call_index: int
    call_id: str
    name: str
    arguments: str  # the deltas joined
    is_valid: bool  # parses and validates against the tool's schema (always, unless cut off by max_tokens)


@dataclass(frozen=True)
class FinishEvent:
    choice: int
    finish_reason: str  # stop | length | tool_calls
    stop_string: str | None  # the stop string that ended it, if one did


ChatEvent = TextEvent | TokensEvent | CallStartEvent | ArgsEvent | CallEndEvent | FinishEvent


@dataclass
class ChoiceRun:
    """One of the n generations: its stream, and the parser that finds its tool calls."""

    index: int
    stream: GenerationStream
    model: ServedModel
    turn: ChatTurn
    parser: ToolCallParser | None  # None when tools cannot be called (no tools, or tool_choice none)
    on_tokens: Callable[[int], None] = lambda num_tokens: None  # telemetry: tokens as they arrive
    _calls: list[tuple[str, str]] = field(default_factory=list)  # (id, name) per call, in order

    async def events(self) -> AsyncIterator[ChatEvent]:
        async for delta in self.stream.deltas():
            self.on_tokens(len(delta.token_ids))
            for event in self._on_delta(delta):
                yield event

    def _on_delta(self, delta: Delta) -> Iterator[ChatEvent]:
        if delta.token_ids:
            tokens = [self._token_info(lp) for lp in delta.logprobs] if self.turn.logprobs else []
            yield TokensEvent(self.index, delta.token_ids, delta.logprobs, tokens)
        yield from self._parse(delta.text)
        if delta.finish_reason == NOT_FINISHED:
            return
        if self.parser is not None:
            yield from self._events(self.parser.finish())
        yield FinishEvent(self.index, self._finish_reason(), self.stream.stop_string)

    def _finish_reason(self) -> str:
        if self.stream.finish_reason == common_pb2.FINISH_REASON_LENGTH:
            return "length"
        return "tool_calls" if self._calls else "stop"

    def _parse(self, text: str) -> Iterator[ChatEvent]:
        if not text:
            return
        if self.parser is None:
            yield TextEvent(self.index, text)
            return
        yield from self._events(self.parser.push(text))

    def _events(self, parsed: Sequence[Any]) -> Iterator[ChatEvent]:
        for item in parsed:
            if isinstance(item, ParsedText):
                yield TextEvent(self.index, item.text)
            elif isinstance(item, ParsedCallStart):
                self._calls.append((new_call_id(), item.name))
                yield CallStartEvent(self.index, item.call_index, *self._calls[item.call_index])
            elif isinstance(item, ParsedArgs):
                yield ArgsEvent(self.index, item.call_index, self._calls[item.call_index][0], item.delta)
            elif isinstance(item, ParsedCallEnd):
                call_id, name = self._calls[item.call_index]
                yield CallEndEvent(
                    self.index, item.call_index, call_id, name, item.arguments, self._is_valid(name, item.arguments)
                )

    def _is_valid(self, name: str, arguments: str) -> bool:
        tool = next((t for t in self.turn.tools if t.name == name), None)
        try:
            if tool is None:
                raise ValueError(f"unknown tool {name!r}")
            jsonschema.validate(json.loads(arguments), tool.parameters)
        except (ValueError, jsonschema.ValidationError, jsonschema.SchemaError) as exc:
            log.warning("tool call does not validate", tool=name, error=str(exc)[:200])
            return False
        return True

    def _token_info(self, logprob: common_pb2.TokenLogprob) -> TokenInfo:
        def describe(token_id: int) -> tuple[str, bytes]:
            raw = self.model.token_bytes(token_id)
            return raw.decode("utf-8", errors="replace"), raw

        token, raw = describe(logprob.token_id)
        top = [(*describe(t), lp) for t, lp in zip(logprob.top_token_ids, logprob.top_logprobs, strict=True)]
        return TokenInfo(token, logprob.logprob, raw, [(text, lp, b) for text, b, lp in top])


@dataclass
class ChatRun:
    choices: list[ChoiceRun]
    num_prompt_tokens: int
    reservation: Reservation | None = None  # what admission holds against the caller's limits
    on_close: Callable[[Usage], None] = lambda usage: None  # settles the reservation to the real usage

    @property
    def placement(self) -> Placement:
        return self.choices[0].stream.placement

    @property
    def prefill_seconds(self) -> float:
        return self.choices[0].stream.prefill_seconds

    @property
    def usage(self) -> Usage:
        """The prompt once (it is shared), the completions of every choice."""
        return Usage(
            self.num_prompt_tokens,
            sum(c.stream.num_completion_tokens for c in self.choices),
            self.choices[0].stream.num_cached_tokens,
        )

    async def events(self) -> AsyncIterator[ChatEvent]:
        """Every choice's events; with n > 1 interleaved as they come (each choice's in order)."""
        if len(self.choices) == 1:
            async for event in self.choices[0].events():
                yield event
            return
        queue: asyncio.Queue[ChatEvent | BaseException | None] = asyncio.Queue()

        async def pump(choice: ChoiceRun) -> None:
            try:
                async for event in choice.events():
                    await queue.put(event)
                await queue.put(None)
            except BaseException as exc:  # handed to the consumer, which raises it
                await queue.put(exc)

        tasks = [asyncio.ensure_future(pump(choice)) for choice in self.choices]
        try:
            num_done = 0
            while num_done < len(tasks):
                item = await queue.get()
                if item is None:
                    num_done += 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()

    def close(self) -> None:
        for choice in self.choices:
            choice.stream.close()
        on_close, self.on_close = self.on_close, lambda usage: None  # once
        on_close(self.usage)


def turn_grammar(model: ServedModel, turn: ChatTurn) -> StructuredOutput | None:
    if turn.tools and turn.tool_choice.mode != "none":
        if turn.response_format is not None:
            raise invalid("response_format", "response_format with tools is supported only with tool_choice 'none'")
        return model.tool_syntax.grammar(
            turn.tools, turn.tool_choice, turn.parallel_tool_calls, model.tokenizer.backend.token_to_id
        )
    return turn.response_format


def turn_sampling(turn: ChatTurn, grammar: StructuredOutput | None, choice: int) -> common_pb2.SamplingParams:
    sampling = common_pb2.SamplingParams()
    sampling.CopyFrom(turn.sampling)
    if grammar is not None:
        sampling.structured_output.CopyFrom(structured_to_proto(grammar))
    if turn.logprobs:
        sampling.logprobs = turn.top_logprobs
    if choice > 0 and sampling.HasField("seed"):  # each choice its own draws, reproducibly
        sampling.seed = (sampling.seed + choice) % 2**63
    return sampling


def render_prompt(model: ServedModel, turn: ChatTurn) -> list[int]:
    """Blocks while it tokenizes: called through `off_loop`."""
    if isinstance(turn.prompt, str):
        return model.encode_prompt(turn.prompt, turn.prompt_param)
    if turn.prompt is not None:
        model.check_token_ids(turn.prompt, turn.prompt_param)
        return list(turn.prompt)
    return model.render_chat(turn.messages, turn.tools)


TRAFFIC_CLASS = re.compile(r"[a-z0-9_-]{1,32}")


def traffic_class_of(turn: ChatTurn) -> str:
    """The class whose TTL the request's KV gets in the store: the client's (the x-kvmesh-traffic-class header,
    or gRPC's traffic_class), else `agent` for a request with tools (agent loops come back to their prefix for
    days) and `chat` for the rest, as DeepSeek's store keeps them (3 and 7 days by default)."""
    if turn.traffic_class:
        if not TRAFFIC_CLASS.fullmatch(turn.traffic_class):
            raise invalid(
                "traffic_class",
                "the traffic class must be 1 to 32 characters of a-z, 0-9, '_' and '-', "
                f"got {turn.traffic_class[:40]!r}",
            )
        return turn.traffic_class
    return "agent" if turn.tools else "chat"


@dataclass(frozen=True)
class RenderedPrompt:
    token_ids: list[int]
    images: tuple[encoder_pb2.PromptImage, ...]  # embeddings at the image placeholders (image_encoding)
    block_keys: tuple[bytes, ...] | None  # None with images: the pipeline hashes the widened prompt


def render_and_hash(
    model: ServedModel, turn: ChatTurn, hasher: Callable[[Sequence[int]], list[bytes]]
) -> tuple[list[int], tuple[bytes, ...]]:
    """The prompt and its block keys, in one trip to a tokenizer thread (each trip is two thread hand-offs)."""
    prompt = render_prompt(model, turn)
    return prompt, tuple(hasher(prompt))


async def render_with_images(
    core: GatewayCore, model: ServedModel, turn: ChatTurn, request_id: str, cache_salt: str
) -> RenderedPrompt:
    """The prompt; with images, each one's placeholder widened to its embeddings' length (image_encoding)."""
    if not turn.images:
        hasher = core.pipeline.key_hasher(model.name, cache_salt)
        prompt, block_keys = await off_loop(render_and_hash, model, turn, hasher)
        return RenderedPrompt(prompt, (), block_keys)
    if core.images is None:
        raise GatewayError(ErrorKind.UNAVAILABLE, "this gateway does not take images")
    check_accepts_images(model, turn.images)
    prompt = await off_loop(render_prompt, model, turn)
    encoded = await core.images.encode_all(model.name, turn.images, request_id)
    return RenderedPrompt(*place_images(model, prompt, encoded, turn.prompt_param), None)


async def reserve(
    core: GatewayCore, principal: Principal | None, request_id: str, turn: ChatTurn, generations: list[Generation]
) -> Reservation | None:
    """Admission against the caller's limits, once the prompt is known and checked: the prompt plus max_tokens per
    choice (or the rest of the context); a partly fitting request runs with the lower ceiling it was granted."""
    first = generations[0]
    asked = first.sampling.max_tokens if first.sampling.HasField("max_tokens") else None
    num_prompt = len(first.prompt_token_ids)
    demand = Demand(request_id, num_prompt, asked or first.model.context_len - num_prompt, turn.n, first.model.name)
    reservation = await core.reserve(principal, demand)
    if reservation is not None and reservation.is_clamped:
        for generation in generations:
            generation.sampling.max_tokens = reservation.max_tokens
    return reservation


async def start_all(
    pipeline: Pipeline, generations: list[Generation], deadline: Deadline
) -> list[GenerationStream | BaseException]:
    """Each generation's stream, or the exception that stopped it. One generation (n=1, nearly every request) is
    awaited in place: gathering it would cost a task and a turn of the event loop before routing starts."""
    if len(generations) == 1:
        try:
            return [await pipeline.start(generations[0], deadline)]
        except Exception as exc:  # as gather's return_exceptions: the caller settles, then raises it
            return [exc]
    return await asyncio.gather(*(pipeline.start(g, deadline) for g in generations), return_exceptions=True)


async def start_chat(
    core: GatewayCore,
    turn: ChatTurn,
    request_id: str,
    on_tokens: Callable[[int], None] = lambda num_tokens: None,
    principal: Principal | None = None,
) -> ChatRun:
    """Render, check, admit against the principal's limits and start every choice (routing and prefill done:
    the serving workers are known)."""
    if not 1 <= turn.n <= MAX_N:
        raise invalid("n", f"'n' must be between 1 and {MAX_N}, got {turn.n}")
    model = core.catalog.require(turn.model)
    check_tools(turn.tools, turn.tool_choice)
    traffic_class = traffic_class_of(turn)
    cache_salt = core.cache_salt(principal, turn.cache_salt)
    rendered = await render_with_images(core, model, turn, request_id, cache_salt)
    prompt = rendered.token_ids
    grammar = turn_grammar(model, turn)
    generations = [
        core.generation(
            request_id if turn.n == 1 else f"{request_id}-{i}",
            model,
            prompt,
            turn_sampling(turn, grammar, i),
            turn.stop,
            cache_salt,
            traffic_class,
            turn.prompt_param,
            turn.max_tokens_param,
            rendered.images,
            turn.api_max_tokens,
            rendered.block_keys,
        )
        for i in range(turn.n)
    ]
    reservation = await reserve(core, principal, request_id, turn, generations)

    def settle(usage: Usage) -> None:
        if reservation is not None and core.limiter is not None:
            price = reservation.demand.price
            micros = price.micros(usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens) if price else 0
            core.limiter.settle_soon(reservation, usage.prompt_tokens + usage.completion_tokens, micros)

    try:
        results = await start_all(core.pipeline, generations, core.deadline())
    except BaseException:
        settle(Usage(0, 0, 0))
        raise
    streams = [r for r in results if isinstance(r, GenerationStream)]
    failures = [r for r in results if not isinstance(r, GenerationStream)]
    if failures:
        for stream in streams:
            stream.close()
        settle(Usage(sum(s.num_prompt_tokens for s in streams[:1]), sum(s.num_completion_tokens for s in streams), 0))
        raise failures[0]
    can_call = bool(turn.tools) and turn.tool_choice.mode != "none"
    choices = [
        ChoiceRun(i, stream, model, turn, ToolCallParser(model.tool_syntax) if can_call else None, on_tokens)
        for i, stream in enumerate(streams)
    ]
    return ChatRun(choices, len(prompt), reservation, settle)


@dataclass
class ChoiceResult:
    """One choice, whole: what a non-streaming response returns."""

    index: int
    text: str = ""
    calls: list[CallEndEvent] = field(default_factory=list)
    logprobs: list[TokenInfo] = field(default_factory=list)
    finish_reason: str = "stop"
    stop_string: str | None = None


async def collect(run: ChatRun, on_event: Any = None) -> list[ChoiceResult]:
    """Every choice's whole output (the same events a stream sends, joined)."""
    results = [ChoiceResult(choice.index) for choice in run.choices]
    texts: list[list[str]] = [[] for _ in run.choices]
    async for event in run.events():
        if on_event is not None:
            on_event(event)
        result = results[event.choice]
        if isinstance(event, TextEvent):
            texts[event.choice].append(event.text)
        elif isinstance(event, TokensEvent):
            result.logprobs.extend(event.tokens)
        elif isinstance(event, CallEndEvent):
            result.calls.append(event)
        elif isinstance(event, FinishEvent):
            result.finish_reason, result.stop_string = event.finish_reason, event.stop_string
    for result, parts in zip(results, texts, strict=True):  # one of each per choice
        result.text = "".join(parts)
    return results
