"""Anthropic's Messages request body (/v1/messages)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, Tag, model_validator

from services.gateway.api_models.base import (
    Bool,
    JsonObject,
    NonEmptyStr,
    RequestModel,
    Str,
    by_shape,
    reported_whole,
    tag_by_type,
)
from services.gateway.api_models.openai import Stop, ToolName
from services.gateway.api_models.sampling import CoreSampling, MaxTokens


class TextBlock(RequestModel):
    type: Literal["text"]
    text: Str


class Base64Source(RequestModel):
    type: Literal["base64"]
    media_type: Str
    data: Str


class UrlSource(RequestModel):
    type: Literal["url"]
    url: Str


SOURCE_SHAPE = 'must be {"type": "base64", "media_type": "image/png", "data": ...} or {"type": "url", "url": ...}'


class ImageBlock(RequestModel):
    """User messages only."""

    type: Literal["image"]
    source: Annotated[
        Annotated[Base64Source, reported_whole(SOURCE_SHAPE), Tag("Base64")]
        | Annotated[UrlSource, reported_whole(SOURCE_SHAPE), Tag("Url")],
        by_shape(
            lambda v: tag_by_type(v, {"base64": "Base64", "url": "Url"}),
            SOURCE_SHAPE,
        ),
    ]

    @property
    def url(self) -> str:
        if isinstance(self.source, Base64Source):
            return f"data:{self.source.media_type};base64,{self.source.data}"
        return self.source.url


class ToolUseBlock(RequestModel):
    """A past tool call: assistant messages only."""

    type: Literal["tool_use"]
    id: Str = ""
    name: Str
    input: JsonObject = Field(default_factory=dict)


TextBlocks = Annotated[
    Annotated[Str, Tag("Text")] | Annotated[list[TextBlock], Tag("Blocks")],
    by_shape(
        lambda v: "Text" if isinstance(v, str) else "Blocks" if isinstance(v, list) else None,
        "must be a string or an array of text blocks",
    ),
]


class ToolResultBlock(RequestModel):
    """A tool's output: user messages only."""

    type: Literal["tool_result"]
    tool_use_id: Str
    content: TextBlocks = ""
    is_error: Bool = False


BLOCK_SHAPE = "must be a text block, an image or tool_result block (user) or a tool_use block (assistant)"
Block = Annotated[
    Annotated[TextBlock, Tag("Text")]
    | Annotated[ImageBlock, Tag("Image")]
    | Annotated[ToolUseBlock, Tag("ToolUse")]
    | Annotated[ToolResultBlock, Tag("ToolResult")],
    by_shape(
        lambda v: tag_by_type(
            v, {"text": "Text", "image": "Image", "tool_use": "ToolUse", "tool_result": "ToolResult"}
        ),
        BLOCK_SHAPE,
    ),
]


class AnthropicMessage(RequestModel):
    role: Literal["user", "assistant"]
    content: Annotated[
        Annotated[Str, Tag("Text")] | Annotated[list[Block], Tag("Blocks")],
        by_shape(
            lambda v: "Text" if isinstance(v, str) else "Blocks" if isinstance(v, list) else None,
            "must be a string or an array of content blocks",
        ),
    ]


class AnthropicTool(RequestModel):
    name: ToolName
    description: Str | None = None
    input_schema: JsonObject | None = None  # a JSON Schema; none: no input


TOOL_CHOICE_SHAPE = 'must be {"type": "auto" | "any" | "none"} or {"type": "tool", "name": ...}'


class AnthropicToolChoice(RequestModel):
    type: Literal["auto", "any", "none", "tool"]
    name: NonEmptyStr | None = None  # the tool, with type "tool"
    disable_parallel_tool_use: Bool = False

    @model_validator(mode="after")
    def _named(self) -> AnthropicToolChoice:
        if self.type == "tool" and self.name is None:
            raise ValueError("names no tool")
        return self


class MessagesRequest(CoreSampling):
    model: NonEmptyStr
    max_tokens: MaxTokens
    messages: Annotated[list[AnthropicMessage], Field(min_length=1)]
    system: TextBlocks | None = None
    stop_sequences: Stop | None = None
    stream: Bool = False
    tools: tuple[AnthropicTool, ...] = ()
    tool_choice: Annotated[AnthropicToolChoice, reported_whole(TOOL_CHOICE_SHAPE)] | None = None
